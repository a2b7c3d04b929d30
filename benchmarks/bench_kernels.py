"""Decode attention over shared prefixes: our triton backend vs FlashInfer's cascade vs no cascade.

For each case (requests in groups; a group's requests share a prefix, each request has its own
suffix and one query token), on the same q and KV pool:

- ``triton cascade``: ``TritonBackend`` on the cascade plan (shared level + unique level);
- ``flashinfer cascade``: FlashInfer's ``MultiLevelCascadeAttentionWrapper`` on the same levels
  (skipped when flashinfer is not importable); it runs on q already in planned order;
- ``triton paged``: ``TritonBackend`` on a one-level plan, each request over its whole block table
  (plain paged attention, the prefix read once per request).

Times are medians of ``triton.testing.do_bench`` (L2 flushed between runs), per layer. ``x bound``
divides the time by the floor set by reading the KV that the cascade must read (each prefix once,
each suffix once) at the HBM bandwidth. Needs CUDA. Usage: ``python benchmarks/bench_kernels.py
[--quick]``.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

import numpy as np
import torch
import triton.testing
from prefix_cache.kernels.attention import launch_level
from prefix_cache.kernels.merge_state import merge_states_varlen

from prefix_cache.attention.triton_backend import TritonBackend
from prefix_cache.cascade import CascadeLevel, CascadePlan

HBM_BYTES_PER_S = 4.3e12  # H200, measured copy bandwidth (DESIGN.md section 4)
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # Llama-3-8B, one layer
DEVICE = "cuda"


@dataclass(frozen=True)
class Case:
    """``groups`` prefixes of ``prefix`` tokens, each shared by ``per_group`` requests that add
    ``suffix`` tokens of their own; every request decodes one token."""

    name: str
    groups: int
    per_group: int
    prefix: int
    suffix: int

    @property
    def batch(self) -> int:
        return self.groups * self.per_group


FULL_CASES = (
    Case("1 prefix 32768 x 128 req, suffix 256", 1, 128, 32768, 256),
    Case("16 prefixes 2048 x 16 req, suffix 256", 16, 16, 2048, 256),
)
QUICK_CASES = (
    Case("1 prefix 4096 x 32 req, suffix 128", 1, 32, 4096, 128),
    Case("4 prefixes 1024 x 8 req, suffix 128", 4, 8, 1024, 128),
)


def _block_tables(case: Case) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Pages 0.. hold the prefixes, then each request's suffix pages. Returns (prefix pages per
    group, block tables [batch, pages] int32, kv_lens [batch])."""
    assert case.prefix % PAGE_SIZE == 0, "prefixes are whole pages, as the prefix cache shares them"
    prefix_pages = case.prefix // PAGE_SIZE
    suffix_pages = -(-case.suffix // PAGE_SIZE)
    prefixes = [
        np.arange(g * prefix_pages, (g + 1) * prefix_pages, dtype=np.int32) for g in range(case.groups)
    ]
    first_suffix = case.groups * prefix_pages
    tables = np.stack(
        [
            np.concatenate(
                [prefixes[r // case.per_group], first_suffix + r * suffix_pages + np.arange(suffix_pages)]
            )
            for r in range(case.batch)
        ]
    ).astype(np.int32)
    return prefixes, tables, np.full(case.batch, case.prefix + case.suffix, dtype=np.int64)


def _level(qo_indptr, tables: list[np.ndarray], lengths: list[int], causal: bool) -> CascadeLevel:
    last = [n - (len(t) - 1) * PAGE_SIZE if len(t) else 0 for t, n in zip(tables, lengths, strict=True)]
    return CascadeLevel(
        qo_indptr=np.asarray(qo_indptr, dtype=np.int32),
        kv_indptr=np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
        kv_indices=np.concatenate(tables).astype(np.int32),
        kv_last_page_len=np.asarray(last, dtype=np.int32),
        causal=causal,
    )


def _identity_plan(levels: tuple[CascadeLevel, ...], batch: int) -> CascadePlan:
    order = np.arange(batch, dtype=np.int32)
    return CascadePlan(levels, order, order.copy(), order.astype(np.int64), PAGE_SIZE)


def _planner_class():
    """The project's ``CascadePlanner``, or None where it is not importable."""
    try:
        return importlib.import_module("prefix_cache.cascade_planner").CascadePlanner
    except (ImportError, AttributeError):
        return None


def cascade_plan(case: Case) -> tuple[CascadePlan, str]:
    """The planner's plan when it is importable, else a two-level plan built here."""
    prefixes, tables, kv_lens = _block_tables(case)
    planner_cls = _planner_class()
    if planner_cls is not None:
        return planner_cls().plan(tables, kv_lens, np.ones(case.batch, dtype=np.int64), PAGE_SIZE), "planner"
    per = case.per_group
    shared = _level(np.arange(case.groups + 1) * per, prefixes, [case.prefix] * case.groups, False)
    own = [t[len(prefixes[0]) :] for t in tables]
    unique = _level(np.arange(case.batch + 1), own, [case.suffix] * case.batch, True)
    return _identity_plan((shared, unique), case.batch), "by hand"


def paged_plan(case: Case) -> CascadePlan:
    """One causal level: every request over its whole block table."""
    _, tables, kv_lens = _block_tables(case)
    return _identity_plan((_level(np.arange(case.batch + 1), list(tables), list(kv_lens), True),), case.batch)


def kv_bytes(plan: CascadePlan, dtype: torch.dtype) -> int:
    """Bytes of K and V that ``plan`` reads: every group's KV once."""
    per_token = 2 * NUM_KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    tokens = 0
    for level in plan.levels:
        pages = np.diff(level.kv_indptr)
        tokens += int(np.where(pages > 0, (pages - 1) * plan.page_size + level.kv_last_page_len, 0).sum())
    return tokens * per_token


def _flashinfer_runner(plan: CascadePlan, dtype: torch.dtype, scale: float):
    """A closure running FlashInfer's cascade wrapper on planned-order q, or None without flashinfer."""
    try:
        import flashinfer
    except ImportError:
        return None
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(len(plan.levels), workspace, "NHD")
    arrays = [
        [
            torch.from_numpy(a).to(DEVICE)
            for a in (lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.kv_last_page_len)
        ]
        for lv in plan.levels
    ]
    wrapper.plan(
        *[list(column) for column in zip(*arrays, strict=True)],
        NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE,
        causal=True,  # the last level only; shared levels are never masked
        sm_scale=scale, q_data_type=dtype, kv_data_type=dtype,
    )  # fmt: skip
    order = torch.from_numpy(plan.query_order).to(DEVICE)

    def run(q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return wrapper.run(q, kv_cache)

    return run, order


def bench_case(case: Case, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    num_pages = case.groups * case.prefix // PAGE_SIZE + case.batch * -(-case.suffix // PAGE_SIZE)
    kv_cache = torch.randn(
        num_pages, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=dtype
    )
    q = torch.randn(case.batch, NUM_QO_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=dtype)
    scale = HEAD_DIM**-0.5
    heads = dict(num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, sm_scale=scale)

    plan, source = cascade_plan(case)
    flat = paged_plan(case)
    cascade, paged = TritonBackend(DEVICE), TritonBackend(DEVICE)
    cascade.plan(plan, **heads)
    paged.plan(flat, **heads)
    bound_bytes = kv_bytes(plan, dtype)
    bound_ms = bound_bytes / HBM_BYTES_PER_S * 1e3
    print(f"\n{case.name}: {len(plan.levels)} levels ({source}), cascade KV {bound_bytes / 1e6:.1f} MB, "
          f"no-cascade KV {kv_bytes(flat, dtype) / 1e6:.1f} MB, bound {bound_ms:.4f} ms")  # fmt: skip

    reference = paged.run(q, kv_cache)
    # (name, run, KV bytes it reads, whether it can be captured in a CUDA graph)
    runs = [
        ("triton cascade", lambda: cascade.run(q, kv_cache), bound_bytes, True),
        ("triton paged", lambda: paged.run(q, kv_cache), kv_bytes(flat, dtype), True),
    ]
    fi = _flashinfer_runner(plan, dtype, scale)
    if fi is None:
        print("  flashinfer not importable: skipped")
    else:
        fi_run, order = fi
        q_planned = q.index_select(0, order)
        # The plain wrapper is not made for capture (that needs use_cuda_graph=True buffers).
        runs.insert(1, ("flashinfer cascade", lambda: fi_run(q_planned, kv_cache), bound_bytes, False))

    rows = []
    for name, fn, read_bytes, graphable in runs:
        out = fn()
        if name == "flashinfer cascade":
            out = torch.empty_like(out).index_copy_(0, order, out)
        err = (out.float() - reference.float()).abs().max().item()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        # Replaying a graph leaves out the host's launch overhead: device time only (L2 not flushed).
        graph_ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") if graphable else None
        rows.append(
            dict(case=case.name, method=name, ms=ms, graph_ms=graph_ms, read_gb=read_bytes / 1e9,
                 tbps=read_bytes / (ms * 1e-3) / 1e12, x_bound=ms / bound_ms, err=err)
        )  # fmt: skip
        graph = f"{graph_ms:8.4f} ms in a graph" if graph_ms is not None else ""
        print(f"  {name:<20} {ms:8.4f} ms  {graph}  max |out - triton paged| = {err:.2e}")
    _print_breakdown(cascade, q, kv_cache)
    paged_ms = next(r["ms"] for r in rows if r["method"] == "triton paged")
    for r in rows:
        r["vs_paged"] = paged_ms / r["ms"]
    return rows


def _print_breakdown(backend: TritonBackend, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Time each launch of ``backend.run`` on its own: which level (or the merge) dominates."""
    parts = []
    # A one-level plan writes the output itself; elsewhere the levels write the partial rows.
    out = torch.empty_like(q) if backend._direct else backend._part_o
    for i, (sched, o_rows) in enumerate(zip(backend._levels, backend._o_rows, strict=True)):

        def level(sched=sched, o_rows=o_rows, out=out):
            launch_level(
                sched, q, kv_cache, sm_scale=backend._sm_scale, q_rows=backend._query_order,
                o_rows=o_rows, out=out, lse=backend._part_lse,
            )  # fmt: skip

        programs = sched.work.shape[0] * sched.num_kv_heads
        splits = int(sched.splits.max(initial=0))
        label = f"level {i} ({programs} programs, BLOCK_M {sched.block_m}, up to {splits} splits)"
        parts.append((label, level))
    if not backend._direct:
        final = torch.empty_like(q)
        parts.append(
            ("merge", lambda: merge_states_varlen(
                backend._part_o, backend._part_lse, backend._starts, backend._counts, final,
                out_rows=backend._query_order,
            ))
        )  # fmt: skip
    for label, fn in parts:
        print(f"      {label:<60} {triton.testing.do_bench(fn, return_mode='median'):8.4f} ms")


def _print_table(rows: list[dict]) -> None:
    """The compact summary, one line per (case, method)."""
    print(f"\n{'case':<40} {'method':<20} {'ms':>9} {'graph ms':>9} {'KV GB':>7} {'TB/s':>6} {'x bound':>8} "
          f"{'vs paged':>9}")  # fmt: skip
    for r in rows:
        graph = f"{r['graph_ms']:9.4f}" if r["graph_ms"] is not None else f"{'-':>9}"
        print(f"{r['case']:<40} {r['method']:<20} {r['ms']:9.4f} {graph} {r['read_gb']:7.3f} "
              f"{r['tbps']:6.2f} {r['x_bound']:8.2f} {r['vs_paged']:8.2f}x")  # fmt: skip
    print(
        "ms: median, L2 flushed; graph ms: CUDA-graph replay (no launch overhead, L2 warm).\n"
        "KV GB: KV the method reads (cascade: each prefix once); TB/s: that over the time (ms);\n"
        "x bound: time / (cascade KV at the HBM bandwidth); vs paged: speed-up over triton paged."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases, for a smoke run")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, Hq {NUM_QO_HEADS}, Hkv {NUM_KV_HEADS}, "
          f"D {HEAD_DIM}, page {PAGE_SIZE}; bound at {HBM_BYTES_PER_S / 1e12:.1f} TB/s")  # fmt: skip
    rows = [r for case in (QUICK_CASES if args.quick else FULL_CASES) for r in bench_case(case, dtype)]

    _print_table(rows)


if __name__ == "__main__":
    main()

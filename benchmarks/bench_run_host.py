"""Host time of an eager ``run``: compiled kernels launched directly vs through Triton's JIT path (CUDA).

For each batch of ``bench_attention.py``'s grid (bf16, same batches), the pure-Triton backend on the
default plan, planned with the dtype, and the auto backend (``create_backend("auto")``, FlashInfer
where it routes there and is installed). ``PREFIX_CACHE_TRITON_LAUNCH=jit`` makes a plan's launches
go through Triton's own per-call path (``kernels/_launch.py``); each plan is made once per mode, the
modes alternate three times and the medians are reported. Columns, µs per ``run``:

- host: time ``run`` takes on the host, 30 calls queued without a sync (the GPU is not waited for);
- back to back: 100 calls then a sync, per call: the eager cost of a layer when nothing else runs;
- GPU: a CUDA graph of 20 runs replayed (the Triton backend's kernels without any host work);
- over GPU: back to back minus GPU, the host time a layer adds to the GPU time. Where the auto
  backend routes to FlashInfer, this column instead compares the caller's ``out`` written in place
  (contiguous) with the same run through a copy (a strided ``out``).

Usage: ``python benchmarks/bench_run_host.py [--cases SUBSTRING] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_attention import CASES, build_batch, graphed

from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend

MODES = ("jit", "direct")


def per_call_us(fn, calls: int, wait: bool) -> float:
    """Microseconds per call of ``calls`` calls after a sync; ``wait``: include the final sync."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_us(fn, runs: int = 20) -> float:
    """GPU µs per call: ``runs`` calls captured in one CUDA graph, replayed (median of 5)."""
    replay, _ = graphed(lambda: [fn() for _ in range(runs)])
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / runs)
    return statistics.median(times)


def cuda_batch(case, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(tables, kv_lens, qo_lens, q, kv_cache) of ``case`` (``build_batch``), q and the NHD pool
    random on the GPU."""
    tables, kv_lens, qo_lens, num_pages = build_batch(case)
    gen = torch.Generator(device="cuda").manual_seed(1)
    kv_cache = torch.randn(num_pages, 2, case.page_size, case.hkv, case.d, generator=gen, device="cuda")
    q = torch.randn(int(qo_lens.sum()), case.hq, case.d, generator=gen, device="cuda")
    return tables, kv_lens, qo_lens, q.to(dtype), kv_cache.to(dtype)


def bench_case(case) -> dict:
    dtype = torch.bfloat16
    tables, kv_lens, qo_lens, q, kv_cache = cuda_batch(case, dtype)
    out = torch.empty_like(q)
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, case.page_size)
    heads = dict(num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, q_dtype=dtype)
    row: dict = {"case": case.name, "levels": len(plan.levels)}
    samples: dict = {}
    for _ in range(3):
        for mode in MODES:
            os.environ["PREFIX_CACHE_TRITON_LAUNCH"] = mode
            for name in ("triton", "auto"):
                backend = create_backend(name, device="cuda")
                backend.plan(plan, **heads)  # binds the launches in this mode
                row[f"{name}_route"] = getattr(backend, "route", name)

                def run(b=backend):
                    b.run(q, kv_cache, out=out)

                for _ in range(3):
                    run()
                samples.setdefault((name, mode, "host"), []).append(per_call_us(run, 30, wait=False))
                samples.setdefault((name, mode, "b2b"), []).append(per_call_us(run, 100, wait=True))
    os.environ["PREFIX_CACHE_TRITON_LAUNCH"] = "direct"
    for (name, mode, what), values in samples.items():
        row[f"{name}_{mode}_{what}_us"] = statistics.median(values)
    backend = create_backend("triton", device="cuda")
    backend.plan(plan, **heads)
    row["gpu_us"] = graph_us(lambda: backend.run(q, kv_cache, out=out))
    for name in ("triton", "auto"):
        for mode in MODES:
            row[f"{name}_{mode}_over_gpu_us"] = row[f"{name}_{mode}_b2b_us"] - row["gpu_us"]
    if row["auto_route"] == "flashinfer":
        row.update(out_placement(plan, heads, q, kv_cache))
    return row


def out_placement(plan, heads: dict, q: torch.Tensor, kv_cache: torch.Tensor) -> dict:
    """The auto backend's FlashInfer route with the caller's ``out`` contiguous (a one-level plan's
    wrapper writes it in place) and strided (written through a copy): medians of 3 alternated rounds
    of host and back-to-back µs per ``run``."""
    backend = create_backend("auto", device="cuda")
    backend.plan(plan, **heads)
    rows, hq, d = q.shape
    outs = {
        "in_place": torch.empty_like(q),
        "copy": torch.empty(rows, hq, 2 * d, dtype=q.dtype, device=q.device)[..., :d],
    }
    samples: dict = {}
    for _ in range(3):
        for how, out in outs.items():

            def run(o=out):
                backend.run(q, kv_cache, out=o)

            for _ in range(3):
                run()
            samples.setdefault(f"fi_out_{how}_host_us", []).append(per_call_us(run, 30, wait=False))
            samples.setdefault(f"fi_out_{how}_b2b_us", []).append(per_call_us(run, 100, wait=True))
    return {key: statistics.median(values) for key, values in samples.items()}


def markdown(rows: list[dict]) -> str:
    lines = [
        "| case | levels | GPU µs (graph) | triton host µs: JIT / direct | triton back to back µs: JIT / "
        "direct | triton over GPU µs: JIT / direct | auto route | auto host µs: JIT / direct | auto over "
        "GPU µs: JIT / direct |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]

    def pair(r: dict, name: str, what: str) -> str:
        return " / ".join(f"{r[f'{name}_{mode}_{what}_us']:.1f}" for mode in MODES)

    for r in rows:
        auto_over = pair(r, "auto", "over_gpu") if r["auto_route"] == "triton" else "-"
        if r["auto_route"] == "flashinfer":
            auto_over = (
                f"out in place / copied: host {r['fi_out_in_place_host_us']:.1f} / "
                f"{r['fi_out_copy_host_us']:.1f}, "
                f"back to back {r['fi_out_in_place_b2b_us']:.1f} / {r['fi_out_copy_b2b_us']:.1f}"
            )
        lines.append(
            f"| {r['case']} | {r['levels']} | {r['gpu_us']:.1f} | {pair(r, 'triton', 'host')} | "
            f"{pair(r, 'triton', 'b2b')} | {pair(r, 'triton', 'over_gpu')} | {r['auto_route']} | "
            f"{pair(r, 'auto', 'host')} | {auto_over} |"
        )
    return "\n".join(lines)


def save_rows(stem: Path, meta: dict, rows: list[dict], markdown: Callable[[list[dict]], str]) -> None:
    """Print the last row as JSON and write every row so far to ``stem``.json (meta and rows) and
    ``stem``.md (meta, then the table): a run stopped part way keeps the cases it finished."""
    print(json.dumps(rows[-1]), flush=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(f"{json.dumps(meta)}\n\n{markdown(rows)}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="only cases whose name contains this")
    parser.add_argument("--out", default="benchmarks/results", help="where run_host_h200.{md,json} go")
    args = parser.parse_args()
    import triton

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
    }
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if args.cases in case.name:
            rows.append(bench_case(case))
            save_rows(out / "run_host_h200", meta, rows, markdown)
    print(markdown(rows))


if __name__ == "__main__":
    main()

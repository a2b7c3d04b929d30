"""Attention over shared prefixes, every arm on the same inputs in one process (CUDA).

Per case (a batch: requests over a sharing tree of prefixes, shuffled physical pages, bf16), the arms:

- ``ours``: ``CascadePlanner().plan`` + ``create_backend("auto")``, exactly as an engine calls them
  (plan given the dtype); ``ours graph``: ``create_backend("auto", capacity=...)`` captured in a CUDA
  graph (its launches for the plan's ``graph_key``: FlashInfer's CUDA-graph wrappers for one-level
  plans it routes there, our fixed-capacity Triton launches otherwise);
- ``ours cascade`` / ``ours one level``: the Triton backend on the cascade the sharing thresholds keep
  (no cost model) / on one level (``max_levels=1``): the two choices the planner's cost model picks
  between;
- ``triton``: the pure-Triton backend on the default plan (no FlashInfer anywhere);
- FlashInfer: decode wrapper with and without tensor cores, paged prefill wrapper (one level, every
  request over its whole table) and our flashinfer backend on the cascade (its multi-level cascade
  wrapper). The decode and prefill wrappers' graph times are their CUDA-graph wrappers'
  (``use_cuda_graph=True``, index buffers sized for the batch), which an engine replays across steps;
  their plain wrappers captured with the plan fixed (a graph no later plan can replay: ``plan``
  replaces their index tensors) are reported beside them (``fixed_plan_graph_ms``). The cascade arm has
  only the fixed-plan capture, counted as its graph time;
- peers (``--peers DIR`` holding ``peer_kernels.py``; decode batches only): FastTree,
  RelayAttention++ and DeFT through ``peer_arms``, eager and graphed. Their code stays outside.

Every arm is first checked against an fp32 reference computed request by request from the page
tables (relative max error printed; an arm over 2e-2 is reported and left out of the comparisons).
Times are medians of ``triton.testing.do_bench`` (L2 flushed before each run); host µs is the time
``run`` takes on the host when the GPU is not the bottleneck; layer µs is the wall time per ``run``
of LAYERS runs called back to back and synchronised once, as an engine runs a step's layers eagerly:
the larger of the host and the GPU time per layer, where ``do_bench``'s L2 flush between calls hides
a host time up to the flush's own GPU time (the same inputs every layer, so a small batch's KV stays
in L2; arms slower than 2 ms eager are not run this way). The bound is max(distinct KV bytes /
measured copy bandwidth, attention FLOPs / measured bf16 matrix rate).

With ``--kv-dtypes bf16,fp8`` every case also runs over an fp8 (e4m3) copy of its KV cache, each
layer's K and V with a scale (``prefix_cache.attention.kv_layout.quantize_fp8``): our arms and
FlashInfer's planned with ``kv_dtype`` fp8 and run with the scales (peers are bf16 only), checked
against the reference on the dequantized cache; such a case's row is named ``... [fp8 KV]``, and a
table sets each fp8 row beside its bf16 row (ours bf16 / ours fp8; ours fp8 / FlashInfer's best
fp8 arm).

Usage: ``python benchmarks/bench_attention.py [--peers DIR] [--out DIR] [--cases SUBSTRING ...]
[--kv-dtypes bf16,fp8]``; ``--smoke`` runs two tiny cases on the CPU (Triton's interpreter) to
check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend
from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, quantize_fp8
from prefix_cache.attention.triton_backend import GraphCapacity

MAX_REL_ERR = 2e-2
FP8_SUFFIX = " [fp8 KV]"


@dataclass(frozen=True)
class Case:
    """Requests over a sharing tree: ``shared`` levels of (children per parent, tokens per node),
    then ``per_leaf`` requests under each deepest node, each with ``own`` tokens of its own of which
    the last ``qo`` are this step's queries (lists cycle over the requests)."""

    name: str
    shared: tuple[tuple[int, int], ...]
    per_leaf: int
    own: tuple[int, ...]
    qo: tuple[int, ...]
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page_size: int = 16
    extra: tuple[tuple[int, int], ...] = field(default=())  # (count, own == qo) prefill requests


CASES = (
    Case("1 prefix 32768 x 128 req, 256 own, decode", ((1, 32768),), 128, (256,), (1,)),
    Case("1 prefix 4096 x 64 req, 512 own", ((1, 4096),), 64, (512,), (1,)),
    Case("16 prefixes 2048 x 16 req", ((16, 2048),), 16, (256,), (1,)),
    Case("system 2048, 8 groups of 1024, 16 samples each", ((1, 2048), (8, 1024)), 16, (256,), (1,)),
    Case("1 prefix 512 x 32 req, 256 own", ((1, 512),), 32, (256,), (1,)),
    Case("1 prefix 256 x 8 req, 256 own", ((1, 256),), 8, (256,), (1,)),
    Case("SmolLM2 9/3 d64, prefix 4096 x 64", ((1, 4096),), 64, (256,), (1,), hq=9, hkv=3, d=64),
    Case("8 req x 1024, nothing shared", (), 8, (1024,), (1,)),
    Case("64 req x 4096, nothing shared", (), 64, (4096,), (1,)),
    Case("1 req x 256", (), 1, (256,), (1,)),
    Case(
        "64 decodes + 4 prefill chunks of 512 over a 4096 prefix",
        ((1, 4096),),
        68,
        (256,) * 64 + (512,) * 4,
        (1,) * 64 + (512,) * 4,
    ),
    Case("4 req, 512 new over 8192 cached (chat turn)", (), 4, (8704,), (512,)),
    Case("1 req, 8192-token causal prefill", (), 1, (8192,), (8192,)),
    Case("MHA 32/32, prefix 2048 x 32", ((1, 2048),), 32, (256,), (1,), hq=32, hkv=32),
    Case("MQA 32/1, prefix 4096 x 64", ((1, 4096),), 64, (256,), (1,), hq=32, hkv=1),
    Case("d256 16/8, prefix 2048 x 32", ((1, 2048),), 32, (256,), (1,), hq=16, hkv=8, d=256),
    Case("page 1, prefix 1024 x 16, 64 own", ((1, 1024),), 16, (64,), (1,), page_size=1),
    Case("page 64, prefix 4096 x 32", ((1, 4096),), 32, (256,), (1,), page_size=64),
    Case("4 levels: 1024 / 4 x 512 / 4 x 256, 4 samples", ((1, 1024), (4, 512), (4, 256)), 4, (128,), (1,)),
    Case("512 req, prefix 1024, decode", ((1, 1024),), 512, (128,), (1,)),
)
SMOKE_CASES = (
    Case("smoke: 1 prefix 64 x 4 req", ((1, 64),), 4, (8,), (1,), hq=4, hkv=2, d=16, page_size=4),
    Case("smoke: 2 req prefill 6 over 20", (), 2, (20,), (6,), hq=4, hkv=2, d=16, page_size=4),
)


# ------------------------------------------------------------------------------------------------
# Batches and the reference


def build_batch(case: Case, seed: int = 0):
    """(block_tables, kv_lens, qo_lens, num_pages): page ids shuffled over the whole pool."""
    ps = case.page_size
    nodes = [(0, [])]  # (tokens so far, pages)
    next_page = 0
    for fanout, tokens in case.shared:
        assert tokens % ps == 0, "shared prefixes are whole pages"
        grown = []
        for depth, pages in nodes:
            for _ in range(fanout):
                grown.append((depth + tokens, pages + list(range(next_page, next_page + tokens // ps))))
                next_page += tokens // ps
        nodes = grown
    tables, kv_lens, qo_lens = [], [], []
    r = 0
    for depth, pages in nodes:
        for _ in range(case.per_leaf):
            own, qo = case.own[r % len(case.own)], case.qo[r % len(case.qo)]
            n = -(-own // ps)
            tables.append(pages + list(range(next_page, next_page + n)))
            next_page += n
            kv_lens.append(depth + own)
            qo_lens.append(qo)
            r += 1
    perm = np.random.default_rng(seed).permutation(next_page).astype(np.int32)
    return [perm[t] for t in tables], np.array(kv_lens), np.array(qo_lens), next_page


def reference(q, kv_cache, tables, kv_lens, qo_lens, sm_scale) -> torch.Tensor:
    """fp32 attention request by request from the page tables (queries in chunks)."""
    ps, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // hkv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for table, kv_len, qo_len in zip(tables, kv_lens.tolist(), qo_lens.tolist(), strict=True):
        pages = torch.as_tensor(table[: -(-kv_len // ps)], dtype=torch.long, device=q.device)
        kv = kv_cache[pages].float()
        k = kv[:, 0].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        v = kv[:, 1].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        for c0 in range(0, qo_len, 1024):
            c1 = min(qo_len, c0 + 1024)
            s = torch.einsum("qhd,khd->hqk", q[row + c0 : row + c1].float(), k) * sm_scale
            pos = torch.arange(kv_len, device=q.device)
            limit = kv_len - qo_len + torch.arange(c0, c1, device=q.device)
            s = s.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
            out[row + c0 : row + c1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        row += qo_len
    return out


def work_of(case: Case, tables, kv_lens, qo_lens, dtype, kv_dtype=None) -> tuple[float, float]:
    """(distinct KV bytes + q and out bytes, attention FLOPs with the causal mask); the KV of
    ``kv_dtype`` (default q's ``dtype``)."""
    distinct = len(
        {int(p) for t, n in zip(tables, kv_lens.tolist(), strict=True) for p in t[: -(-n // case.page_size)]}
    )
    elem = torch.finfo(dtype).bits // 8
    kv_elem = torch.finfo(kv_dtype or dtype).bits // 8
    kv_bytes = distinct * case.page_size * 2 * case.hkv * case.d * kv_elem
    q_bytes = 2 * int(qo_lens.sum()) * case.hq * case.d * elem
    pairs = sum(q * kv - q * (q - 1) / 2 for q, kv in zip(qo_lens.tolist(), kv_lens.tolist(), strict=True))
    return kv_bytes + q_bytes, 4.0 * pairs * case.hq * case.d


# ------------------------------------------------------------------------------------------------
# Timing


def graphed(fn: Callable[[], object]) -> tuple[Callable[[], None], object]:
    """Capture one call of ``fn`` in a CUDA graph (after a warm call on a side stream): (the graph's
    replay, what the captured call returned, which each replay writes again)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    return graph.replay, captured


def time_ms(fn: Callable[[], object], cuda: bool) -> float:
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def host_us(fn: Callable[[], object], cuda: bool, calls: int = 30) -> float:
    """Host time per call while the GPU keeps up: the calls are queued without a sync."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


LAYERS = 32


def layer_us(fn: Callable[[], object], eager_ms: float) -> float | None:
    """Wall µs per call of LAYERS calls of ``fn`` in a row, one sync at the end (median of a few
    rounds); None for an arm slower than 2 ms eager, whose layers are GPU-bound anyway."""
    if eager_ms > 2.0:
        return None
    rounds = []
    for _ in range(10 if eager_ms < 0.2 else 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / LAYERS * 1e6)
    return sorted(rounds)[len(rounds) // 2]


def measure_ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s) on this GPU, random data."""
    import triton.testing

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    copy_ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: x @ y, warmup=10, rep=100, return_mode="median")
    return 2 * a.numel() / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)


# ------------------------------------------------------------------------------------------------
# Arms


@dataclass
class Arm:
    name: str
    run: Callable[[], torch.Tensor]  # returns the output, engine order [T, Hq, D]
    graph: bool = True  # whether a CUDA graph of ``run`` is meaningful
    host: bool = False  # whether to report host µs
    note: str = ""
    # What the graph time replays where it differs from ``run``: FlashInfer's CUDA-graph wrapper on the
    # same batch (``run`` is then also captured with its plan fixed, reported apart).
    graph_run: Callable[[], torch.Tensor] | None = None


def our_arms(case, tables, kv_lens, qo_lens, q, kv_cache, cuda, dtype, scales: dict) -> list[Arm]:
    """Our arms; ``scales``: the ``k_scale`` / ``v_scale`` of an fp8 ``kv_cache`` (else empty)."""
    device = q.device
    heads = dict(
        num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, q_dtype=dtype, kv_dtype=kv_cache.dtype
    )
    arms = []
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, case.page_size)
    auto = create_backend("auto", device=device)
    auto.plan(plan, **heads)
    out_auto = torch.empty_like(q)
    # Its graph time is a capture with this plan fixed ("ours graph" replays across plans).
    arms.append(Arm("ours", lambda: auto.run(q, kv_cache, out=out_auto, **scales), host=True,
                    note=f"{len(plan.levels)} levels, route {auto.route}"))  # fmt: skip

    def fixed_backend(p):
        pages = sum(level.kv_indices.shape[0] for level in p.levels)
        capacity = GraphCapacity(max_query_tokens=p.num_query_tokens, max_pages=max(pages, 1))
        backend = create_backend("auto", device=device, capacity=capacity)
        backend.plan(p, **heads)
        return backend

    if cuda:
        fixed = fixed_backend(plan)
        out_fixed = torch.empty_like(q)
        arms.append(Arm("ours graph", lambda: fixed.run(q, kv_cache, out=out_fixed, **scales),
                        note=f"fixed capacity, graph key {fixed.graph_key}"))  # fmt: skip
    thresholds_only = CascadePlanner(**({"cost_model": None} if _has_cost_model() else {}))
    for name, p in (
        ("ours cascade", thresholds_only.plan(tables, kv_lens, qo_lens, case.page_size)),
        ("ours one level", CascadePlanner(max_levels=1).plan(tables, kv_lens, qo_lens, case.page_size)),
        ("triton", plan),
    ):
        backend = create_backend("triton", device=device)
        backend.plan(p, **heads)
        buf = torch.empty_like(q)
        arms.append(Arm(name, lambda b=backend, o=buf: b.run(q, kv_cache, out=o, **scales),
                        host=name == "triton", note=f"{len(p.levels)} levels"))  # fmt: skip
    return arms


def _has_cost_model() -> bool:
    return "cost_model" in getattr(CascadePlanner, "__dataclass_fields__", {})


def paged_inputs(tables, kv_lens, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's one-level page table of the batch, on the CPU: (kv_indptr, kv_indices,
    kv_last_page_len), int32, each request's used pages in order."""
    used = [np.asarray(t[: -(-int(n) // page_size)]) for t, n in zip(tables, kv_lens, strict=True)]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum([len(u) for u in used])]), dtype=torch.int32)
    indices = torch.from_numpy(np.concatenate(used).astype(np.int32))
    lens = [int(n) - (len(u) - 1) * page_size for u, n in zip(used, kv_lens, strict=True)]
    return indptr, indices, torch.tensor(lens, dtype=torch.int32)


def flashinfer_arms(
    case, tables, kv_lens, qo_lens, q, kv_cache, dtype, skipped: dict, scales: dict
) -> list[Arm]:
    """FlashInfer's arms (over an fp8 ``kv_cache`` planned with ``kv_data_type`` fp8 and run with
    ``scales``, its ``k_scale`` and ``v_scale``). A wrapper that cannot be built or planned for this
    batch (an unsupported group size, say) is reported in ``skipped`` under its arm's name; the
    other arms still run. A CUDA-graph wrapper that fails leaves its arm without a graph time (the
    error is recorded there)."""
    try:
        import flashinfer
    except ImportError:
        return []
    device = q.device
    arms = []
    ps = case.page_size
    indptr, indices, last = paged_inputs(tables, kv_lens, ps)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    heads = (case.hq, case.hkv, case.d, ps)
    planned = dict(sm_scale=case.d**-0.5, q_data_type=dtype, kv_data_type=kv_cache.dtype)

    def workspace():
        return torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=device)

    def graph_buffers(suffix: str, qo: bool) -> dict:
        """Index buffers of this batch's size for a CUDA-graph wrapper (keywords end in ``suffix``)."""
        sized = {"paged_kv_indptr": indptr, "paged_kv_indices": indices, "paged_kv_last_page_len": last}
        if qo:
            sized["qo_indptr"] = qo_indptr
        return {name + suffix: torch.empty_like(t, device=device) for name, t in sized.items()}

    def decode(tc: bool, graph: bool) -> Callable[[], torch.Tensor]:
        buffers = graph_buffers("_buffer", qo=False) if graph else {}
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), "NHD", use_tensor_cores=tc, use_cuda_graph=graph, **buffers
        )
        w.plan(indptr.to(device), indices.to(device), last.to(device), *heads, **planned)
        return lambda: w.run(q, kv_cache, **scales)

    def prefill(graph: bool) -> Callable[[], torch.Tensor]:
        buffers = graph_buffers("_buf", qo=True) if graph else {}
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace(), "NHD", use_cuda_graph=graph, **buffers
        )
        w.plan(qo_indptr, indptr, indices, last, *heads, causal=True, **planned)
        return lambda: w.run(q, kv_cache, **scales)

    def cascade() -> Callable[[], torch.Tensor]:
        fi = create_backend("flashinfer", device=device)
        fi.plan(plan, num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, q_dtype=dtype,
                kv_dtype=kv_cache.dtype)  # fmt: skip
        buf = torch.empty_like(q)
        return lambda: fi.run(q, kv_cache, out=buf, **scales)

    def add(name: str, make: Callable[[bool], Callable[[], torch.Tensor]], graph_wrapper: bool) -> None:
        try:
            run = make(False)
        except Exception as error:
            skipped[name] = f"{type(error).__name__}: {error}"[:300]
            return
        graph_run = None
        if graph_wrapper:
            try:
                graph_run = make(True)
            except Exception as error:
                graph_run = _raises(error)
        arms.append(Arm(name, run, host=True, graph_run=graph_run))

    if bool((qo_lens == 1).all()):
        for tc in (False, True):
            add(f"flashinfer decode{' tc' if tc else ''}", lambda graph, tc=tc: decode(tc, graph), True)
    add("flashinfer prefill", prefill, True)
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, ps)
    if len(plan.levels) > 1:
        add("flashinfer cascade", lambda graph: cascade(), False)
    return arms


def _raises(error: Exception) -> Callable[[], torch.Tensor]:
    """A run that raises ``error`` (a CUDA-graph wrapper that could not be made: its graph time is
    then reported as that error)."""

    def run() -> torch.Tensor:
        raise error

    return run


def peer_arms(peers, case, tables, kv_lens, qo_lens, q, kv_cache) -> tuple[list[Arm], dict]:
    skipped: dict = {}
    if peers is None or not bool((qo_lens == 1).all()):
        return [], skipped
    peers.reset_peer_state()
    prepared = peers.peer_arms(tables, kv_lens, kv_cache, q, case.page_size, case.hq, case.hkv, case.d,
                               skipped=skipped)  # fmt: skip
    arms = []
    for name, arm in prepared.items():

        def run(arm=arm):
            arm()
            return arm._post()

        arms.append(Arm(name, run, note="; ".join(arm.notes)[:200]))
    return arms, skipped


def load_peers(path: str | None):
    if path is None:
        return None
    file = Path(path) / "peer_kernels.py"
    if not file.exists():
        print(f"peers: {file} not found, peer arms skipped")
        return None
    os.environ.setdefault("PEERK_DIR", str(Path(path).resolve()))
    spec = importlib.util.spec_from_file_location("peer_kernels", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_kernels"] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------
# One case


def fp8_copy(kv_cache: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(an fp8 copy of ``kv_cache``, its scales as ``run`` keywords, its dequantized float32 copy for
    the reference). K and V each get the scale that maps their largest magnitude to half of e4m3's
    range, as a calibrated checkpoint's would."""
    fp8 = torch.empty(kv_cache.shape, dtype=FP8_KV_DTYPE, device=kv_cache.device)
    scales, deq = {}, torch.empty(kv_cache.shape, dtype=torch.float32, device=kv_cache.device)
    for i, name in enumerate(("k_scale", "v_scale")):
        scale = float(kv_cache[:, i].abs().max()) / 224
        fp8[:, i] = quantize_fp8(kv_cache[:, i], scale)
        deq[:, i] = fp8[:, i].float() * scale
        scales[name] = scale
    return fp8, scales, deq


def bench_case(
    case: Case, peers, cuda: bool, dtype, ceilings, flashinfer_head_dims=(64, 128), kv_dtype=None
) -> dict:
    """One case's row; ``kv_dtype`` ``FP8_KV_DTYPE`` runs it over an fp8 copy of the KV (``fp8_copy``)."""
    device = "cuda" if cuda else "cpu"
    tables, kv_lens, qo_lens, num_pages = build_batch(case)
    gen = torch.Generator(device=device).manual_seed(1)
    kv_cache = torch.randn(num_pages, 2, case.page_size, case.hkv, case.d, generator=gen, device=device).to(
        dtype
    )
    q = torch.randn(int(qo_lens.sum()), case.hq, case.d, generator=gen, device=device).to(dtype)
    fp8 = kv_dtype == FP8_KV_DTYPE
    scales: dict = {}
    if fp8:
        kv_cache, scales, deq = fp8_copy(kv_cache)
        ref = reference(q, deq, tables, kv_lens, qo_lens, case.d**-0.5)
        del deq
    else:
        ref = reference(q, kv_cache, tables, kv_lens, qo_lens, case.d**-0.5)
    ref_scale = float(ref.abs().max())

    arms = our_arms(case, tables, kv_lens, qo_lens, q, kv_cache, cuda, dtype, scales)
    skipped = {}
    if cuda and case.d not in flashinfer_head_dims:
        skipped["flashinfer"] = (
            f"head_dim {case.d} not in --flashinfer-head-dims (its JIT build takes minutes)"
        )
    elif cuda:
        arms += flashinfer_arms(case, tables, kv_lens, qo_lens, q, kv_cache, dtype, skipped, scales)
    if cuda and fp8:
        skipped["peers"] = "bf16 KV only"
    elif cuda:
        try:
            peer, peer_skipped = peer_arms(peers, case, tables, kv_lens, qo_lens, q, kv_cache)
            arms += peer
            skipped.update(peer_skipped)
        except Exception as error:
            skipped["peers"] = f"{type(error).__name__}: {error}"[:300]

    results = {arm.name: measure(arm, ref, ref_scale, cuda) for arm in arms}
    row = summarise(case, results, skipped, tables, kv_lens, qo_lens, dtype, ceilings, kv_cache.dtype)
    if fp8:
        row["case"] += FP8_SUFFIX
    return row


def measure(arm: Arm, ref: torch.Tensor, ref_scale: float, cuda: bool) -> dict:
    """One arm's entry: ``rel_err`` and eager ``ms`` (``host_us``, ``layer_us``), then each CUDA-graph
    time with the relative error of the graph's own replayed output (``graph_ms`` / ``graph_rel_err``, and for
    a FlashInfer CUDA-graph wrapper also ``fixed_plan_graph_ms`` / ``fixed_plan_graph_rel_err``). A
    wrong output or an exception is recorded under ``error`` (eager: the arm then has no times) or
    ``graph_error`` / ``fixed_plan_graph_error`` (that time alone is missing)."""
    entry: dict = {"note": arm.note}

    def rel_err(out) -> float:
        return float((out.float() - ref).abs().max()) / ref_scale

    def wrong(err: float) -> bool:
        return not math.isfinite(err) or err > MAX_REL_ERR

    try:
        entry["rel_err"] = err = rel_err(arm.run())
        if wrong(err):
            entry["error"] = f"wrong output: relative error {err:.3g}"
            return entry
        entry["ms"] = time_ms(arm.run, cuda)
        if arm.host:
            entry["host_us"] = host_us(arm.run, cuda)
        if cuda:
            entry["layer_us"] = layer_us(arm.run, entry["ms"])
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {error}"[:300]
        return entry
    if not (cuda and arm.graph):
        return entry
    captures = (
        {"graph": arm.run} if arm.graph_run is None else {"graph": arm.graph_run, "fixed_plan_graph": arm.run}
    )
    for key, fn in captures.items():
        try:
            replay, out = graphed(fn)
            out.fill_(float("nan"))  # the replay must write every element again
            replay()
            entry[f"{key}_rel_err"] = err = rel_err(out)
            if wrong(err):
                entry[f"{key}_error"] = f"wrong replayed output: relative error {err:.3g}"
            else:
                entry[f"{key}_ms"] = time_ms(replay, cuda)
        except Exception as error:
            entry[f"{key}_error"] = f"{type(error).__name__}: {error}"[:300]
    return entry


def summarise(case, results, skipped, tables, kv_lens, qo_lens, dtype, ceilings, kv_dtype=None) -> dict:
    bytes_, flops = work_of(case, tables, kv_lens, qo_lens, dtype, kv_dtype)
    bandwidth, matmul = ceilings
    bound_ms = max(bytes_ / bandwidth, flops / matmul) * 1e3 if bandwidth else None
    row = {
        "case": case.name,
        "shape": f"{case.hq}/{case.hkv} d{case.d} page {case.page_size}",
        "requests": len(tables),
        "query_tokens": int(qo_lens.sum()),
        "bytes": bytes_,
        "flops": flops,
        "bound_ms": bound_ms,
        "arms": results,
        "skipped": skipped,
    }
    return derive(row)


def derive(row: dict) -> dict:
    """The comparison columns of a case, from its arms' measurements (also for stored results)."""
    results = row["arms"]

    def ms(name, key="ms"):
        return results.get(name, {}).get(key)

    ours_names = {"ours", "ours graph", "ours cascade", "ours one level", "triton"}
    fi = [r for n, r in results.items() if n.startswith("flashinfer")]
    others = [r for n, r in results.items() if n not in ours_names]

    def best(rows, *keys):
        values = [r[k] for r in rows for k in keys if r.get(k) is not None]
        return min(values) if values else None

    ours, ours_graph = ms("ours"), ms("ours graph", "graph_ms")
    # FlashInfer's fastest eager arm: its host time is what FlashInfer's own Python costs per call.
    fastest_fi = min((r for r in fi if r.get("ms")), key=lambda r: r["ms"], default={})
    cascade, one = ms("ours cascade", "graph_ms"), ms("ours one level", "graph_ms")
    # The plan the default planner chose, against the better of its two candidates (GPU time).
    chosen = ms("triton", "graph_ms")
    row.update(
        ours_ms=ours,
        ours_graph_ms=ours_graph,
        cascade_ms=ms("ours cascade"),
        cascade_graph_ms=cascade,
        one_level_ms=ms("ours one level"),
        one_level_graph_ms=one,
        triton_ms=ms("triton"),
        triton_graph_ms=chosen,
        best_flashinfer_ms=best(fi, "ms"),
        best_flashinfer_graph_ms=best(fi, "graph_ms"),
        best_peer_ms=best(others, "ms"),
        best_peer_graph_ms=best(others, "graph_ms"),
        # Captures with the plan fixed (no later plan can replay them): FlashInfer's plain wrappers
        # beside its CUDA-graph ones, the cascade arm's only capture; then the fastest capture of any
        # kind of any other arm.
        best_flashinfer_fixed_plan_graph_ms=min(
            (t for r in fi if (t := r.get("fixed_plan_graph_ms" if _ran_graph_wrapper(r) else "graph_ms"))),
            default=None,
        ),
        best_other_any_graph_ms=best(others, "graph_ms", "fixed_plan_graph_ms"),
        ours_layer_us=ms("ours", "layer_us"),
        triton_layer_us=ms("triton", "layer_us"),
        best_other_layer_us=best(others, "layer_us"),
        host_us=results.get("ours", {}).get("host_us"),
        triton_host_us=results.get("triton", {}).get("host_us"),
        flashinfer_host_us=fastest_fi.get("host_us"),
        planner_vs_best_choice=chosen / min(cascade, one) if chosen and cascade and one else None,
        tb_per_s=row["bytes"] / (ours * 1e-3) / 1e12 if ours else None,
        tflop_per_s=row["flops"] / (ours * 1e-3) / 1e12 if ours else None,
    )
    return row


def _ran_graph_wrapper(arm: dict) -> bool:
    """Whether the arm also ran a FlashInfer CUDA-graph wrapper (any ``fixed_plan_graph*`` key): its
    capture with the plan fixed is then ``fixed_plan_graph_ms``, else its ``graph_ms``."""
    return any(key.startswith("fixed_plan_graph") for key in arm)


# ------------------------------------------------------------------------------------------------
# Output


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def markdown(rows: list[dict]) -> str:
    head = (
        "| case | shape | ours eager | ours graph | cascade (graph) | one level (graph) | triton eager | "
        "best FlashInfer eager / graph / fixed-plan graph | best other eager / graph | bound | "
        "ours / best other (eager, graph, graph vs any capture) | ours / bound (eager, graph) | "
        "triton / best other (eager, fixed-plan graph vs any capture) | "
        "host µs (auto, triton, best FlashInfer) | "
        f"µs per layer, {LAYERS} eager runs in a row (ours, triton, best other; ours / best other) |"
    )
    head += "\n|" + "---|" * 15
    lines = [head]
    for r in rows:
        ratio_e = r["ours_ms"] / r["best_peer_ms"] if r["ours_ms"] and r["best_peer_ms"] else None
        ratio_g = (
            r["ours_graph_ms"] / r["best_peer_graph_ms"]
            if r["ours_graph_ms"] and r["best_peer_graph_ms"]
            else None
        )
        any_capture = r.get("best_other_any_graph_ms")
        ratio_any = r["ours_graph_ms"] / any_capture if r["ours_graph_ms"] and any_capture else None
        ours_layer, other_layer = r.get("ours_layer_us"), r.get("best_other_layer_us")
        ratio_layer = ours_layer / other_layer if ours_layer and other_layer else None
        bound = r["bound_ms"]
        to_bound = [r[k] / bound if r[k] and bound else None for k in ("ours_ms", "ours_graph_ms")]
        # The pure-Triton backend (no FlashInfer) on the planner's plan; its graph is a capture with
        # the plan fixed, so it is compared with the fastest capture of any kind.
        triton_e = r["triton_ms"] / r["best_peer_ms"] if r["triton_ms"] and r["best_peer_ms"] else None
        triton_g = r["triton_graph_ms"] / any_capture if r["triton_graph_ms"] and any_capture else None
        lines.append(
            f"| {r['case']} | {r['shape']} | {_f(r['ours_ms'])} | {_f(r['ours_graph_ms'])} | "
            f"{_f(r['cascade_graph_ms'])} | {_f(r['one_level_graph_ms'])} | {_f(r['triton_ms'])} | "
            f"{_f(r['best_flashinfer_ms'])} / {_f(r['best_flashinfer_graph_ms'])} / "
            f"{_f(r.get('best_flashinfer_fixed_plan_graph_ms'))} | "
            f"{_f(r['best_peer_ms'])} / {_f(r['best_peer_graph_ms'])} | {_f(r['bound_ms'])} | "
            f"{_f(ratio_e, '{:.2f}')}, {_f(ratio_g, '{:.2f}')}, {_f(ratio_any, '{:.2f}')} | "
            f"{_f(to_bound[0], '{:.2f}')}, {_f(to_bound[1], '{:.2f}')} | "
            f"{_f(triton_e, '{:.2f}')}, {_f(triton_g, '{:.2f}')} | "
            f"{_f(r['host_us'], '{:.0f}')}, {_f(r['triton_host_us'], '{:.0f}')}, "
            f"{_f(r.get('flashinfer_host_us'), '{:.0f}')} | "
            f"{_f(r.get('ours_layer_us'), '{:.0f}')}, {_f(r.get('triton_layer_us'), '{:.0f}')}, "
            f"{_f(r.get('best_other_layer_us'), '{:.0f}')}; {_f(ratio_layer, '{:.2f}')} |"
        )
    return "\n".join(lines)


def fp8_markdown(rows: list[dict]) -> str:
    """Each fp8 row beside the bf16 row of its case: our times at bf16 / at fp8 (eager, graph: above
    1, fp8 is faster), and ours at fp8 / FlashInfer's best fp8 arm (eager, graph; ours vs its best
    capture of any kind). Empty without fp8 rows."""
    by_name = {r["case"]: r for r in rows}
    lines = [
        "| case | ours bf16 / ours fp8 (eager, graph) | ours fp8 / best FlashInfer fp8 (eager, graph, "
        "graph vs any capture) | ours fp8 eager, graph ms | best FlashInfer fp8 eager, graph ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["case"].endswith(FP8_SUFFIX):
            continue
        base = by_name.get(r["case"].removesuffix(FP8_SUFFIX), {})

        def ratio(a, b):
            return a / b if a and b else None

        name = r["case"].removesuffix(FP8_SUFFIX)
        lines.append(
            f"| {name} | {_f(ratio(base.get('ours_ms'), r['ours_ms']), '{:.2f}')}, "
            f"{_f(ratio(base.get('ours_graph_ms'), r['ours_graph_ms']), '{:.2f}')} | "
            f"{_f(ratio(r['ours_ms'], r['best_flashinfer_ms']), '{:.2f}')}, "
            f"{_f(ratio(r['ours_graph_ms'], r['best_flashinfer_graph_ms']), '{:.2f}')}, "
            f"{_f(ratio(r['ours_graph_ms'], r.get('best_flashinfer_fixed_plan_graph_ms')), '{:.2f}')} | "
            f"{_f(r['ours_ms'])}, {_f(r['ours_graph_ms'])} | "
            f"{_f(r['best_flashinfer_ms'])}, {_f(r['best_flashinfer_graph_ms'])} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def arms_markdown(rows: list[dict]) -> str:
    lines = [
        "| case | arm | eager ms | graph ms | fixed-plan graph ms | host µs | µs per layer | rel. error "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, a in r["arms"].items():
            lines.append(
                f"| {r['case']} | {name} | {_f(a.get('ms'), '{:.4f}')} | {_f(a.get('graph_ms'), '{:.4f}')} | "
                f"{_f(a.get('fixed_plan_graph_ms'), '{:.4f}')} | "
                f"{_f(a.get('host_us'), '{:.0f}')} | {_f(a.get('layer_us'), '{:.0f}')} | "
                f"{_f(a.get('rel_err'), '{:.1e}')} | "
                f"{a.get('error', a.get('note', ''))} |"
            )
        for name, why in r["skipped"].items():
            lines.append(f"| {r['case']} | {name} | - | - | - | - | - | - | skipped: {why} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in rows]
    eager = [r["best_peer_ms"] / r["ours_ms"] if r["ours_ms"] and r["best_peer_ms"] else 0 for r in rows]
    graph = [
        r["best_peer_graph_ms"] / r["ours_graph_ms"] if r["ours_graph_ms"] and r["best_peer_graph_ms"] else 0
        for r in rows
    ]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    ax.barh(y - 0.2, eager, 0.4, label="eager")
    ax.barh(y + 0.2, graph, 0.4, label="CUDA graph")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of ours over the fastest other arm (FlashInfer, peers)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_results(rows: list[dict], meta: dict, out: Path, stem: str) -> None:
    """JSON rows, the markdown tables and the plot under ``out`` (rewritten after every case)."""
    out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        row.update(gpu=meta["gpu"], date=meta["date"])
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    fp8 = fp8_markdown(rows)
    fp8 = f"{fp8}\n\n" if fp8 else ""
    (out / f"{stem}.md").write_text(f"{json.dumps(meta)}\n\n{markdown(rows)}\n\n{fp8}{arms_markdown(rows)}\n")
    with contextlib.suppress(ImportError):
        plot(rows, out / f"{stem}.png")


def rebuild(stored: Path, out: Path) -> None:
    """Recompute the comparison columns of a stored run from its arms (same cases, same batches)."""
    cases = {c.name: c for c in CASES}
    lines = (stored / "attention_h200.md").read_text().splitlines()
    meta = json.loads(next(line for line in lines if line.startswith("{")))
    rows = json.loads((stored / "attention_h200.json").read_text())
    for row in rows:
        for name, arm in row["arms"].items():
            # Runs before FlashInfer's CUDA-graph wrappers were measured: the decode and prefill
            # wrappers' graph time was their fixed-plan capture.
            old = "graph_ms" in arm and not _ran_graph_wrapper(arm)
            if old and name.startswith(("flashinfer decode", "flashinfer prefill")):
                arm["fixed_plan_graph_ms"] = arm.pop("graph_ms")
        case = cases[row["case"]]
        tables, kv_lens, qo_lens, _ = build_batch(case)
        row["bytes"], row["flops"] = work_of(case, tables, kv_lens, qo_lens, torch.bfloat16)
        derive(row)
    write_results(rows, meta, out, "attention_h200")
    print(markdown(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", help="folder holding peer_kernels.py (peer arms skipped without it)")
    parser.add_argument("--out", default="benchmarks/results", help="where the JSON, tables and plot go")
    parser.add_argument("--cases", nargs="*", default=[""], help="only cases whose name holds one of these")
    parser.add_argument("--smoke", action="store_true", help="two tiny cases on the CPU (interpreter)")
    parser.add_argument(
        "--from-json", help="rebuild the tables and plot of a stored run (its folder) without a GPU"
    )
    parser.add_argument(
        "--flashinfer-head-dims", default="64,128", help="head dims to run FlashInfer's arms for (JIT builds)"
    )
    parser.add_argument("--kv-dtypes", default="bf16", help="comma-separated KV dtypes per case: bf16, fp8")
    parser.add_argument("--stem", help="output file stem (default attention_h200, or attention_smoke)")
    args = parser.parse_args()
    if args.from_json:
        rebuild(Path(args.from_json), Path(args.out))
        return
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("bench_attention.py needs CUDA (or --smoke)")
    dtype = torch.bfloat16 if cuda else torch.float32
    kv_dtypes = {"bf16": None, "fp8": FP8_KV_DTYPE}
    wanted = args.kv_dtypes.split(",")
    if not wanted or any(name not in kv_dtypes for name in wanted):
        raise SystemExit(f"--kv-dtypes takes a comma-separated list of {', '.join(kv_dtypes)}")
    cases = [c for c in (CASES if cuda else SMOKE_CASES) if any(s in c.name for s in args.cases)]
    peers = load_peers(args.peers) if cuda else None
    ceilings = measure_ceilings() if cuda else (0.0, 0.0)
    import triton

    versions = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    try:
        import flashinfer

        versions["flashinfer"] = flashinfer.__version__
    except ImportError:
        versions["flashinfer"] = None
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
        "versions": versions,
        "command": "python " + " ".join(sys.argv),
        "dtype": str(dtype),
        "copy_tb_per_s": ceilings[0] / 1e12,
        "matmul_tflop_per_s": ceilings[1] / 1e12,
    }
    print(json.dumps(meta))
    rows = []
    stem = args.stem or ("attention_h200" if cuda else "attention_smoke")
    head_dims = tuple(int(x) for x in args.flashinfer_head_dims.split(","))
    for case in cases:
        for kv_name in wanted:
            t0 = time.perf_counter()
            rows.append(bench_case(case, peers, cuda, dtype, ceilings, head_dims, kv_dtypes[kv_name]))
            r = rows[-1]
            seconds = time.perf_counter() - t0
            others = f"{_f(r['best_peer_ms'])}/{_f(r['best_peer_graph_ms'])}"
            print(f"{r['case']}: ours {_f(r['ours_ms'])} graph {_f(r['ours_graph_ms'])} best other {others} "
                  f"({seconds:.1f} s)", flush=True)  # fmt: skip
            write_results(rows, meta, Path(args.out), stem)
    print(markdown(rows))
    print(fp8_markdown(rows))


if __name__ == "__main__":
    main()

"""Where the host time of an eager ``run`` goes (CUDA; a diagnosis: it reaches into the backend).

For a few batches of ``bench_attention.py``'s grid, the Triton backend planned with bf16, µs per
call (median of 5 samples of 200 calls, launches queued without a sync):

- ``run``: the public call; ``_run``: without ``run``'s checks and the KV split; ``launches``: the
  plan's bound launches alone;
- for the plan's first attention launch: the specialization of all its arguments
  (``_launch.specialization``; a launch reads only the layer's tensors, the plan's are cached), the
  compiled kernel's launcher called with everything prepared, and Triton's JIT path
  (``kernel[grid](*args, **constants)``);
- yardsticks of the host: an empty one-argument Triton kernel through both paths, a PyTorch
  ``zero_()`` of a small tensor (one launch through PyTorch's dispatcher), ``torch.cuda``'s current
  device and stream, and 1000 Python integer additions.

Then the ten functions with the most own time in ``cProfile`` over 2000 ``run`` calls.

Usage: ``python benchmarks/run_host_breakdown.py [--cases SUBSTRING ...]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton
from bench_attention import CASES, build_batch
from prefix_cache.kernels import _launch

from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend
from prefix_cache.attention.kv_layout import split_kv_cache


@triton.jit
def _empty(x_ptr):
    pass


def us(fn, calls: int = 200, samples: int = 5) -> float:
    values = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        values.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(values)


def attention_args(backend, q, k, v, out) -> tuple:
    """The positional arguments of the plan's first attention launch, as ``AttentionLaunch`` makes them."""
    launch = backend._launches[0]
    part_o, lse = backend._part_o, backend._part_lse
    sq, sk, sv, so, sf = q.stride(), k.stride(), v.stride(), part_o.stride(), out.stride()
    return (
        q, backend._q_rows, k, v, backend._kv_indices, launch.work, launch.num_work, backend._o_rows,
        part_o, lse, out, backend._qk_scale,
        sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], lse.stride(0), sf[0], sf[1],
    )  # fmt: skip


def breakdown(case) -> dict:
    tables, kv_lens, qo_lens, num_pages = build_batch(case)
    dtype = torch.bfloat16
    kv_cache = torch.randn(num_pages, 2, case.page_size, case.hkv, case.d, device="cuda").to(dtype)
    q = torch.randn(int(qo_lens.sum()), case.hq, case.d, device="cuda").to(dtype)
    out = torch.empty_like(q)
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, case.page_size)
    backend = create_backend("triton", device="cuda")
    backend.plan(plan, num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, q_dtype=dtype)
    k, v = split_kv_cache(kv_cache)
    backend.run(q, kv_cache, out=out)

    def launches():
        backend.launch_levels(q, k, v, out)
        if backend._merges:
            backend.merge(out)

    bound = backend._attention_launches[0]._kernels[0]  # 32-bit offsets: these pools are small
    args = attention_args(backend, q, k, v, out)
    device = torch.cuda.current_device()
    (run, function, metadata, tail, stream_of), *_ = bound._launchers.values()  # the run's one launcher
    gx, gy, gz = bound._grid3
    row = {
        "case": case.name,
        "launches": len(backend._attention_launches) + (1 if backend._merges else 0),
        "run": us(lambda: backend.run(q, kv_cache, out=out)),
        "_run": us(lambda: backend._run(plan, q, kv_cache, k, v, out)),
        "launches only": us(launches),
        "full key": us(lambda: _launch.specialization(args)),
        "compiled launcher": us(
            lambda: run(gx, gy, gz, stream_of(device), function, metadata, None, None, None, *args, *tail)
        ),
        "JIT path": us(lambda: bound.kernel[bound.grid](*args, **bound.constants)),
    }
    return row


def yardsticks() -> dict:
    x = torch.zeros(16, device="cuda")
    compiled = _empty.warmup(x, grid=(1,))
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    get_stream = triton.runtime.driver.active.get_current_stream

    def python_adds():
        s = 0
        for i in range(1000):
            s += i
        return s

    def empty_direct():
        run(1, 1, 1, get_stream(0), function, metadata, None, None, None, x)

    return {
        "empty kernel, JIT path": us(lambda: _empty[(1,)](x)),
        "empty kernel, compiled launcher": us(empty_direct),
        "torch zero_() of 16 floats": us(lambda: x.zero_()),
        "torch.cuda.current_device()": us(torch.cuda.current_device),
        "current stream (Triton's getter)": us(lambda: get_stream(0)),
        "1000 Python int additions": us(python_adds, calls=20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["1 req x 256", "1 prefix 512 x 32", "system 2048"])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, value in yardsticks().items():
        print(f"{name}: {value:.2f} µs")
    cases = [c for c in CASES if any(s in c.name for s in args.cases)]
    for case in cases:
        row = breakdown(case)
        print(" | ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    case = cases[0]
    tables, kv_lens, qo_lens, num_pages = build_batch(case)
    kv_cache = torch.randn(num_pages, 2, case.page_size, case.hkv, case.d, device="cuda").bfloat16()
    q = torch.randn(int(qo_lens.sum()), case.hq, case.d, device="cuda").bfloat16()
    out = torch.empty_like(q)
    backend = create_backend("triton", device="cuda")
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, case.page_size)
    backend.plan(plan, num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, q_dtype=torch.bfloat16)
    backend.run(q, kv_cache, out=out)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        backend.run(q, kv_cache, out=out)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(10)
    print(f"cProfile, 2000 runs of '{case.name}':\n{text.getvalue()}")


if __name__ == "__main__":
    main()

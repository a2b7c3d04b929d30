"""The long shared prefix's level as dense attention, on every kernel this machine has (CUDA).

The first case of ``bench_attention.py`` (1 prefix of 32768 tokens x 128 decoding requests, 32/8
heads, d128, bf16) is bound by its shared level: 128 x 4 query rows per KV head against the same
32768 keys, 6.9e10 FLOPs, so its roofline bound is FLOPs / the bf16 matrix rate. This script runs
that level alone (each request's own KV cut to its query token) on:

- ours: ``CascadePlanner().plan`` + ``create_backend("triton")`` and ``create_backend("auto")`` (which
  on Hopper runs this level on FlashInfer's FA3, split by hand), replayed in a CUDA graph with the plan
  fixed;
- torch's ``scaled_dot_product_attention`` with each backend it has (flash, cuDNN, efficient), the
  four query heads of a KV head packed as rows (the same function, non-causal);
- FlashInfer's single-request prefill (FA2 and, on Hopper, FA3) with its own GQA handling.

Per arm: ms (median of ``triton.testing.do_bench``), TFLOP/s, time over the FLOP bound, and the
relative error against a float32 reference. It says how far from the bound dense attention at this
shape gets on this GPU with each kernel family, which is what ``ours / bound`` is measured against.

Usage: ``python benchmarks/bench_shared_level.py [--prefix 32768] [--requests 128]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import graphed, measure_ceilings, time_ms

from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=32768, help="shared tokens")
    parser.add_argument("--requests", type=int, default=128, help="decoding requests over the prefix")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_shared_level.py needs CUDA")
    hq, hkv, d, ps, n, length = 32, 8, 128, 16, args.requests, args.prefix
    if length % ps:
        raise SystemExit(f"--prefix must be a multiple of the page size {ps}")
    group, dtype, dev = hq // hkv, torch.bfloat16, "cuda"
    bandwidth, matmul = measure_ceilings()
    flops = 4.0 * n * hq * length * d
    gen = torch.Generator(device=dev).manual_seed(0)

    # The pool: the prefix's pages, then one page per request holding its query token's KV.
    prefix_pages = length // ps
    pool = torch.randn(prefix_pages + n, 2, ps, hkv, d, generator=gen, device=dev).to(dtype)
    perm = torch.randperm(prefix_pages + n, generator=torch.Generator().manual_seed(0)).numpy()
    q = torch.randn(n, hq, d, generator=gen, device=dev).to(dtype)
    tables = np.stack([np.concatenate([perm[:prefix_pages], perm[prefix_pages + r : prefix_pages + r + 1]])
                       for r in range(n)]).astype(np.int32)  # fmt: skip
    kv_lens = np.full(n, length + 1, dtype=np.int32)
    qo_lens = np.ones(n, dtype=np.int32)
    # Dense K, V of the prefix [hkv, length, d] and each request's own token [n, hkv, d].
    pages = torch.from_numpy(perm[:prefix_pages].astype(np.int64)).to(dev)
    k = pool[pages, 0].reshape(length, hkv, d).transpose(0, 1).contiguous()
    v = pool[pages, 1].reshape(length, hkv, d).transpose(0, 1).contiguous()
    own = torch.from_numpy(perm[prefix_pages:].astype(np.int64)).to(dev)
    k_own, v_own = pool[own, 0, 0], pool[own, 1, 0]
    scale = d**-0.5

    # float32 reference of the prefix part (per KV head, its group's rows packed) and of the whole step.
    qp = q.view(n, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, n * group, d)  # [hkv, rows, d]
    k_own_rows = k_own.float().repeat_interleave(group, 0).transpose(0, 1)  # [hkv, rows, d]
    v_own_rows = v_own.float().repeat_interleave(group, 0).transpose(0, 1)
    s = torch.einsum("hrd,hkd->hrk", qp.float(), k.float()) * scale
    s_own = (qp.float() * k_own_rows).sum(-1, keepdim=True) * scale
    ref_prefix = torch.einsum("hrk,hkd->hrd", torch.softmax(s, -1), v.float())
    p = torch.cat([s, s_own], -1).softmax(-1)
    ref_step = torch.einsum("hrk,hkd->hrd", p[..., :-1], v.float()) + p[..., -1:] * v_own_rows

    def unpack(o):  # [hkv, rows, d] -> [n, hq, d]
        return o.view(hkv, n, group, d).permute(1, 0, 2, 3).reshape(n, hq, d)

    ref_prefix, ref_step = unpack(ref_prefix), unpack(ref_step)
    rows = []

    def record(name: str, fn, ref: torch.Tensor, note: str = "") -> None:
        def rel_err(out: torch.Tensor) -> float:
            return float((out.float() - ref).norm() / ref.norm())

        def right(err: float) -> bool:
            return err == err and err < 2e-2  # NaN never passes

        entry = {"arm": name, "rel_err": rel_err(fn()), "note": note}
        if right(entry["rel_err"]):
            replay, captured = graphed(fn)
            captured.fill_(float("nan"))  # the replay must write every element again
            replay()
            entry["graph_rel_err"] = rel_err(captured)
            if right(entry["graph_rel_err"]):
                entry["ms"] = time_ms(replay, True)
                entry["tflop_per_s"] = flops / (entry["ms"] * 1e-3) / 1e12
                entry["over_bound"] = entry["ms"] / (flops / matmul * 1e3)
        rows.append(entry)
        print(json.dumps(entry), flush=True)

    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, ps)
    backend = create_backend("triton", device=dev)
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
    out = torch.empty_like(q)
    record("ours (triton backend, the whole step)", lambda: backend.run(q, pool, out=out), ref_step,
           f"{len(plan.levels)} levels")  # fmt: skip
    auto = create_backend("auto", device=dev)
    auto.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
    out_auto = torch.empty_like(q)
    record("ours (auto backend, the whole step)", lambda: auto.run(q, pool, out=out_auto), ref_step,
           f"{len(plan.levels)} levels, route {auto.route}")  # fmt: skip

    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4, v4 = qp[None], k[None], v[None]
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):

        def sdpa(name=name):
            with sdpa_kernel(getattr(SDPBackend, name)):
                return unpack(torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=scale)[0])

        try:
            record(f"torch sdpa {name.lower()}", sdpa, ref_prefix, "group heads packed as rows")
        except RuntimeError as error:
            rows.append({"arm": f"torch sdpa {name.lower()}", "error": str(error)[:200]})
            print(rows[-1])
    with contextlib.suppress(ImportError):
        import flashinfer

        k_nhd, v_nhd = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        for fi_backend in ("fa2", "fa3"):

            def single(b=fi_backend):
                return flashinfer.single_prefill_with_kv_cache(q, k_nhd, v_nhd, causal=False, sm_scale=scale,
                                                               backend=b)  # fmt: skip

            try:
                record(f"flashinfer single prefill {fi_backend}", single, ref_prefix)
            except Exception as error:  # a backend this GPU or build lacks is reported, not fatal
                rows.append({"arm": f"flashinfer single prefill {fi_backend}", "error": str(error)[:200]})
                print(rows[-1])
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "prefix": length,
            "requests": n, "flops": flops, "matmul_tflop_per_s": matmul / 1e12,
            "copy_tb_per_s": bandwidth / 1e12, "flop_bound_ms": flops / matmul * 1e3}  # fmt: skip
    print(json.dumps(meta))
    print("| arm | ms | TFLOP/s | over the FLOP bound | rel. error |\n|---|---|---|---|---|")
    for r in rows:
        if "ms" in r:
            print(f"| {r['arm']} | {r['ms']:.4f} | {r['tflop_per_s']:.0f} | {r['over_bound']:.2f} | "
                  f"{r['rel_err']:.1e} |")  # fmt: skip
        else:
            print(f"| {r['arm']} | - | - | - | {r.get('error', r.get('rel_err'))} |")


if __name__ == "__main__":
    main()

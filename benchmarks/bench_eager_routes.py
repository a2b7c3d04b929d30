"""Eager cost per layer of the auto backend's routes, side by side in one process (CUDA, FlashInfer).

For the decode batches of ``bench_attention.py``'s grid with a GQA group of at most 8 (bf16, the
same batches), four arms on the planner's plan:

- ``auto``: ``create_backend("auto")`` as an engine gets it;
- ``auto, no flat route``: the same with ``Routing(eager_flat_kv_bytes=0)``, so that a small decode
  cascade keeps our Triton launches instead of running as its one-level plan on FlashInfer's decode
  wrapper;
- ``triton``: ``create_backend("triton")``;
- ``flashinfer decode``: FlashInfer's tensor-core decode wrapper called directly on the batch's
  one-level inputs;
- with ``--flat-mib N``, also ``auto, flat up to N MiB``: the auto backend with
  ``Routing(eager_flat_kv_bytes=N * 2**20)``, to try another threshold.

Every arm is checked against an fp32 reference first. The arms then alternate for ``--rounds``
rounds; per round and arm: µs per layer (32 eager runs back to back, one sync, median of 10:
``bench_attention.layer_us``) and host µs per run (30 calls queued without a sync). Medians of the
rounds are reported, with each arm's GPU µs (20 runs captured in one CUDA graph, replayed) and its
per-layer time against FlashInfer's wrapper's.

Usage: ``python benchmarks/bench_eager_routes.py [--cases SUBSTRING ...] [--rounds 12] [--flat-mib N]
[--out DIR]``
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
from pathlib import Path

import torch
from bench_attention import CASES, MAX_REL_ERR, host_us, layer_us, paged_inputs, reference
from bench_run_host import cuda_batch, graph_us, save_rows

from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend
from prefix_cache.attention.auto_backend import Routing


def decode_cases(substrings: list[str]) -> list:
    """The grid's cases of one query token per request and a GQA group of at most 8."""
    chosen = []
    for case in CASES:
        if any(qo != 1 for qo in case.qo) or case.hq // case.hkv > 8:
            continue
        if not substrings or any(s in case.name for s in substrings):
            chosen.append(case)
    return chosen


def arms_of(case, tables, kv_lens, qo_lens, q, kv_cache, flat_mib: int | None) -> dict:
    """name -> (run, route) of the arms, each writing its own output tensor."""
    import flashinfer

    dtype, device = q.dtype, q.device
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, case.page_size)
    heads = dict(num_qo_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, q_dtype=dtype)
    backends = {
        "auto": create_backend("auto", device=device),
        "auto, no flat route": create_backend("auto", device=device, routing=Routing(eager_flat_kv_bytes=0)),
        "triton": create_backend("triton", device=device),
    }
    if flat_mib is not None:
        routing = Routing(eager_flat_kv_bytes=flat_mib * 2**20)
        backends[f"auto, flat up to {flat_mib} MiB"] = create_backend("auto", device=device, routing=routing)
    arms = {}
    for name, backend in backends.items():
        backend.plan(plan, **heads)
        out = torch.empty_like(q)
        arms[name] = (lambda b=backend, o=out: b.run(q, kv_cache, out=o), getattr(backend, "route", name))
    ps = case.page_size
    indptr, indices, last = paged_inputs(tables, kv_lens, ps)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=device), "NHD", use_tensor_cores=True
    )
    wrapper.plan(
        indptr.to(device), indices.to(device), last.to(device), case.hq, case.hkv, case.d, ps,
        sm_scale=case.d**-0.5, q_data_type=dtype, kv_data_type=dtype,
    )  # fmt: skip
    out = torch.empty_like(q)
    arms["flashinfer decode"] = (lambda: wrapper.run(q, kv_cache, out=out), "flashinfer")
    return arms


def bench_case(case, rounds: int, flat_mib: int | None) -> dict:
    tables, kv_lens, qo_lens, q, kv_cache = cuda_batch(case)
    ref = reference(q, kv_cache, tables, kv_lens, qo_lens, case.d**-0.5)
    scale = float(ref.abs().max())
    arms = arms_of(case, tables, kv_lens, qo_lens, q, kv_cache, flat_mib)
    row: dict = {"case": case.name, "routes": {name: route for name, (_, route) in arms.items()}}
    for name, (run, _) in arms.items():
        err = float((run().float() - ref).abs().max()) / scale
        if not err <= MAX_REL_ERR:  # NaN fails too
            raise AssertionError(f"{case.name}: {name} is wrong (relative error {err:.3g})")
        row[f"{name} rel_err"] = err
    samples: dict = {}
    for _ in range(rounds):
        for name, (run, _) in arms.items():
            samples.setdefault((name, "layer_us"), []).append(layer_us(run, 0.0))
            samples.setdefault((name, "host_us"), []).append(host_us(run, True))
    for (name, what), values in samples.items():
        row[f"{name} {what}"] = statistics.median(values)
    for name, (run, _) in arms.items():
        row[f"{name} gpu_us"] = graph_us(run)
    return row


def markdown(rows: list[dict]) -> str:
    names = list(rows[0]["routes"]) if rows else []
    lines = [
        "| case | " + " | ".join(f"{name}: µs per layer (x FlashInfer), host, GPU" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in rows:
        fi = r["flashinfer decode layer_us"]
        cells = [
            f"{r[f'{name} layer_us']:.1f} ({r[f'{name} layer_us'] / fi:.2f}x), {r[f'{name} host_us']:.1f}, "
            f"{r[f'{name} gpu_us']:.1f} [{r['routes'][name]}]"
            for name in names
        ]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[], help="only cases whose name contains one of these")
    parser.add_argument("--rounds", type=int, default=12, help="alternations of the arms")
    parser.add_argument("--flat-mib", type=int, default=None, help="add an auto arm with this flat threshold")
    parser.add_argument("--out", default="benchmarks/results", help="where eager_routes_h200.{md,json} go")
    args = parser.parse_args()
    import flashinfer
    import triton

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flashinfer": flashinfer.__version__,
        },
        "rounds": args.rounds,
        "command": "python benchmarks/bench_eager_routes.py " + shlex.join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in decode_cases(args.cases):
        rows.append(bench_case(case, args.rounds, args.flat_mib))
        save_rows(out / "eager_routes_h200", meta, rows, markdown)
    print(markdown(rows))


if __name__ == "__main__":
    main()

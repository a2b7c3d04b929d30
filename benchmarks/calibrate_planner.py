"""Fit the planner's cost model (``prefix_cache.planner.cost_model``) to measured attention times.

Two steps, the first on a CUDA GPU:

1. ``--measure OUT_JSON`` times, for each calibration batch, the two plans the planner chooses between
   (the cascade of its candidate nodes, and one level): exact Triton plans replayed in CUDA graphs,
   as ``bench_attention.py``'s "ours cascade" / "ours one level" arms, each checked against the
   reference first. The batches: ``bench_attention.py``'s cases with Llama-3-8B heads (32/8, d128)
   and ``BREAK_EVEN``, one prefix shared by 8-32 decodes, where either plan can win.
2. The fit (any machine): for every batch of the given results (``--measure`` output, or
   ``bench_attention.py`` rows: ``cascade_graph_ms``, ``one_level_graph_ms``) both plans are rebuilt
   exactly, their features counted (``CostModel.features``: launches, levels, merge, distinct KV
   tokens, pairs, the longest chain of KV steps per launch, work items), and ``CostModel.time_us``'s
   coefficients fitted by non-negative least squares, weighted so that every point counts by its
   relative error. The schedule the features replay (``tile_rule``) is the Triton backend's at these
   heads. Prints, per batch, the choice the fitted model makes and its measured cost against the
   better plan, and writes the model as JSON.

Usage: ``python benchmarks/calibrate_planner.py --measure OUT_JSON`` (CUDA), then
``python benchmarks/calibrate_planner.py [RESULTS_JSON ...] [--out MODEL_JSON]`` (defaults:
benchmarks/results/calibration_h200.json, prefix_cache/planner/data/cost_model_h200.json). To calibrate
another GPU, run both there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from prefix_cache.kernels._common import num_sms
from prefix_cache.kernels.work import fixed_tile_configs, tile_configs

from prefix_cache.attention import create_backend
from prefix_cache.attention.triton_schedule import SHARED_ON_NARROW_READS, SHARED_ON_NARROW_ROWS
from prefix_cache.planner.cost_model import COEFFICIENTS, DEFAULT_PATH, CostModel, PlanFeatures
from prefix_cache.planner.planner import CascadePlanner

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPE = f"{HEADS}/{KV_HEADS} d{HEAD_DIM}"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_attention", HERE / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_attention"] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()


def _break_even() -> tuple:
    """Decode batches near the break-even of cascade and one level, at pages of 16, 1 and 64."""
    case = bench.Case
    cases = [
        case(f"p16 {prefix} x {n}, {own} own", ((1, prefix),), n, (own,), (1,))
        for prefix in (256, 512, 1024, 2048)
        for n in (8, 12, 16, 24, 32)
        for own in (64, 512)
    ]
    cases += [
        case(f"p1 {prefix} x {n}, 64 own", ((1, prefix),), n, (64,), (1,), page_size=1)
        for prefix in (256, 512, 2048)
        for n in (8, 16, 32)
    ]
    cases += [case(f"p64 1024 x {n}, 256 own", ((1, 1024),), n, (256,), (1,), page_size=64) for n in (8, 16)]
    # Prefixes of 257-1536 tokens that stay unsplit on one side and not the other: the grid above
    # has none, and a model fitted without them misjudged such batches (NOTES.md, "what the cost
    # model misses, on batches it never saw").
    unsplit = [(16, p, n, own) for p in (256, 384, 768) for n in (20, 28, 40) for own in (128, 1024)]
    longer = (320, 448, 640, 896, 1536)
    unsplit += [(16, p, n, own) for p in longer for n in (10, 18, 36) for own in (96, 384)]
    unsplit += [(16, 512, n, 256) for n in (20, 40)] + [(16, 256, n, 64) for n in (36, 48)]
    unsplit += [(1, 384, 12, 64), (1, 384, 24, 64), (1, 768, 8, 64), (1, 448, 14, 32), (1, 640, 20, 96)]
    unsplit += [(64, 512, 16, 256), (64, 512, 32, 256), (64, 640, 24, 192), (64, 1536, 10, 384)]
    cases += [
        case(f"p{page} {prefix} x {n}, {own} own", ((1, prefix),), n, (own,), (1,), page_size=page)
        for page, prefix, n, own in unsplit
    ]
    return (
        *cases,
        case("p16 sys 1024, 4 x 512, 4 each", ((1, 1024), (4, 512)), 4, (128,), (1,)),
        case("p16 sys 512, 2 x 512, 8 each", ((1, 512), (2, 512)), 8, (128,), (1,)),
        case("p16 4 prefixes 1024 x 8", ((4, 1024),), 8, (256,), (1,)),
        case("p16 8 prefixes 512 x 16", ((8, 512),), 16, (256,), (1,)),
        case("p16 2 prefixes 384 x 12", ((2, 384),), 12, (128,), (1,)),
        case("p16 2 prefixes 448 x 10", ((2, 448),), 10, (96,), (1,)),
        case("p16 4 prefixes 256 x 8", ((4, 256),), 8, (64,), (1,)),
        case("p16 sys 256, 4 x 256, 6 each", ((1, 256), (4, 256)), 6, (128,), (1,)),
        case("p16 sys 320, 2 x 320, 8 each", ((1, 320), (2, 320)), 8, (192,), (1,)),
    )


BREAK_EVEN = _break_even()
CASES = {c.name: c for c in (*bench.CASES, *BREAK_EVEN) if (c.hq, c.hkv, c.d) == (HEADS, KV_HEADS, HEAD_DIM)}


def tile_rule(sms: int) -> dict:
    """The Triton backend's schedule at SHAPE on a GPU of ``sms`` SMs, in the terms of
    ``CostModel``: its decode and widest tiles' rows, the limits under which a shared level joins
    the decode launch (SHARED_ON_NARROW_ROWS rows; SHARED_ON_NARROW_READS KV elements, K and V of
    every KV head, here in KV tokens; one wave of programs, here per KV head), and the KV tokens per
    step of each tile from the narrowest to the widest (the split's unit)."""
    tiles = fixed_tile_configs(HEADS // KV_HEADS, HEAD_DIM, 16)
    narrow, wide = tiles[0], tiles[-1]
    rows = [narrow.block_m << i for i in range((wide.block_m // narrow.block_m).bit_length())]
    return {
        "group_size": HEADS // KV_HEADS,
        "min_rows": narrow.block_m,
        "max_rows": wide.block_m,
        "join_rows": SHARED_ON_NARROW_ROWS,
        "join_tile_tokens": SHARED_ON_NARROW_READS // (KV_HEADS * HEAD_DIM * 2),
        "sms_per_kv_head": sms / KV_HEADS,
        "kv_tile_tokens": tuple(tile.block_n for tile in tile_configs(rows, HEADS // KV_HEADS, HEAD_DIM, 16)),
    }


def both_plans(tables, kv_lens, qo_lens, page_size: int):
    """(cascade of the candidates, one level) of a batch (``bench_attention.build_batch``)."""
    return tuple(
        planner.plan(tables, kv_lens, qo_lens, page_size)
        for planner in (CascadePlanner(cost_model=None), CascadePlanner(max_levels=1, cost_model=None))
    )


def measure(out: str) -> None:
    """Step 1: both plans of every calibration batch with candidates, timed on this GPU."""
    dtype = torch.bfloat16
    rows = []
    for case in CASES.values():
        tables, kv_lens, qo_lens, num_pages = bench.build_batch(case)
        cascade, one = both_plans(tables, kv_lens, qo_lens, case.page_size)
        if len(cascade.levels) == 1:
            continue
        gen = torch.Generator(device="cuda").manual_seed(1)
        shape = (num_pages, 2, case.page_size, KV_HEADS, HEAD_DIM)
        kv_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        q = torch.randn(int(qo_lens.sum()), HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
        ref = bench.reference(q, kv_cache, tables, kv_lens, qo_lens, HEAD_DIM**-0.5)
        row = {"case": case.name, "shape": f"{SHAPE} page {case.page_size}"}
        for key, plan in (("cascade_graph_ms", cascade), ("one_level_graph_ms", one)):
            backend = create_backend("triton", device="cuda")
            backend.plan(plan, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, q_dtype=dtype)
            replay, out_tensor = bench.graphed(lambda b=backend, q=q, kv=kv_cache: b.run(q, kv))
            out_tensor.fill_(float("nan"))
            replay()
            err = float((out_tensor.float() - ref).abs().max()) / float(ref.abs().max())
            if not err <= bench.MAX_REL_ERR:
                raise AssertionError(f"{case.name}: {key} relative error {err:.3g}")
            row[key] = bench.time_ms(replay, True)
        rows.append(row)
        print(f"{case.name:<58} {row['cascade_graph_ms']:8.4f} {row['one_level_graph_ms']:8.4f}", flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "sms": num_sms(torch.device("cuda")),
        "command": " ".join(["python benchmarks/calibrate_planner.py", *sys.argv[1:]]),
    }
    Path(out).write_text(json.dumps([{**meta, **row} for row in rows], indent=1) + "\n")


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (active set: drop the most negative coefficient, refit). The
    columns are scaled to the same largest entry first: which coefficient is "most negative" must
    not depend on a feature's unit (tokens, pairs of tokens, launches)."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (x >= 0).all():
            return x / scale
        active.remove(int(np.argmin(x)))


def _terms(f: PlanFeatures) -> list[float]:
    """What ``CostModel.time_us`` multiplies each of COEFFICIENTS by."""
    return [1.0, f.launches - 1, f.levels - 1, f.merge, f.kv_tokens, f.pairs, f.chain_steps, f.work_items]


def fit(paths: list[str], out: str) -> None:
    """Step 2: the model fitted to the measured rows of ``paths`` (a later file's row of a batch
    replaces an earlier one's), written to ``out``."""
    rows: dict[str, dict] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            if row["case"] in CASES and row.get("cascade_graph_ms") and row.get("one_level_graph_ms"):
                rows[row["case"]] = row
    # bench_attention.py rows do not record the SM count: they count as the CPU default's, an H200's.
    sms = {int(row.get("sms", num_sms(torch.device("cpu")))) for row in rows.values()}
    if len(sms) != 1:
        raise SystemExit(f"the results come from GPUs of different SM counts {sorted(sms)}: fit one GPU")
    rule = tile_rule(sms.pop())
    counting = CostModel(0.0, 0.0, 0.0, 0.0, 0.0, **rule)
    points, report = [], []
    for name, row in rows.items():
        case = CASES[name]
        tables, kv_lens, qo_lens, _ = bench.build_batch(case)
        feats = [counting.features(plan) for plan in both_plans(tables, kv_lens, qo_lens, case.page_size)]
        for f, key in zip(feats, ("cascade_graph_ms", "one_level_graph_ms"), strict=True):
            points.append((_terms(f), row[key] * 1e3))
        report.append((name, feats, row["cascade_graph_ms"], row["one_level_graph_ms"]))
    a = np.array([p for p, _ in points])
    b = np.array([t for _, t in points])
    w = 1.0 / b  # relative errors
    coefficients = dict(zip(COEFFICIENTS, map(float, nnls(a * w[:, None], b * w)), strict=True))
    model = dataclasses.replace(counting, **coefficients, source=" ".join(paths))
    worst = 1.0
    print(f"{'case':<58} {'cascade':>8} {'one':>8} {'model picks':>12} {'vs best':>8}")
    for name, (cascade_f, one_f), cascade_ms, one_ms in report:
        pick_cascade = model.time_us(cascade_f) < model.time_us(one_f)
        chosen = cascade_ms if pick_cascade else one_ms
        ratio = chosen / min(cascade_ms, one_ms)
        worst = max(worst, ratio)
        pick = "cascade" if pick_cascade else "one level"
        print(f"{name:<58} {cascade_ms:8.4f} {one_ms:8.4f} {pick:>12} {ratio:8.3f}")
    print(f"worst chosen / best: {worst:.3f} over {len(report)} batches")
    dates = sorted({str(row.get("date")) for row in rows.values()})
    gpus = sorted({str(row.get("gpu")) for row in rows.values()})
    data = {
        **coefficients,
        **rule,
        "fitted_on": f"{', '.join(gpus)} {' / '.join(dates)}, {len(points)} plans of {len(report)} batches",
        "shape": SHAPE,
        "worst_chosen_over_best": worst,
        "command": " ".join(["python benchmarks/calibrate_planner.py", *sys.argv[1:]]),
    }
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", default=[str(HERE / "results" / "calibration_h200.json")])
    parser.add_argument("--measure", metavar="OUT_JSON", help="time the calibration batches (CUDA)")
    parser.add_argument("--out", default=str(DEFAULT_PATH))
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
    else:
        fit(args.results, args.out)


if __name__ == "__main__":
    main()

"""Fit the planner's cost model (``prefix_cache.cost_model``) to a bench_attention.py run.

For every case of the run with Llama-3-8B heads (32/8, d128; every page size), the two plans the
planner chooses between (the cascade of its candidate nodes, and one level) are rebuilt exactly as
the benchmark built them, their features counted (``CostModel.features``), and the model
``time = base + launch * (launches - 1) + kv_token * kv_tokens + pair * pairs`` fitted by
non-negative least squares to the measured CUDA-graph times (``cascade_graph_ms``,
``one_level_graph_ms``), weighted so that every point counts by its relative error. Which shared
levels join the decode launch (``join_queries``, ``tile_queries``, ``join_tile_tokens``) follows
from the Triton backend's limits at these heads. Prints, per case, the choice the fitted model
makes and its measured cost against the better plan, and writes the coefficients as JSON.

Usage: ``python benchmarks/calibrate_planner.py [RESULTS_JSON] [--out MODEL_JSON]`` (defaults:
benchmarks/results/attention_h200.json, prefix_cache/data/cost_model_h200.json); to calibrate another
GPU, run bench_attention.py there first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
from prefix_cache.kernels.work import fixed_tile_configs

from prefix_cache.attention.triton_backend import SHARED_ON_NARROW_READS, SHARED_ON_NARROW_ROWS
from prefix_cache.cascade_planner import CascadePlanner
from prefix_cache.cost_model import DEFAULT_PATH, CostModel

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPE = f"{HEADS}/{KV_HEADS} d{HEAD_DIM}"


def join_limits() -> tuple[int, int, int]:
    """(join_queries, tile_queries, join_tile_tokens): the Triton backend's limits for a shared level
    in the decode launch, in tokens at SHAPE. A level joins with at most SHARED_ON_NARROW_ROWS rows
    (query tokens x group) per group, and with decode tiles (``tile_queries`` query tokens each) that
    read at most SHARED_ON_NARROW_READS KV elements (KV tokens x KV heads x head dim x 2) in all.
    The limit of one wave of programs is not modelled."""
    group = HEADS // KV_HEADS
    tile_queries = fixed_tile_configs(group, HEAD_DIM, 16)[0].block_m // group
    reads = SHARED_ON_NARROW_READS // (KV_HEADS * HEAD_DIM * 2)
    return SHARED_ON_NARROW_ROWS // group, tile_queries, reads


def _bench():
    spec = importlib.util.spec_from_file_location("bench_attention", HERE / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_attention"] = module
    spec.loader.exec_module(module)
    return module


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (active set: drop the most negative coefficient, refit)."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        active.remove(int(np.argmin(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=str(HERE / "results" / "attention_h200.json"))
    parser.add_argument("--out", default=str(DEFAULT_PATH))
    args = parser.parse_args()
    bench = _bench()
    cases = {c.name: c for c in bench.CASES}
    results = json.loads(Path(args.results).read_text())
    rows = [r for r in results if r.get("shape", "").startswith(SHAPE + " ")]
    joins = join_limits()
    counting = CostModel(0.0, 0.0, 0.0, 0.0, *joins)
    points, report = [], []
    candidates = CascadePlanner(cost_model=None)
    one_level = CascadePlanner(max_levels=1, cost_model=None)
    for row in rows:
        case = cases.get(row["case"])
        if case is None or not row.get("cascade_graph_ms") or not row.get("one_level_graph_ms"):
            continue
        tables, kv_lens, qo_lens, _ = bench.build_batch(case)
        feats = []
        for planner, key in ((candidates, "cascade_graph_ms"), (one_level, "one_level_graph_ms")):
            f = counting.features(planner.plan(tables, kv_lens, qo_lens, case.page_size))
            points.append(([1.0, f.launches - 1, f.kv_tokens, f.pairs], row[key] * 1e3))
            feats.append(f)
        report.append((row["case"], feats, row["cascade_graph_ms"], row["one_level_graph_ms"]))
    a = np.array([p for p, _ in points])
    b = np.array([t for _, t in points])
    w = 1.0 / b  # relative errors
    x = nnls(a * w[:, None], b * w)
    model = CostModel(*map(float, x), *joins, source=args.results)
    worst = 1.0
    print(f"{'case':<58} {'cascade':>8} {'one':>8} {'model picks':>12} {'vs best':>8}")
    for name, (cascade_f, one_f), cascade_ms, one_ms in report:
        pick_cascade = model.time_us(cascade_f) < model.time_us(one_f)
        chosen = cascade_ms if pick_cascade else one_ms
        ratio = chosen / min(cascade_ms, one_ms)
        worst = max(worst, ratio)
        pick = "cascade" if pick_cascade else "one level"
        print(f"{name:<58} {cascade_ms:8.4f} {one_ms:8.4f} {pick:>12} {ratio:8.3f}")
    print(f"worst chosen / best: {worst:.3f} over {len(report)} cases")
    meta = results[0]
    data = {
        "base_us": model.base_us,
        "launch_us": model.launch_us,
        "kv_token_us": model.kv_token_us,
        "pair_us": model.pair_us,
        **dict(zip(("join_queries", "tile_queries", "join_tile_tokens"), joins, strict=True)),
        "fitted_on": f"{meta.get('gpu')} {meta.get('date')}, {len(points)} plans of {len(report)} cases",
        "shape": SHAPE,
        "worst_chosen_over_best": worst,
        "command": "python benchmarks/calibrate_planner.py " + " ".join(sys.argv[1:]),
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()

"""The packaged cost model is what ``benchmarks/calibrate_planner.py`` fits from the committed
calibration run: its coefficients regenerate from the data, and its tile rule is the Triton
backend's current one (a change to the backend's rule without a recalibration fails here). The
schedule the model replays (launches, merge, work items, KV steps; ``prefix_cache.planner.kv_split``) is the
backend's, on random batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
import torch
from prefix_cache.kernels import work

from prefix_cache.attention.triton_backend import TritonBackend, checked_levels
from prefix_cache.planner import kv_split
from prefix_cache.planner.cost_model import COEFFICIENTS, TILE_RULE, CostModel
from prefix_cache.planner.planner import CascadePlanner

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ROOT / "prefix_cache" / "planner" / "data" / "cost_model_h200.json"


def test_the_packaged_cost_model_refits_from_the_committed_calibration(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a GPU host runs it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "calibrate_planner.py"),
         str(ROOT / "benchmarks" / "results" / "calibration_h200.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    fitted, packaged = json.loads(out.read_text()), json.loads(PACKAGED.read_text())
    for key in (*TILE_RULE, "fitted_on", "shape"):
        assert fitted[key] == packaged[key], key
    for key in (*COEFFICIENTS, "worst_chosen_over_best"):
        assert fitted[key] == pytest.approx(packaged[key], rel=1e-9), key


def _backend_schedule(plan) -> tuple[int, int, float, int]:
    """(launches, merge, chain_steps, work_items) of the Triton backend's exact schedule of a plan at
    the packaged model's shape (32/8 heads of 128, an H200's SMs on CPU tensors). A lone level of
    decodes counts its steps on the decode tile: ``lone_decode_tile`` runs the same items (tested in
    test_triton_backend.py), and the model was calibrated on the decode tile's steps."""
    backend = TritonBackend(device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(work, "interpreting", lambda: False)
        mp.setattr(work, "LONE_DECODE_MIN_PROGRAMS", 1 << 30)
        backend.plan(plan, num_qo_heads=32, num_kv_heads=8, head_dim=128, q_dtype=torch.bfloat16)
        levels = checked_levels(plan)
        tiles, works, _ = backend._schedule(plan, levels, [lv.causal for lv in plan.levels], None, None)
    chain, items = 0.0, 0
    for tile, items_of in zip(tiles, works, strict=True):
        if items_of.shape[0] == 0:
            continue
        steps = -((items_of[:, work.KV0] - items_of[:, work.KV1]) // tile.block_n)  # per item
        waves = -(-items_of.shape[0] * 8 // (132 * tile.resident_per_sm()))
        chain += float(steps.max() + (waves - 1) * steps.mean())
        items += items_of.shape[0]
    return (
        sum(int(launch.num_work.item()) > 0 for launch in backend._launches),
        int(backend._merges > 0),
        chain,
        items,
    )


def _decode_batch(
    page_size: int, groups: list[tuple[int, int]], system: int, own: int, queries: list[int], idle: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """(tables, kv_lens, qo_lens): ``groups`` of (prefix pages, requests) under ``system`` shared
    pages, each request with ``own`` tokens of its own and then new ones, as many as the next entry
    of ``queries`` (cycled; 0: a request that reads the prefix but has no queries this step), and
    ``idle`` requests without queries."""
    pages = iter(range(1 << 22))
    root = [next(pages) for _ in range(system)]
    tables, kv_lens, qo_lens = [], [], []
    for prefix, requests in groups:
        shared = root + [next(pages) for _ in range(prefix)]
        for _ in range(requests):
            q = queries[len(qo_lens) % len(queries)]
            tables.append(shared + [next(pages) for _ in range(-(-(own + q) // page_size))])
            kv_lens.append(len(shared) * page_size + own + q)
            qo_lens.append(q)
    for _ in range(idle):
        tables.append([next(pages)])
        kv_lens.append(1)
        qo_lens.append(0)
    return tables, kv_lens, qo_lens


#: Batches drawn for the schedule tests, as ``_decode_batch``'s arguments, that have been misjudged
#: or that reach a corner of the schedule.
_DECODE_EXAMPLES = (
    (16, [(40, 10)], 0, 96, [1], 0),  # "p16 640 x 10, 96 own"
    (16, [(16, 20)], 0, 16, [1], 0),  # 256 tokens: one split
    (1, [(448, 14)], 0, 32, [1], 0),
    (16, [(4, 17)], 0, 4096, [1], 50),  # splits, many groups
    (16, [(64, 40)], 0, 2048, [1], 0),  # 40 over 2 waves
    (16, [(64, 20)], 8, 512, [1, 200], 0),  # prefill chunks
    (16, [(32, 24)], 0, 64, [0, 33], 3),  # readers without queries
)


@st.composite
def _decode_batches(draw) -> tuple[list[list[int]], list[int], list[int], int]:
    """(tables, kv_lens, qo_lens, page_size) of a ``_decode_batch`` with at least one query."""
    args = (
        draw(st.sampled_from([1, 16, 64])),
        draw(st.lists(st.tuples(st.integers(1, 200), st.integers(1, 40)), min_size=1, max_size=3)),
        draw(st.integers(0, 64)),
        draw(st.integers(1, 3000)),
        draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 9, 33, 200]), min_size=1, max_size=4)),
        draw(st.integers(0, 20)),
    )
    tables, kv_lens, qo_lens = _decode_batch(*args)
    assume(any(qo_lens))  # the planner asks the model only about batches with queries
    return tables, kv_lens, qo_lens, args[0]


def _with_decode_batches(test):
    """``test(batch)`` over 80 drawn batches and ``_DECODE_EXAMPLES``."""
    test = given(batch=_decode_batches())(test)
    for args in _DECODE_EXAMPLES:
        test = example(batch=(*_decode_batch(*args), args[0]))(test)
    return settings(max_examples=80, deadline=None)(test)


@_with_decode_batches
def test_the_cost_model_replays_the_backends_schedule(batch: tuple) -> None:
    """``CostModel.features`` counts the launches, the merge, the work items and the chain of KV
    steps of the backend's exact schedule, for both plans the planner compares: decode groups over
    prefixes of up to 200 pages under a system prompt (shared levels of few groups, split or not),
    ``own`` tokens of each request's own (unique levels of many groups past 16 requests, split
    below a wave of programs), queries of 0-200 tokens per request (decodes, speculative steps,
    prefill chunks whose groups span several M tiles; requests that read a shared prefix with no
    queries this step), ``idle`` requests without queries (groups that run nothing)."""
    tables, kv_lens, qo_lens, page_size = batch
    model = CostModel.load()
    for planner in (CascadePlanner(cost_model=None), CascadePlanner(max_levels=1, cost_model=None)):
        plan = planner.plan([np.array(t) for t in tables], kv_lens, qo_lens, page_size)
        f = model.features(plan)
        launches, merge, chain, items = _backend_schedule(plan)
        assert (f.launches, f.merge, f.work_items) == (launches, merge, items)
        assert f.chain_steps == pytest.approx(chain, rel=1e-12)


@_with_decode_batches
def test_the_one_level_floor_bounds_the_one_level_time(batch: tuple) -> None:
    """``CostModel.one_level_floor_us`` never exceeds the one-level plan's ``time_us`` (the planner
    skips that plan's schedule when the floor is above the cascade's time), and the planner's choice
    is the comparison of the two plans' full estimates."""
    tables, kv_lens, qo_lens, page_size = batch
    model = CostModel.load()
    rows = [np.array(t) for t in tables]
    cascade, one = (
        planner.plan(rows, kv_lens, qo_lens, page_size)
        for planner in (CascadePlanner(cost_model=None), CascadePlanner(max_levels=1, cost_model=None))
    )
    one_f = model.features(one)
    kv, qo = np.array(kv_lens), np.array(qo_lens)
    floor = model.one_level_floor_us(one_f.kv_tokens, one_f.pairs, int(kv @ (qo > 0)), int((qo > 0).sum()))
    assert floor <= model.time_us(one_f) * (1 + 1e-12)
    chosen = CascadePlanner(cost_model=model).plan(rows, kv_lens, qo_lens, page_size)
    one_wins = len(cascade.levels) == 1 or model.time_us(one_f) <= model.time_us(model.features(cascade))
    assert (len(chosen.levels) == 1) == one_wins


@settings(max_examples=300, deadline=None)
@given(
    kv_len=st.lists(st.integers(0, 40_000), min_size=1, max_size=20),
    programs=st.data(),
    block_n=st.sampled_from([32, 64, 128]),
    resident=st.sampled_from([1, 2, 4]),
    sms=st.sampled_from([78, 128, 132, 170]),
    kv_heads=st.sampled_from([1, 3, 5, 8, 10, 12, 32, 40]),
)
def test_the_split_rule_is_the_backends(
    kv_len: list[int], programs, block_n: int, resident: int, sms: int, kv_heads: int
) -> None:
    """``kv_split.best_chunk`` counted per KV head, as the cost model counts (its
    ``sms_per_kv_head`` read back as a fraction, programs and slots scaled to whole numbers),
    chooses the chunk of the backend's ``auto_chunk`` over all KV heads, also where SMs / KV heads
    has no exact float (132 / 10)."""
    m = programs.draw(st.lists(st.integers(0, 8), min_size=len(kv_len), max_size=len(kv_len)))
    kv, m = np.array(kv_len, dtype=np.int64), np.array(m, dtype=np.int64)
    tile = work.TileConfig({1: 128, 2: 64, 4: 16}[resident], block_n, 4, 2)
    backend = work.auto_chunk(kv, m * kv_heads, tile, sms)
    model = CostModel(0.0, 0.0, 0.0, 0.0, 0.0, 4, 16, 128, 128, 16384, sms / kv_heads)
    unit, slots = model._sm_den, model._sm_num * resident
    ours = (
        kv_split.UNSPLIT
        if m.sum() * unit >= slots
        else kv_split.best_chunk(kv, m * unit, block_n, slots, kv_split.MAX_SPLITS, kv_split.MIN_SPLIT_TOKENS)
    )
    assert ours == backend


def test_a_cost_model_needs_a_kv_step_per_tile() -> None:
    with pytest.raises(ValueError, match="kv_tile_tokens needs one entry per tile of 16 to 256 rows"):
        CostModel(0.0, 0.0, 0.0, 0.0, 0.0, 4, 16, 256, 128, 16384, 16.5)

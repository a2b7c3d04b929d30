"""The Triton backend's plan side: what it refuses, the checks a run makes against the plan, splits
and fixed capacities (the kernels run in Triton's interpreter on the CPU)."""

import contextlib
import math

import numpy as np
import pytest
import torch
from attention_reference import reference_attention
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefix_cache.planner.cost_model import CostModel
from prefix_cache.planner.plan import CascadeLevel, CascadePlan
from prefix_cache.planner.planner import CascadePlanner

pytest.importorskip("triton")
from prefix_cache.kernels import work

from prefix_cache.attention import triton_backend, triton_schedule
from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend
from prefix_cache.attention.triton_schedule import SHARED_ON_NARROW_ROWS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = dict(num_qo_heads=2, num_kv_heads=1, head_dim=16)


def _one_level_plan(qo_indptr, kv_indptr, kv_indices, last, query_order, page_size=4) -> CascadePlan:
    level = CascadeLevel(*(np.asarray(a, np.int32) for a in (qo_indptr, kv_indptr, kv_indices, last)), True)
    n = len(last)
    return CascadePlan(
        levels=(level,),
        request_order=np.arange(n, dtype=np.int32),
        request_inverse=np.arange(n, dtype=np.int32),
        query_order=np.asarray(query_order, np.int64),
        page_size=page_size,
    )


def test_triton_backend_rejects_inconsistent_plans() -> None:
    backend = TritonBackend(device=DEVICE)
    good = _one_level_plan([0, 2], [0, 1], [0], [4], [0, 1])
    backend.plan(good, **HEADS)
    with pytest.raises(ValueError, match="at least one level"):
        backend.plan(CascadePlan((), good.request_order, good.request_inverse, good.query_order, 4), **HEADS)
    with pytest.raises(ValueError, match="permutation"):
        backend.plan(_one_level_plan([0, 2], [0, 1], [0], [4], [0, 0]), **HEADS)
    shared = CascadeLevel(np.array([0, 1], np.int32), np.array([0, 1], np.int32), np.array([1], np.int32),
                          np.array([4], np.int32), False)  # fmt: skip
    two = CascadePlan((shared, good.levels[0]), good.request_order, good.request_inverse, good.query_order, 4)
    with pytest.raises(ValueError, match="level 0 covers 1 query tokens, the plan has 2"):
        backend.plan(two, **HEADS)


def test_triton_backend_checks_the_pages_a_plan_reads() -> None:
    backend = TritonBackend(device=DEVICE)
    backend.plan(_one_level_plan([0, 1], [0, 2], [0, 5], [4], [0]), **HEADS)
    with pytest.raises(ValueError, match="references page 5, the KV cache has 5 pages"):
        backend.run(torch.randn(1, 2, 16, device=DEVICE), torch.randn(5, 2, 4, 1, 16, device=DEVICE))


def test_one_level_with_splits_merges_them() -> None:
    """One level split along its KV (a forced chunk) writes partial rows and merges them: only a
    plan without splits writes the output directly."""
    gen = torch.Generator().manual_seed(0)
    tables, kv_lens, qo_lens = [np.arange(10), np.arange(10, 13)], [40, 9], [2, 1]
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, 4)
    assert len(plan.levels) == 1
    kv_cache = torch.randn(13, 2, 4, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(3, 2, 16, generator=gen).to(DEVICE)
    backend = TritonBackend(device=DEVICE, kv_chunk_size=16)
    backend.plan(plan, **HEADS)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


def test_split_tokens_merge_every_layer_and_tokens_without_kv_get_zeros() -> None:
    """One plan run as several layers, exact and under a capacity: the split tokens are merged from
    each run's own partial rows, and a token that no level gives KV gets out 0 (lse -inf), never
    what ``out`` held."""
    gen = torch.Generator().manual_seed(3)
    # Group 1 (token 2) has no pages; groups 0 and 2 are split by the forced 8-token chunks.
    plan = _one_level_plan([0, 2, 3, 4], [0, 10, 10, 13], np.arange(13), [4, 4, 2], np.arange(4))
    tables, kv_lens, qo_lens = [np.arange(10), np.arange(10, 10), np.arange(10, 13)], [40, 0, 10], [2, 1, 1]
    kv_cache = torch.randn(13, 2, 4, 1, 16, generator=gen).to(DEVICE)
    capacity = GraphCapacity(max_query_tokens=6, max_pages=16, max_levels=2)
    for backend in (
        TritonBackend(DEVICE, kv_chunk_size=8),
        TritonBackend(DEVICE, kv_chunk_size=8, capacity=capacity),
    ):
        backend.plan(plan, **HEADS)
        for _ in range(3):
            q = torch.randn(4, 2, 16, generator=gen).to(DEVICE)
            out = torch.full_like(q, float("nan"))
            backend.run(q, kv_cache, out=out)
            expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
            assert not out[2].any()


def test_tokens_with_one_state_skip_the_merge() -> None:
    """In a two-level plan, the tokens of the request that shares nothing have one state (the unique
    level, unsplit): they write their output directly and only the sharing requests' tokens are
    merged, in both backends; a fixed-capacity backend then replays a plan with fewer tokens to
    merge (the first plan's merge programs must write nothing)."""
    gen = torch.Generator().manual_seed(6)
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0)
    kv_cache = torch.randn(30, 2, 4, 1, 16, generator=gen).to(DEVICE)
    shared = np.arange(10, 14)
    batches = (  # the lone request first, in the engine's order and in the plan's (lower page ids)
        ([np.arange(3), np.r_[shared, 20, 21], np.r_[shared, 22]], [10, 22, 19], [1, 2, 1]),
        ([np.arange(20, 23), np.arange(23, 26)], [11, 9], [2, 1]),
    )
    fixed = TritonBackend(DEVICE, capacity=GraphCapacity(max_query_tokens=4, max_pages=16, max_levels=2))
    for backend in (TritonBackend(DEVICE), fixed):
        for (tables, kv_lens, qo_lens), levels, merged in zip(batches, (2, 1), (3, 0), strict=True):
            plan = planner.plan(tables, kv_lens, qo_lens, 4)
            assert len(plan.levels) == levels
            backend.plan(plan, **HEADS)
            if backend is not fixed:
                assert backend._merges == merged
            q = torch.randn(sum(qo_lens), 2, 16, generator=gen).to(DEVICE)
            expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
            out = torch.full((4, 2, 16), math.nan, device=DEVICE)
            backend.run(torch.cat([q, q.new_zeros(4 - len(q), 2, 16)]) if backend is fixed else q,
                        kv_cache, out=out if backend is fixed else out[: len(q)])  # fmt: skip
            torch.testing.assert_close(out[: len(q)].double(), expected, atol=2e-5, rtol=2e-5)


def test_a_new_plan_is_run_with_its_own_launches() -> None:
    """Plans without a dtype bind their launches at the first run: a second, larger plan run with
    the same dtype must not reuse the first plan's grid."""
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(40, 2, 4, 1, 16, generator=gen).to(DEVICE)
    backend = TritonBackend(device=DEVICE, kv_chunk_size=16)
    for tables, kv_lens, qo_lens in (
        ([np.arange(2)], [5], [1]),
        ([np.arange(10), np.arange(10, 30)], [40, 80], [3, 2]),  # more items, and splits
    ):
        plan = CascadePlanner().plan(tables, kv_lens, qo_lens, 4)
        backend.plan(plan, **HEADS)
        q = torch.randn(sum(qo_lens), 2, 16, generator=gen).to(DEVICE)
        expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
        torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


def _shared_batch(requests: int):
    """(tables, kv_lens, qo_lens, cascade plan): ``requests`` decodes over 8 shared pages of 4 tokens,
    one page of their own each."""
    tables = [np.concatenate([np.arange(8), [8 + r]]) for r in range(requests)]
    kv_lens, qo_lens = [35] * requests, [1] * requests
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=1, cost_model=None)
    plan = planner.plan(tables, kv_lens, qo_lens, 4)
    assert len(plan.levels) == 2, "the batch needs a shared level and a unique one"
    return tables, kv_lens, qo_lens, plan


def test_an_exact_plan_launches_its_narrowest_tile_first() -> None:
    """The unique level's decode tile runs before the shared level's wider one (measured faster on
    the GPU: benchmarks/NOTES.md), and the order leaves the output as it was."""
    gen = torch.Generator().manual_seed(2)
    group = HEADS["num_qo_heads"] // HEADS["num_kv_heads"]
    requests = SHARED_ON_NARROW_ROWS // group + 1  # a shared level too tall for the narrow tile
    tables, kv_lens, qo_lens, plan = _shared_batch(requests)
    kv_cache = torch.randn(8 + requests, 2, 4, 1, 16, generator=gen).to(DEVICE)
    backend = TritonBackend(device=DEVICE)
    backend.plan(plan, **HEADS)
    rows = [launch.tile.block_m for launch in backend._launches]
    assert len(rows) == 2 and rows == sorted(rows) and rows[0] < rows[1], rows
    q = torch.randn(requests, 2, 16, generator=gen).to(DEVICE)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fixed", [False, True])
def test_a_plan_runs_at_most_two_attention_launches(fixed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three levels of three tile widths (a root shared by 40 requests; two branches of 12 requests
    each, the other 16 requests a group without branch KV; a page of each one's own) run in two
    launches, the branches on the root's wide tile: an exact plan on its own narrowest and widest
    tiles, a fixed-capacity one on its narrow and wide launches (its middle launch, which the
    branches fit, left out: key "triton"); the output is the reference's."""
    monkeypatch.setattr(triton_schedule, "SHARED_ON_NARROW_READS", 0)  # keep the branches off the narrow tile
    gen = torch.Generator().manual_seed(4)
    requests = 40
    branch = [np.arange(8 + 4 * (r // 12), 12 + 4 * (r // 12)) if r < 24 else [] for r in range(requests)]
    tables = [np.r_[np.arange(8), branch[r], [16 + r]].astype(int) for r in range(requests)]
    kv_lens = [4 * (len(t) - 1) + 3 for t in tables]
    qo_lens = [1] * requests
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=1, cost_model=None)
    plan = planner.plan(tables, kv_lens, qo_lens, 4)
    assert len(plan.levels) == 3, "the batch needs a root, a branch and a unique level"
    capacity = GraphCapacity(max_query_tokens=requests, max_pages=100, max_levels=3) if fixed else None
    backend = TritonBackend(device=DEVICE, capacity=capacity)
    backend.plan(plan, **HEADS)
    group = HEADS["num_qo_heads"] // HEADS["num_kv_heads"]
    rows = [level.max_rows_per_group * group for level in triton_backend.checked_levels(plan)]
    own = {work.tile_config(r, group, HEADS["head_dim"], 4).block_m for r in rows}
    assert len(own) == 3, f"the levels' own tiles must differ, got {own}"
    if fixed:
        _, middle, _ = work.fixed_tile_configs(group, HEADS["head_dim"], 4)
        assert rows[1] <= middle.block_m < rows[0], "the branches must fit the middle tile, the root not"
        assert backend.graph_key == "triton"
    used = [launch.tile.block_m for launch in backend._launches if int(launch.num_work.item()) > 0]
    assert used == [min(own), max(own)]
    kv_cache = torch.randn(16 + requests, 2, 4, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(requests, 2, 16, generator=gen).to(DEVICE)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("limit", [None, "reads", "slots"])
def test_a_prefix_shared_by_few_requests_runs_in_the_decode_launch(
    kv_heads: int, fixed: bool, limit: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared level of at most SHARED_ON_NARROW_ROWS rows per group runs on the decode tile, in
    one launch with the unique level (exact plans and the fixed pair alike); one row more, KV reads
    over SHARED_ON_NARROW_READS, or a launch past one wave of resident programs, and it takes a wider
    tile of its own. The output is the reference's either way."""
    gen = torch.Generator().manual_seed(3)
    heads = dict(num_qo_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=16)
    fits = SHARED_ON_NARROW_ROWS // 2
    # The shared level on 16-row tiles: ceil(fits / 8) M tiles per KV head, each reading 32 tokens of
    # K and V.
    reads = -(-fits // 8) * 32 * kv_heads * 16 * 2
    monkeypatch.setattr(triton_schedule, "SHARED_ON_NARROW_READS", reads - (limit == "reads"))
    if limit == "slots":  # 1 SM x 4 resident decode programs, fewer than the unique level's 32+
        monkeypatch.setattr(triton_backend, "num_sms", lambda device: 1)
    batches = ((fits, 1 if limit is None else 2),) + (((fits + 1, 2),) if limit is None else ())
    for requests, launches in batches:
        tables, kv_lens, qo_lens, plan = _shared_batch(requests)
        kv_cache = torch.randn(8 + requests, 2, 4, kv_heads, 16, generator=gen).to(DEVICE)
        capacity = GraphCapacity(max_query_tokens=requests, max_pages=8 + requests, max_levels=2)
        backend = TritonBackend(device=DEVICE, capacity=capacity if fixed else None)
        backend.plan(plan, **heads)
        assert sum(int(launch.num_work.item()) > 0 for launch in backend._launches) == launches
        q = torch.randn(requests, 2 * kv_heads, 16, generator=gen).to(DEVICE)
        expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
        torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


def test_a_causal_level_keeps_its_own_tile() -> None:
    """Only shared (non-causal) levels join the narrow launch: a unique level of 64 rows (a 32-token
    prefill beside 8 decodes) next to a narrower shared level keeps its own, wider tile. The
    prefill request shares nothing, so the shared level's rows are its 8 decodes' alone."""
    gen = torch.Generator().manual_seed(5)
    tables = [np.r_[np.arange(8), [8 + r]] for r in range(8)] + [np.arange(20, 30)]
    kv_lens, qo_lens = [35] * 8 + [40], [1] * 8 + [32]
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=1, cost_model=None)
    plan = planner.plan(tables, kv_lens, qo_lens, 4)
    assert [level.causal for level in plan.levels] == [False, True]
    backend = TritonBackend(device=DEVICE)
    backend.plan(plan, **HEADS)
    assert len(backend._launches) == 2
    kv_cache = torch.randn(30, 2, 4, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(40, 2, 16, generator=gen).to(DEVICE)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_levels_join_the_narrow_launch_while_its_wave_has_room(
    kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two small shared levels (a root shared by 24 decodes, two branches of 12), 28 resident decode
    programs per KV head: the unique level's 24 M tiles and the root's 3 fit, the branches' 4 more do
    not, so the branches run on the plan's wide tile."""
    monkeypatch.setattr(triton_backend, "num_sms", lambda device: 7 * kv_heads)  # x 4 decode programs
    gen = torch.Generator().manual_seed(6)
    heads = dict(num_qo_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=16)
    requests = 24
    tables = [np.r_[np.arange(8), np.arange(8, 12) + 4 * (r // 12), [16 + r]] for r in range(requests)]
    kv_lens, qo_lens = [4 * 12 + 3] * requests, [1] * requests
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=1, cost_model=None)
    plan = planner.plan(tables, kv_lens, qo_lens, 4)
    assert len(plan.levels) == 3, "the batch needs a root, a branch and a unique level"
    backend = TritonBackend(device=DEVICE)
    backend.plan(plan, **heads)
    items = [(launch.tile.block_m, int(launch.num_work.item())) for launch in backend._launches]
    # Narrow: 24 unique items + 3 root M tiles (unsplit); wide (the root's own tile): the branches'
    # 2 groups.
    assert items == [(16, 27), (items[1][0], 2)] and items[1][0] > 16, items
    kv_cache = torch.randn(16 + requests, 2, 4, kv_heads, 16, generator=gen).to(DEVICE)
    q = torch.randn(requests, 2 * kv_heads, 16, generator=gen).to(DEVICE)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors outside the interpreter")
def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TritonBackend(device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    backend.plan(_one_level_plan([0, 1], [0, 1], [0], [4], [0]), **HEADS)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.run(torch.randn(1, 2, 16), torch.randn(1, 2, 4, 1, 16))


def test_graph_capacity_defaults_and_checks() -> None:
    capacity = GraphCapacity(max_query_tokens=40, max_pages=200, max_levels=3)
    assert capacity.work_items == 40 * 3 + 2048 and capacity.partial_rows == 40 * 3 + 4096
    assert GraphCapacity(1, 1, max_work_items=5, max_partial_rows=6).work_items == 5
    for name in ("max_query_tokens", "max_pages", "max_levels", "max_work_items"):
        with pytest.raises(ValueError, match=f"GraphCapacity.{name} must be >= 1, got 0"):
            GraphCapacity(**{"max_query_tokens": 1, "max_pages": 1, name: 0})
    with pytest.raises(ValueError, match=r"GraphCapacity\.max_partial_rows must be >= 0, got -1"):
        GraphCapacity(1, 1, max_partial_rows=-1)
    assert GraphCapacity(1, 1, max_partial_rows=0).partial_rows == 0


def test_fixed_capacity_accepts_a_plan_that_fills_it() -> None:
    """Capacities are inclusive: as many query tokens, pages and levels as the capacity plan and run."""
    gen = torch.Generator().manual_seed(3)
    tables, kv_lens, qo_lens = [np.arange(2)], [20], [3]
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, 16)
    backend = TritonBackend(DEVICE, capacity=GraphCapacity(max_query_tokens=3, max_pages=2, max_levels=1))
    backend.plan(plan, **HEADS)
    kv_cache = torch.randn(2, 2, 16, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(3, 2, 16, generator=gen).to(DEVICE)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)


def test_fixed_capacity_keeps_its_sm_scale() -> None:
    """A CUDA graph captures the scale: a fixed-capacity backend refuses another one."""
    backend = TritonBackend(DEVICE, capacity=GraphCapacity(max_query_tokens=4, max_pages=8))
    plan = CascadePlanner().plan([np.arange(2)], [20], [3], 16)
    backend.plan(plan, **HEADS, sm_scale=0.5)
    with pytest.raises(ValueError, match="keeps its heads, head_dim, page_size and sm_scale"):
        backend.plan(plan, **HEADS, sm_scale=0.25)


@contextlib.contextmanager
def _tiles_of(interpreter: bool):
    """Plans made inside take the interpreter's tiles and grids (``interpreter``) or a GPU's, whatever
    this machine runs (CPU tensors count an H200's SMs)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(work, "interpreting", lambda: interpreter)
        mp.setattr(triton_backend, "interpreting", lambda: interpreter)
        yield


def _split_lengths(
    plan: CascadePlan, heads: dict, capacity: GraphCapacity | None = None, fa3: bool = False
) -> set[int]:
    """KV tokens of the plan's work items on the GPU's tiles (scheduled on the CPU, not run); with
    ``fa3``, its shared level handed to a stand-in FlashInfer first."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    backend = TritonBackend(device="cpu", capacity=capacity)
    if fa3:
        rule = LevelRule(min_rows=4, min_kv_tokens=12, min_work=1, min_split_tokens=256)
        backend._shared_levels = SharedLevelsOnFlashInfer(
            flashinfer_stand_in, backend.device, rule, capacity=capacity
        )
    with _tiles_of(interpreter=False):
        backend.plan(plan, **heads, q_dtype=torch.bfloat16)
        items = [launch.work.numpy()[: int(launch.num_work.item())] for launch in backend._launches]
    return {int(n) for work_list in items for n in work_list[:, work.KV1] - work_list[:, work.KV0]}


@pytest.mark.parametrize("capacity", [None, GraphCapacity(max_query_tokens=64, max_pages=1024)])
def test_a_lone_level_of_decodes_splits_finer_than_a_cascade(capacity) -> None:
    """Eight decodes over 1024 tokens each leave the H200's SMs idle unsplit (8 requests x 8 KV
    heads): their one-level plan splits them from 128 tokens at head dims up to 128, from 256 at
    d256, with a prefill chunk among them (a wider tile) and as the unique level of a cascade, also
    one whose shared level runs on FlashInfer (kv_split.min_split_tokens)."""
    tables = [np.arange(i * 64, (i + 1) * 64) for i in range(8)]
    llama = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    one = CascadePlanner(max_levels=1, cost_model=None).plan(tables, [1024] * 8, [1] * 8, 16)
    assert len(one.levels) == 1
    assert _split_lengths(one, llama, capacity) == {128}
    assert _split_lengths(one, dict(num_qo_heads=16, num_kv_heads=8, head_dim=256), capacity) == {256}
    chunk = CascadePlanner(max_levels=1, cost_model=None).plan(tables, [1024] * 8, [1] * 7 + [40], 16)
    assert min(_split_lengths(chunk, llama, capacity)) == 256  # 128 on the decode tile (rows <= 16)
    shared = [np.concatenate([np.arange(1000, 1032), t]) for t in tables]  # a 512-token prefix first
    two = CascadePlanner(cost_model=None).plan(shared, [1536] * 8, [1] * 8, 16)
    assert len(two.levels) == 2
    assert min(_split_lengths(two, llama, capacity)) >= 256
    assert min(_split_lengths(two, llama, capacity, fa3=True)) >= 256


def _gpu_launches(backend: TritonBackend, plan: CascadePlan, heads: dict) -> list[tuple]:
    """(tile, work items) of each launch the plan runs, scheduled for the GPU's tiles on the CPU."""
    with _tiles_of(interpreter=False):
        backend.plan(plan, **heads, q_dtype=torch.bfloat16)
    launches = backend._launches
    if backend.capacity is not None:
        launches = [launches[i] for i in backend._fixed_run]
    return [(launch.tile, launch.work.numpy()[: int(launch.num_work.item())].copy()) for launch in launches]


@pytest.mark.parametrize("capacity", [None, GraphCapacity(max_query_tokens=512, max_pages=20000)])
def test_a_lone_level_of_decodes_filling_a_wave_runs_on_its_own_tile(capacity, monkeypatch) -> None:
    """One level of 8 decodes over 1024 tokens at 32/8 d128 splits into 512 programs, about one wave
    of an H200's resident ones, each over 128 tokens: it runs the same work items on the lone
    decode tile (32 KV tokens per step, three stages), under a capacity as a launch of its own (key
    "triton-decode"), and the backend goes back to its fixed launches for the next plan. Fewer
    programs (1 x 256), more than a wave (512 x 256), longer items (64 x 4608 and 32 x 320: 512
    programs of 4608 tokens, and of 128 or 192), a prefill chunk (a wider tile), a cascade, d256,
    pages of one token and MHA (one query head per KV head) keep their tiles
    (``work.lone_decode_tile``)."""
    llama = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    decode = work.TileConfig(16, 64, 4, 2)
    lone = work.TileConfig(16, 32, 4, 3)

    def one_level(requests: int, kv: int, qo: list[int] | None = None, page: int = 16):
        n = -(-(kv + max(qo or [1])) // page)
        tables = [np.arange(i * n, (i + 1) * n) for i in range(requests)]
        planner = CascadePlanner(max_levels=1, cost_model=None)
        return planner.plan(tables, [kv] * requests, qo or [1] * requests, page)

    backend = TritonBackend(device="cpu", capacity=capacity)
    wave = one_level(8, 1024)
    ((tile, items),) = _gpu_launches(backend, wave, llama)
    assert tile == lone and items.shape[0] * 8 == 512
    assert backend.graph_key == (None if capacity is None else "triton-decode")
    with monkeypatch.context() as mp:
        mp.setattr(work, "LONE_DECODE_MIN_PROGRAMS", 1 << 30)
        ((off_tile, off_items),) = _gpu_launches(TritonBackend(device="cpu", capacity=capacity), wave, llama)
    assert off_tile == decode
    np.testing.assert_array_equal(items, off_items)

    long_items = one_level(64, 4608)  # 512 programs of 4608 KV tokens each
    chunk = one_level(8, 1024, [1] * 7 + [40])  # a prefill chunk: a wider tile than the decode one
    for plan, on_decode_tile in (
        (one_level(1, 256), True),
        (one_level(512, 256), True),
        (long_items, True),
        (one_level(32, 320), True),  # 512 programs of 128 or 192 KV tokens
        (chunk, capacity is not None),  # exact: one launch on the wide tile; fixed: narrow + wide
    ):
        tiles = [tile for tile, _ in _gpu_launches(backend, plan, llama)]
        assert lone not in tiles and (decode in tiles) == on_decode_tile
        assert capacity is None or backend.graph_key in ("triton-narrow", "triton-mid", "triton")
    shared = [np.concatenate([np.arange(1000, 1032), np.arange(i * 64, (i + 1) * 64)]) for i in range(8)]
    cascade = CascadePlanner(cost_model=None).plan(shared, [1536] * 8, [1] * 8, 16)
    assert len(cascade.levels) == 2
    assert lone not in [tile for tile, _ in _gpu_launches(backend, cascade, llama)]
    ((tile, _),) = _gpu_launches(backend, wave, llama)
    assert tile == lone and backend.graph_key == (None if capacity is None else "triton-decode")
    mha = dict(num_qo_heads=8, num_kv_heads=8, head_dim=128)  # 4 x 2048: 512 programs
    d256 = dict(num_qo_heads=16, num_kv_heads=8, head_dim=256)
    for heads, plan in ((d256, wave), (llama, one_level(8, 1024, page=1)), (mha, one_level(4, 2048))):
        other = TritonBackend(device="cpu", capacity=capacity)
        ((tile, items),) = _gpu_launches(other, plan, heads)
        assert tile != lone and other._lone_launch is None and len(other._launches) <= 3
    assert items.shape[0] * 8 == 512


def test_an_exact_plan_of_one_launch_over_128_dims_takes_the_fixed_grid() -> None:
    """At head dim 256 a decode tile fits fewer programs per SM than the nominal four: an exact
    plan whose work runs in one decode launch gets at least as many programs as a fixed-capacity
    launch of its tile, the extra ones idle (the cascade of a 2048-token prefix under 32 requests,
    256 own: 512 pairs -> 132 SMs x 16), and one program per pair where it has more (512 decodes:
    4096 pairs). Two launches at d256, a prefill launch, the same cascade at d128 and the
    interpreter keep one program per (item, KV head) pair. Decode tiles run 4 warps."""

    def cascade(requests: int, prefix_pages: int) -> CascadePlan:
        tables = [np.r_[np.arange(prefix_pages), 1000 + 17 * r + np.arange(17)] for r in range(requests)]
        kv_lens = [16 * (prefix_pages + 16) + 1] * requests
        plan = CascadePlanner(cost_model=None).plan(tables, kv_lens, [1] * requests, 16)
        assert len(plan.levels) == 2
        return plan

    def grids(plan: CascadePlan, heads: dict, gpu: bool = True) -> list[tuple[int, int, int]]:
        backend = TritonBackend(device="cpu")
        with _tiles_of(interpreter=not gpu):
            backend.plan(plan, **heads, q_dtype=torch.bfloat16)
        kv_heads = heads["num_kv_heads"]
        return [
            (launch.tile.num_warps, int(launch.num_work.item()) * kv_heads, launch.num_programs)
            for launch in backend._launches
        ]

    d256 = dict(num_qo_heads=16, num_kv_heads=8, head_dim=256)
    tile = work.TileConfig(16, 64, 4, 2)
    fixed_grid = (
        triton_backend.num_sms(torch.device("cpu"))
        * tile.resident_per_sm()
        * triton_backend.persistent_waves(tile)
    )
    ((warps, pairs, programs),) = grids(cascade(32, 128), d256)
    assert warps == 4 and pairs < programs == fixed_grid
    many = CascadePlanner(cost_model=None).plan([[r] for r in range(512)], [16] * 512, [1] * 512, 16)
    ((warps, pairs, programs),) = grids(many, d256)
    assert fixed_grid < pairs == programs
    ((warps, pairs, programs),) = grids(cascade(32, 128), dict(num_qo_heads=32, num_kv_heads=8, head_dim=128))
    assert warps == 4 and programs == pairs
    two = grids(cascade(64, 256), dict(num_qo_heads=8, num_kv_heads=2, head_dim=256))
    assert len(two) == 2 and all(programs == pairs for _, pairs, programs in two)
    prefill = CascadePlanner(cost_model=None).plan([list(range(32))], [512], [512], 16)
    ((_, pairs, programs),) = grids(prefill, d256)
    assert programs == pairs
    interpreted = grids(cascade(32, 128), d256, gpu=False)
    assert interpreted and all(programs == pairs for _, pairs, programs in interpreted)


def test_fixed_capacity_replays_a_lone_decode_level_between_other_plans(monkeypatch) -> None:
    """Under a capacity, plans alternate between the lone level's launch (its program threshold
    lowered to reach it at test sizes) and the fixed ones on the same device buffers; every output is
    right against the float64 reference."""
    monkeypatch.setattr(work, "LONE_DECODE_MIN_PROGRAMS", 1)
    gen = torch.Generator().manual_seed(11)
    page, hq, hkv, d = 16, 4, 2, 16
    kv_cache = torch.randn(40, 2, page, hkv, d, generator=gen).to(DEVICE)
    unshared = ([np.arange(5 * i, 5 * i + 5) for i in range(3)], [70, 80, 33], [1, 1, 1])
    shared = ([np.r_[np.arange(20, 30), 30 + i] for i in range(4)], [165, 170, 161, 175], [1, 1, 1, 1])
    planner = CascadePlanner(min_shared_tokens=16, min_saved_tokens=0, cost_model=None)
    capacity = GraphCapacity(max_query_tokens=4, max_pages=60)
    backend = TritonBackend(DEVICE, kv_chunk_size=32, capacity=capacity)
    buffers = None
    for batch, key in ((unshared, "triton-decode"), (shared, "triton-narrow"), (unshared, "triton-decode")):
        tables, kv_lens, qo_lens = batch
        plan = planner.plan(tables, kv_lens, qo_lens, page)
        backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
        assert backend.graph_key == key
        now = [t.data_ptr() for t in (backend._ints, backend._part_o, backend._part_lse)]
        assert buffers in (None, now)
        buffers = now
        q = torch.randn(4, hq, d, generator=gen).to(DEVICE)  # padded to the capacity
        out = torch.full_like(q, math.nan)
        backend.run(q, kv_cache, out=out)
        expected = reference_attention(q[: len(qo_lens)], kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        torch.testing.assert_close(out[: len(qo_lens)].double(), expected, atol=2e-5, rtol=2e-5)


def test_fixed_capacity_takes_fewer_splits_when_they_do_not_fit() -> None:
    """Splits over the capacity's partial rows or work items are cut down (fewer, longer splits),
    the output still right; a plan that does not fit even unsplit raises."""
    gen = torch.Generator().manual_seed(2)
    tables, kv_lens, qo_lens = [np.arange(50)], [200], [1]
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, 4)
    kv_cache = torch.randn(50, 2, 4, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(2, 2, 16, generator=gen).to(DEVICE)  # padded to the capacity
    expected = reference_attention(q[:1], kv_cache, tables, kv_lens, qo_lens, 16**-0.5)
    for rows, items in ((4, 100), (100, 3)):  # 13 splits of 16 tokens do not fit either
        capacity = GraphCapacity(2, 50, max_levels=1, max_partial_rows=rows, max_work_items=items)
        backend = TritonBackend(DEVICE, kv_chunk_size=16, capacity=capacity)
        backend.plan(plan, **HEADS)
        assert 1 < backend._counts[0] <= min(rows, items)
        out = torch.full_like(q, math.nan)
        backend.run(q, kv_cache, out=out)
        torch.testing.assert_close(out[:1].double(), expected, atol=2e-5, rtol=2e-5)
    two = CascadePlanner().plan([np.arange(25), np.arange(25, 50)], [100, 100], [1, 1], 4)
    backend = TritonBackend(DEVICE, capacity=GraphCapacity(2, 50, max_levels=1, max_work_items=1))
    with pytest.raises(ValueError, match="the plan needs 2 work items and 0 partial rows, over the backend's "
                       "capacity of 1 and"):  # fmt: skip
        backend.plan(two, **HEADS)


def _split_levels_backend(rule=None):
    """A Triton backend whose long shared levels run on ``flashinfer_stand_in`` (float64 inside, FA3's
    base-2 LSE), as the auto backend sets it up on Hopper."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    # min_work: exactly the short prefix's 4 query rows x 12 tokens x 2 KV heads in the first test.
    rule = rule or LevelRule(min_rows=4, min_kv_tokens=12, min_work=4 * 12 * 2, min_split_tokens=8)
    backend = TritonBackend(device=DEVICE, kv_chunk_size=8)
    backend._shared_levels = SharedLevelsOnFlashInfer(flashinfer_stand_in, torch.device(DEVICE), rule)
    return backend


@pytest.mark.parametrize(
    ("hq", "hkv", "prefix", "queries", "taken"),
    [
        (32, 8, 32768, 128, True),  # 512 rows per KV head x 32768 tokens x 8 KV heads
        (32, 8, 4096, 128, False),  # the same rows over 4096 tokens: 1/8 of the work
        (32, 1, 4096, 64, False),  # MQA: 2048 rows per KV head but one KV head (1.34x slower on FA3)
    ],
)
def test_level_rule_defaults_count_the_work_of_every_kv_head(hq, hkv, prefix, queries, taken) -> None:
    """The default rule: decodes over one prefix go to FA3 by their query rows x KV tokens x KV heads."""
    import flashinfer_stand_in
    from prefix_cache.kernels.work import check_level

    from prefix_cache.attention.flashinfer_levels import SharedLevelsOnFlashInfer

    page = 16
    tables = [np.r_[np.arange(prefix // page), prefix // page + r] for r in range(queries)]
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(
        tables, [prefix + 5] * queries, [1] * queries, page
    )
    levels = [
        check_level(lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.kv_last_page_len, page)
        for lv in plan.levels
    ]
    fa3 = SharedLevelsOnFlashInfer(flashinfer_stand_in, torch.device("cpu"))
    got = fa3.take(levels, [lv.causal for lv in plan.levels], (hq, hkv), 128, torch.bfloat16)
    assert got == (0 if taken else None)


def test_shared_levels_split_into_flashinfer_requests_merge_with_our_levels() -> None:
    """Shared levels taken by ``SharedLevelsOnFlashInfer``: each group's KV cut into chunks of whole
    pages, the group's queries repeated per chunk, the chunks' base-2 states
    merged with the unique level's split states by the Triton merge; a request outside every shared
    group keeps its Triton-only path. Checked against the float64 reference, and the plan that takes
    no level (float32 q, a head dim FA3 lacks, short prefixes) stays pure Triton."""
    gen = torch.Generator().manual_seed(7)
    page, hq, hkv, d = 4, 4, 2, 64
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    kv_cache = torch.randn(60, 2, page, hkv, d, generator=gen).half().to(DEVICE)
    long, short = np.arange(0, 9), np.arange(9, 12)  # 36 and 12 shared tokens
    tables = [np.r_[long, 20 + 2 * r, 21 + 2 * r] for r in range(3)]
    tables += [np.r_[short, 30 + r] for r in range(2)]
    tables.append(np.array([40, 41, 42]))
    kv_lens = [36 + 7, 36 + 5, 36 + 8, 12 + 3, 12 + 4, 10]
    qo_lens = [1, 2, 1, 1, 1, 1]
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(tables, kv_lens, qo_lens, page)
    assert len(plan.levels) == 2 and not plan.levels[0].causal
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).half().to(DEVICE)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)

    backend = _split_levels_backend()
    backend.plan(plan, **heads, q_dtype=torch.float16)
    assert backend._external  # the shared level went to the stand-in, 3 chunks for the long prefix
    # 36 tokens: 3 chunks of 3 pages x 4 query rows; 12 tokens: 1 chunk x 2 query rows.
    assert backend._shared_levels._q_index.shape[0] == 3 * 4 + 1 * 2
    out = torch.full_like(q, float("nan"))
    backend.run(q, kv_cache, out=out)
    torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3)

    # Nothing taken: float32 q (FA3 takes fp16 / bf16), a group under the rule's length, one under
    # its work (the short prefix: 4 query rows x 12 tokens x 2 KV heads), head dim 16.
    from prefix_cache.attention.flashinfer_levels import LevelRule

    for dtype, rule, dim in (
        (torch.float32, None, d),
        (torch.float16, LevelRule(min_rows=4, min_kv_tokens=16, min_work=1), d),
        (torch.float16, LevelRule(min_rows=4, min_kv_tokens=12, min_work=4 * 12 * hkv + 1), d),
        (torch.float16, None, 16),
    ):
        backend = _split_levels_backend(rule)
        backend.plan(plan, **{**heads, "head_dim": dim}, q_dtype=dtype)
        assert not backend._external
        out = torch.full_like(q[..., :dim], float("nan"), dtype=dtype)
        q_dim, kv_dim = q[..., :dim].to(dtype).contiguous(), kv_cache[..., :dim].to(dtype).contiguous()
        backend.run(q_dim, kv_dim, out=out)
        want = reference_attention(q_dim, kv_dim, tables, kv_lens, qo_lens, dim**-0.5)
        torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=3e-3)
    with pytest.raises(ValueError, match="min_split_tokens must be >= 1"):
        LevelRule(min_split_tokens=0)


def test_one_shared_level_of_nested_ones_runs_on_flashinfer() -> None:
    """Two nested shared levels that both pass the rule (a prefix shared by all, then one per half):
    one goes to the stand-in (a token's states there are one run of rows), the other stays on the
    Triton kernels, and every output row matches the float64 reference."""
    gen = torch.Generator().manual_seed(8)
    page, hq, hkv, d = 4, 4, 2, 64
    kv_cache = torch.randn(80, 2, page, hkv, d, generator=gen).half().to(DEVICE)
    common, left, right = np.arange(0, 6), np.arange(6, 12), np.arange(12, 20)  # 24, 24 and 32 tokens
    tables = [np.r_[common, left, 30 + r] for r in range(3)]
    tables += [np.r_[common, right, 40 + r] for r in range(3)]
    kv_lens, qo_lens = [48 + 3] * 3 + [56 + 2] * 3, [1] * 6
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(tables, kv_lens, qo_lens, page)
    assert [level.causal for level in plan.levels] == [False, False, True]
    q = torch.randn(6, hq, d, generator=gen).half().to(DEVICE)
    backend = _split_levels_backend()
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16)
    assert backend._external
    # The second level (24 + 32 tokens per half) holds more work than the first (24 for all).
    assert backend._shared_levels._q_index.shape[0] == 3 * 3 + 4 * 3
    out = torch.full_like(q, float("nan"))
    backend.run(q, kv_cache, out=out)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3)


def test_fixed_capacity_runs_a_shared_level_on_flashinfer_graph_mode() -> None:
    """Under a capacity, the level the rule admits runs on the stand-in's CUDA-graph mode: every plan
    padded to the one fixed batch and row count (the stand-in refuses any other), the same device
    buffers across plans (what a replayed graph reads), ``graph_key`` telling the two launch
    sequences apart, and each plan's output right against the float64 reference, also after a plan
    that takes no level and back."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    gen = torch.Generator().manual_seed(9)
    page, hq, hkv, d = 4, 4, 2, 64
    kv_cache = torch.randn(90, 2, page, hkv, d, generator=gen).half().to(DEVICE)
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0)
    long, short, lone = np.arange(9), np.arange(9, 12), np.array([40, 41])
    first, second, brief = np.arange(50, 60), np.arange(60, 67), np.arange(80, 82)
    batches = {
        # one long and one short shared prefix, and a request alone
        "a": ([np.r_[long, 20 + r] for r in range(3)] + [np.r_[short, 30 + r] for r in range(2)] + [lone],
              [36 + 3, 36 + 2, 36 + 4, 12 + 1, 12 + 3, 7], [1, 2, 1, 1, 1, 1]),
        # two long prefixes, more query tokens
        "b": ([np.r_[first, 70 + r] for r in range(2)] + [np.r_[second, 75 + r] for r in range(2)],
              [40 + 2, 40 + 4, 28 + 3, 28 + 1], [1, 3, 2, 2]),
        # nothing shared long enough for the rule
        "c": ([np.r_[brief, 84 + r] for r in range(3)], [8 + 2, 8 + 3, 8 + 1], [1, 1, 2]),
    }  # fmt: skip
    capacity = GraphCapacity(max_query_tokens=8, max_pages=40)
    backend = TritonBackend(DEVICE, kv_chunk_size=8, capacity=capacity)
    rule = LevelRule(min_rows=4, min_kv_tokens=12, min_work=1, min_split_tokens=8)
    fa3 = backend._shared_levels = SharedLevelsOnFlashInfer(
        flashinfer_stand_in, torch.device(DEVICE), rule, capacity=capacity
    )
    buffers = None
    for name in ("a", "b", "c", "a"):
        tables, kv_lens, qo_lens = batches[name]
        plan = planner.plan(tables, kv_lens, qo_lens, page)
        backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16)
        assert backend.graph_key == ("triton-narrow" if name == "c" else "triton+fa3")
        if name != "c":
            now = [t.data_ptr() for t in (fa3.o, fa3.lse, fa3._q, fa3._q_index, fa3._wrapper.qo)]
            assert buffers in (None, now)
            buffers = now
        q = torch.randn(sum(qo_lens), hq, d, generator=gen).half().to(DEVICE)
        out = torch.full_like(q, float("nan"))
        backend.run(q, kv_cache, out=out)
        expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("hq", [4, 64])
def test_a_flashinfer_level_keeps_the_wide_launch(hq: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a capacity, a plan whose shared level runs on FlashInfer (key "triton+fa3") runs its
    other levels on the narrow and the wide launch, the two its graph holds: the requests' own
    tokens, whose largest group (a request of 10 query tokens, 20 rows) fits the middle tile, run on
    the wide one, and the output is right. At 64 query heads per KV head the fixed tiles are one (in
    the interpreter at head dim 64, on a GPU at 256): the plan then makes that one launch, once."""
    import flashinfer_stand_in
    from prefix_cache.kernels.attention import AttentionLaunch

    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    gen = torch.Generator().manual_seed(9)
    page, hkv, d = 4, 2 if hq == 4 else 1, 64 if hq == 4 or DEVICE == "cpu" else 256
    kv_cache = torch.randn(90, 2, page, hkv, d, generator=gen).half().to(DEVICE)
    long, short, lone = np.arange(9), np.arange(9, 12), np.array([40, 41, 42])
    tables = [np.r_[long, 20 + r] for r in range(3)] + [np.r_[short, 30 + r] for r in range(2)] + [lone]
    kv_lens, qo_lens = [36 + 3, 36 + 2, 36 + 4, 12 + 1, 12 + 3, 12], [1, 2, 1, 1, 1, 10]
    capacity = GraphCapacity(max_query_tokens=24, max_pages=40)
    backend = TritonBackend(DEVICE, kv_chunk_size=8, capacity=capacity)
    rule = LevelRule(min_rows=4, min_kv_tokens=12, min_work=1, min_split_tokens=8)
    backend._shared_levels = SharedLevelsOnFlashInfer(
        flashinfer_stand_in, torch.device(DEVICE), rule, capacity=capacity
    )
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(tables, kv_lens, qo_lens, page)
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16)
    assert backend.graph_key == "triton+fa3"
    tiles = [launch.tile.block_m for launch in backend._launches]
    with_work = [launch.tile.block_m for launch in backend._launches if int(launch.num_work.item()) > 0]
    assert with_work == [tiles[-1]] and len(tiles) == (3 if hq == 4 else 1)
    launched: list = []
    run = AttentionLaunch.__call__
    monkeypatch.setattr(AttentionLaunch, "__call__", lambda self, *a: launched.append(self) or run(self, *a))
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).half().to(DEVICE)
    out = torch.full_like(q, float("nan"))
    backend.run(q, kv_cache, out=out)
    assert len(launched) == len(set(map(id, launched))) == (2 if hq == 4 else 1)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3)


def test_a_refused_plan_leaves_the_fixed_buffers_and_flashinfer_level_as_they_were() -> None:
    """Under a capacity, a plan refused for its partial rows (after its FA3 level is chosen) writes
    nothing a replayed graph reads: the int buffer, the FA3 query rows and FlashInfer's index buffers
    keep the previous plan, whose launches (what a replay runs) still give the right output."""
    import flashinfer_stand_in

    from prefix_cache.attention.base import split_kv_cache
    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    gen = torch.Generator().manual_seed(10)
    page, hq, hkv, d = 4, 4, 2, 64
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16)
    kv_cache = torch.randn(90, 2, page, hkv, d, generator=gen).half().to(DEVICE)
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0)
    long, short, lone = np.arange(9), np.arange(9, 12), np.array([40, 41])
    first, second = np.arange(50, 60), np.arange(60, 67)
    a = ([np.r_[long, 20 + r] for r in range(3)] + [np.r_[short, 30 + r] for r in range(2)] + [lone],
         [36 + 3, 36 + 2, 36 + 4, 12 + 1, 12 + 3, 7], [1, 2, 1, 1, 1, 1])  # fmt: skip
    b = ([np.r_[first, 70 + r] for r in range(2)] + [np.r_[second, 75 + r] for r in range(2)],
         [40 + 2, 40 + 4, 28 + 3, 28 + 1], [1, 3, 2, 2])  # fmt: skip
    capacity = GraphCapacity(max_query_tokens=8, max_pages=40, max_partial_rows=6)
    backend = TritonBackend(DEVICE, kv_chunk_size=8, capacity=capacity)
    rule = LevelRule(min_rows=4, min_kv_tokens=12, min_work=1, min_split_tokens=8)
    fa3 = backend._shared_levels = SharedLevelsOnFlashInfer(
        flashinfer_stand_in, torch.device(DEVICE), rule, capacity=capacity
    )
    plan_a = planner.plan(*a, page)
    backend.plan(plan_a, **heads)
    assert backend.graph_key == "triton+fa3"
    wrapper = fa3._wrapper
    read_by_replay = [backend._ints, fa3._q_index, wrapper.qo, wrapper.kv, wrapper.indices, wrapper.last]
    before = [t.clone() for t in read_by_replay]
    with pytest.raises(ValueError, match="partial rows, over the backend's capacity of"):
        backend.plan(planner.plan(*b, page), **heads)
    for now, then in zip(read_by_replay, before, strict=True):
        assert torch.equal(now, then)
    q = torch.randn(sum(a[2]), hq, d, generator=gen).half().to(DEVICE)
    out = torch.full_like(q, float("nan"))
    k, v = split_kv_cache(kv_cache)
    backend._run(plan_a, q, kv_cache, k, v, out)  # the launches a graph captured after plan_a makes
    torch.testing.assert_close(
        out.double(), reference_attention(q, kv_cache, *a, d**-0.5), atol=3e-3, rtol=3e-3
    )


@pytest.mark.slow
def test_flashinfer_levels_on_random_batches_exact_and_under_a_capacity() -> None:
    """Random sharing trees, three plans per backend in a row, every shared level the rule admits
    handed to the stand-in FlashInfer (FA3's base-2 states, chunks of whole pages): an exact backend
    and a fixed-capacity one (FlashInfer's CUDA-graph mode, padded), each output against the float64
    reference, whichever levels each plan takes."""
    import flashinfer_stand_in
    from cascade_batches import batches
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    small = batches(max_page_size=4, max_conversations=2, max_samples=3, max_segment_pages=3, max_qo_len=3)

    @settings(max_examples=12, deadline=None)
    @given(data=st.data(), drawn=st.lists(small, min_size=3, max_size=3))
    def check(data: st.DataObject, drawn) -> None:
        hq, hkv = data.draw(st.sampled_from([(2, 1), (4, 2), (4, 4)]), label="heads")
        split = data.draw(st.integers(1, 8), label="min_split_tokens")
        rule = LevelRule(min_rows=1, min_kv_tokens=1, min_work=1, min_split_tokens=split)
        d, planner = 64, CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, max_levels=3)
        plans = [planner.plan(b.block_tables, b.kv_lens, b.qo_lens, b.page_size) for b in drawn]
        capacity = GraphCapacity(
            max_query_tokens=max(max(p.num_query_tokens for p in plans), 1),
            max_pages=max(max(sum(lv.kv_indices.shape[0] for lv in p.levels) for p in plans), 1),
            max_levels=3,
        )
        backends = []
        for cap in (None, capacity):
            backend = TritonBackend(DEVICE, capacity=cap)
            backend._shared_levels = SharedLevelsOnFlashInfer(
                flashinfer_stand_in, torch.device(DEVICE), rule, capacity=cap
            )
            backends.append(backend)
        generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
        for batch, plan in zip(drawn, plans, strict=True):
            if plan.num_query_tokens == 0:
                continue
            q = torch.randn(plan.num_query_tokens, hq, d, generator=generator).half().to(DEVICE)
            kv_cache = torch.randn(batch.num_pages, 2, batch.page_size, hkv, d, generator=generator)
            kv_cache = kv_cache.half().to(DEVICE)
            tables, kv_lens, qo_lens = batch.block_tables, batch.kv_lens, batch.qo_lens
            expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
            for backend in backends:
                if backend.capacity is not None and batch.page_size != plans[0].page_size:
                    continue  # a fixed-capacity backend keeps its page size
                backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16)
                out = torch.full_like(q, float("nan"))
                backend.run(q, kv_cache, out=out)
                torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3)

    check()


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=3),
    branches=st.integers(1, 3),
    queries=st.sampled_from([1, 1, 2, 5, 10]),
    prefills=st.lists(st.integers(2, 80), max_size=3),
)
@example(groups=[(64, 32)], branches=1, queries=1, prefills=[])  # 128 rows: joins
@example(groups=[(64, 33)], branches=1, queries=1, prefills=[])  # 132 rows: does not
@example(groups=[(120, 32)], branches=1, queries=1, prefills=[])  # 8 tiles x 128 pages: the read limit
@example(groups=[(121, 32)], branches=1, queries=1, prefills=[])  # one page over it
@example(groups=[(8, 32), (8, 32)], branches=1, queries=1, prefills=[])  # the second prefix: a wave over
@example(groups=[(8, 4)], branches=1, queries=1, prefills=[64])  # a prefill's wide tile beside it
@example(groups=[(8, 3)] * 8, branches=1, queries=10, prefills=[])  # 64-row tiles: 2 per SM, a wave over
def test_the_cost_model_counts_the_launches_the_backend_makes(
    groups: list[tuple[int, int]], branches: int, queries: int, prefills: list[int]
) -> None:
    """The packaged cost model's launch count is the backend's at its calibrated shape (32/8 heads
    of 128, H200 tiles and SMs): decode groups over prefixes of up to 300 pages of 16 tokens (either
    side of the 2^25-element read limit), each prefix split into ``branches`` branches of 8 pages,
    their requests with ``queries`` new tokens each, beside prefill requests of their own (wider
    unique tiles), plan with as many launches as ``CostModel.features`` counts."""
    pages = iter(range(1 << 20))
    tables, qo_lens = [], []
    for prefix, requests in groups:
        root = [next(pages) for _ in range(prefix)]
        for _branch in range(branches):
            branch = [next(pages) for _ in range(8)]
            tables += [np.array(root + branch + [next(pages)]) for _ in range(requests)]
            qo_lens += [queries] * requests
    for tokens in prefills:
        tables.append(np.array([next(pages) for _ in range(-(-(tokens + 40) // 16))]))
        qo_lens.append(tokens)
    kv_lens = [len(t) * 16 - 5 for t in tables]
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=1, cost_model=None)
    plan = planner.plan(tables, kv_lens, qo_lens, 16)
    backend = TritonBackend(device="cpu")  # CPU tensors: an H200's SM count
    with _tiles_of(interpreter=False):
        backend.plan(plan, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    launches = sum(int(launch.num_work.item()) > 0 for launch in backend._launches)
    assert CostModel.load().features(plan).launches == launches


def test_dependent_merge_only_right_after_the_one_attention_launch(monkeypatch) -> None:
    """With programmatic dependent launch on (forced here: it is off in the interpreter), a run
    launches its merge dependent (``launch_pdl`` with ``WAIT_PRIOR``) only right after the run's one
    attention launch, which lets it start (``LAUNCH_DEPENDENTS``): an exact plan of one launch, a
    fixed plan of key "triton-narrow" or "triton-decode". After two attention launches (an exact
    plan of both tiles, a fixed plan of key "triton") it waits for both as any launch does. Plans
    alternate on one backend, so the launches kept across plans and the run-time choice of the
    merge are checked too. The launches are recorded, not run."""
    from prefix_cache.kernels import _launch
    from prefix_cache.kernels.attention import _attention_kernel
    from prefix_cache.kernels.merge_state import _merge_states_kernel

    launched: list = []
    monkeypatch.setattr(triton_backend, "dependent_launches", lambda device: True)
    monkeypatch.setattr(_launch.BoundKernel, "launch", lambda self, key, args: launched.append(self))
    unshared = [np.arange(20 * i, 20 * i + 20) for i in range(3)]
    decode = CascadePlanner().plan(unshared, [300, 310, 20], [1, 1, 1], 16)
    prefill = CascadePlanner().plan(unshared, [300, 310, 20], [16, 1, 1], 16)
    heads = dict(num_qo_heads=4, num_kv_heads=1, head_dim=16, q_dtype=torch.float32)
    kv_cache = torch.zeros(60, 2, 16, 1, 16, device=DEVICE)
    # 40 decodes sharing 2 pages: the shared level's 160 rows take the wide tile in an exact plan.
    tables = [np.array([0, 1, 2 + i]) for i in range(40)]
    shared = CascadePlanner(min_shared_tokens=16, min_saved_tokens=0).plan(tables, [40] * 40, [1] * 40, 16)
    exact = TritonBackend(DEVICE, kv_chunk_size=64)  # splits: tokens to merge
    fixed = TritonBackend(DEVICE, capacity=GraphCapacity(max_query_tokens=40, max_pages=100))
    runs = [(exact, (decode, shared, decode)), (fixed, (decode, prefill, decode))]
    # The lone decode level's launch (its limits moved to reach it) under a capacity, between plans
    # of two launches: one launch, the merge dependent on it.
    runs.append((fixed, (decode, prefill, decode)))
    for i, (backend, plans) in enumerate(runs):
        if i == 2:
            monkeypatch.setattr(work, "LONE_DECODE_MIN_PROGRAMS", 1)
            monkeypatch.setattr(work, "LONE_DECODE_MAX_ITEM_TOKENS", 1 << 30)
        for plan, attention, dependent in zip(plans, (1, 2, 1), (True, False, True), strict=True):
            backend.plan(plan, **heads)
            assert backend._merges > 0
            if i == 2 and dependent:
                assert backend.graph_key == "triton-decode"
            launched.clear()
            backend.run(torch.zeros(plan.num_query_tokens, 4, 16, device=DEVICE), kv_cache)
            kernels = [launch.kernel for launch in launched]
            assert kernels == [_attention_kernel] * attention + [_merge_states_kernel], backend.graph_key
            merge = launched[-1].constants
            assert merge.get("launch_pdl", False) is merge["WAIT_PRIOR"] is dependent, backend.graph_key
            if dependent:
                assert launched[0].constants["LAUNCH_DEPENDENTS"], backend.graph_key

import dataclasses
import itertools

import numpy as np
import pytest
from cascade_batches import Batch, batches
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache.planner import planner as cascade_planner
from prefix_cache.planner.cost_model import CostModel
from prefix_cache.planner.inputs import check_plan_inputs
from prefix_cache.planner.plan import CascadePlan
from prefix_cache.planner.planner import CascadePlanner, _sort_and_lcp

# Cost models that share anything (to exercise deep plans on small batches) and the default one.
EAGER = [CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, max_levels=m) for m in (1, 2, 3, 5)]
planners = st.sampled_from([*EAGER, CascadePlanner()])


def check_plan(plan: CascadePlan, batch: Batch) -> None:
    """Every structural promise of a plan, against the batch it was made for."""
    ps = batch.page_size
    kv, qo = batch.kv_lens, batch.qo_lens
    n = kv.shape[0]
    assert plan.page_size == ps
    assert plan.request_order.dtype == np.int32 and plan.request_inverse.dtype == np.int32
    assert plan.query_order.dtype == np.int64
    assert sorted(plan.request_order.tolist()) == list(range(n))
    assert (plan.request_inverse[plan.request_order] == np.arange(n)).all()

    # Queries: each request's contiguous in both orders; planned starts from the planned order.
    engine_start = np.cumsum(qo) - qo
    planned_start = np.cumsum(qo[plan.request_order]) - qo[plan.request_order]
    total = int(qo.sum())
    assert sorted(plan.query_order.tolist()) == list(range(total))
    for p, r in enumerate(plan.request_order.tolist()):
        got = plan.query_order[planned_start[p] : planned_start[p] + qo[r]]
        assert (got == engine_start[r] + np.arange(qo[r])).all()
    # Requests without queries come last.
    assert (np.diff((qo[plan.request_order] == 0).astype(int)) >= 0).all()

    assert plan.levels and plan.levels[-1].causal and not any(lv.causal for lv in plan.levels[:-1])
    for level in plan.levels:
        for a in (level.qo_indptr, level.kv_indptr, level.kv_indices, level.kv_last_page_len):
            assert a.dtype == np.int32
        groups = level.kv_last_page_len.shape[0]
        assert level.qo_indptr.shape == level.kv_indptr.shape == (groups + 1,)
        assert level.qo_indptr[0] == 0 and level.qo_indptr[-1] == total
        assert level.kv_indptr[0] == 0 and level.kv_indptr[-1] == level.kv_indices.shape[0]
        assert (np.diff(level.qo_indptr) >= 0).all() and (np.diff(level.kv_indptr) >= 0).all()
        has_pages = np.diff(level.kv_indptr) > 0
        assert (level.kv_last_page_len[~has_pages] == 0).all()
        assert ((level.kv_last_page_len[has_pages] >= 1) & (level.kv_last_page_len[has_pages] <= ps)).all()
        if not level.causal:
            assert (level.kv_last_page_len[has_pages] == ps).all()

    # KV: every request with queries reads each of its tokens exactly once, in order, shared levels
    # only before its new tokens; a shared group's pages are the same slice of each member's table.
    for p, r in enumerate(plan.request_order.tolist()):
        table = batch.block_tables[r][: -(-kv[r] // ps)]
        q0, q1 = planned_start[p], planned_start[p] + qo[r]
        cursor = 0  # pages read so far
        parent = None  # the query range of the group one level up, for nesting
        for level in plan.levels:
            if qo[r] == 0:
                break
            g = int(np.searchsorted(level.qo_indptr, q0, side="right")) - 1
            g0, g1 = level.qo_indptr[g], level.qo_indptr[g + 1]
            assert g0 <= q0 and q1 <= g1, "a request's queries are split between groups"
            pages = level.kv_indices[level.kv_indptr[g] : level.kv_indptr[g + 1]]
            if level.causal:
                assert (pages == table[cursor:]).all() and pages.shape[0] == table.shape[0] - cursor
                assert level.kv_last_page_len[g] == kv[r] - (table.shape[0] - 1) * ps
                assert g1 - g0 == qo[r]
            elif pages.shape[0]:
                assert (pages == table[cursor : cursor + pages.shape[0]]).all()
                cursor += pages.shape[0]
                assert cursor * ps <= kv[r] - qo[r], "a shared segment reaches new tokens"
                if parent is not None:
                    assert parent[0] <= g0 and g1 <= parent[1], "groups do not nest"
                parent = (g0, g1)
        if qo[r] == 0:  # no queries, nothing to read
            last = plan.levels[-1]
            g = int(np.flatnonzero(plan.request_order == r)[0])
            assert last.kv_indptr[g] == last.kv_indptr[g + 1]


@settings(max_examples=300, deadline=None)
@given(batch=batches(), planner=planners)
def test_plan_is_well_formed(batch: Batch, planner: CascadePlanner) -> None:
    plan = planner.plan(batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size)
    check_plan(plan, batch)
    assert len(plan.levels) <= planner.max_levels


def as_2d(batch: Batch, fill: int) -> np.ndarray:
    """The batch's tables as one int32 array, rows padded with ``fill`` past their pages."""
    width = max((len(t) for t in batch.block_tables), default=0) + 2
    table = np.full((len(batch.block_tables), width), fill, dtype=np.int32)
    for row, pages in zip(table, batch.block_tables, strict=True):
        row[: len(pages)] = pages
    return table


def reads(plan: CascadePlan) -> dict[int, list]:
    """Per engine request: its query tokens (engine order), then per level the pages its group reads,
    that group's last page length and its members (engine ids), or None for a group without pages.
    Two plans with equal reads compute the same attention in the same levels, whatever their orders."""
    last = plan.levels[-1]
    order = plan.request_order.tolist()
    found: dict[int, list] = {}
    for p, r in enumerate(order):
        q0, q1 = int(last.qo_indptr[p]), int(last.qo_indptr[p + 1])
        entries: list = [plan.query_order[q0:q1].tolist()]
        for level in plan.levels if q1 > q0 else ():
            g = int(np.searchsorted(level.qo_indptr, q0, side="right")) - 1
            g0, g1 = level.qo_indptr[g], level.qo_indptr[g + 1]
            pages = level.kv_indices[level.kv_indptr[g] : level.kv_indptr[g + 1]].tolist()
            members = frozenset(
                order[i]
                for i in range(len(order))
                if g0 <= last.qo_indptr[i] < g1 and last.qo_indptr[i + 1] > last.qo_indptr[i]
            )
            entries.append((pages, int(level.kv_last_page_len[g]), members) if pages else None)
        found[r] = entries
    return found


def assert_same_plan(got: CascadePlan, want: CascadePlan) -> None:
    """The same levels read by the same groups: request and query orders may differ (requests that
    share all their shareable pages trade places, siblings of the sharing tree may come in another
    order), what each request reads with whom may not."""
    assert len(got.levels) == len(want.levels)
    assert reads(got) == reads(want)


@settings(max_examples=200, deadline=None)
@given(batch=batches(), planner=planners, fill=st.sampled_from([-1, 0, 7]))
def test_a_2d_table_plans_like_its_rows(batch: Batch, planner: CascadePlanner, fill: int) -> None:
    """The 2-D array path (its own gathers and page id checks) against the list of rows, which
    check_plan verifies on its own."""
    want = plan_of(batch, planner)
    assert_same_plan(planner.plan(as_2d(batch, fill), batch.kv_lens, batch.qo_lens, batch.page_size), want)


@pytest.mark.parametrize("groups", [[(40, 8)], [(40, 8), (40, 8)], [(0, 5)], [(3, 1)]])
def test_samples_in_step_plan_like_their_rows(groups: list[tuple[int, int]]) -> None:
    """Requests whose own pages sit in the same columns (samples of one prompt decoding in step) take
    the unique level's one-gather path from a 2-D array; lengths one token apart take the other."""
    batch = decode_batch(groups, unique_pages=3)
    for planner in (CascadePlanner(), CascadePlanner(min_shared_tokens=16, min_saved_tokens=0)):
        want = plan_of(batch, planner)
        assert_same_plan(planner.plan(as_2d(batch, -1), batch.kv_lens, batch.qo_lens, 16), want)
        ragged = Batch(
            batch.block_tables, batch.kv_lens - np.arange(len(batch.kv_lens)) % 2 * 16, batch.qo_lens, 16, 0
        )
        assert_same_plan(
            planner.plan(as_2d(ragged, -1), ragged.kv_lens, ragged.qo_lens, 16),
            plan_of(ragged, planner),
        )


@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_eager_planner_shares_every_shared_page(batch: Batch) -> None:
    """With a free cost model and levels to spare, a page that two requests could share (a whole page
    before the new tokens of both) is never read by their unique levels."""
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, max_levels=10).plan(
        batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size
    )
    check_plan(plan, batch)
    unique = plan.levels[-1]
    shareable = [
        set(table[: (kv - qo) // batch.page_size].tolist()) if qo else set()
        for table, kv, qo in zip(batch.block_tables, batch.kv_lens, batch.qo_lens, strict=True)
    ]
    pages, counts = np.unique([p for s in shareable for p in s], return_counts=True)
    multi = set(pages[counts > 1].tolist())
    for r, p in enumerate(plan.request_inverse.tolist()):
        read = set(unique.kv_indices[unique.kv_indptr[p] : unique.kv_indptr[p + 1]].tolist())
        assert not read & shareable[r] & multi


def decode_batch(groups: list[tuple[int, int]], unique_pages: int = 2, page_size: int = 16) -> Batch:
    """Decode requests; each (shared pages, requests) tuple is a prefix shared by that many requests."""
    tables, next_page = [], 0
    for shared, count in groups:
        prefix = list(range(next_page, next_page + shared))
        next_page += shared
        for _ in range(count):
            tables.append(np.array(prefix + list(range(next_page, next_page + unique_pages)), dtype=np.int32))
            next_page += unique_pages
    kv = np.array([t.shape[0] * page_size - 3 for t in tables])
    return Batch(tables, kv, np.ones(len(tables), dtype=np.int64), page_size, next_page)


def plan_of(batch: Batch, planner: CascadePlanner | None = None) -> CascadePlan:
    plan = (planner or CascadePlanner()).plan(
        batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size
    )
    check_plan(plan, batch)
    return plan


# The sharing thresholds alone (the calibrated cost model decides only when none are given).
THRESHOLDS = CascadePlanner(min_shared_tokens=256, min_saved_tokens=7 * 256)


def test_cost_model_shares_long_prefixes_of_many_requests() -> None:
    plan = plan_of(decode_batch([(64, 16)]), THRESHOLDS)  # 1024 tokens x 16 requests
    assert len(plan.levels) == 2
    shared = plan.levels[0]
    assert shared.qo_indptr.tolist() == [0, 16] and shared.kv_indices.tolist() == list(range(64))


@pytest.mark.parametrize(
    "groups",
    [
        [(1, 64)],  # 16 tokens shared by 64 requests: too short to be worth a launch
        [(16, 2)],  # 256 tokens shared by 2 requests: saves 256 token reads, not enough
        [(16, 4), (16, 4)],  # 256 tokens shared by 4, twice: still below the break-even
    ],
)
def test_cost_model_folds_short_or_rarely_shared_prefixes(groups: list[tuple[int, int]]) -> None:
    assert len(plan_of(decode_batch(groups)).levels) == 1


def test_cost_model_break_even() -> None:
    assert len(plan_of(decode_batch([(16, 8)]), THRESHOLDS).levels) == 2  # 256 tokens x 8 requests
    assert len(plan_of(decode_batch([(128, 2)]), THRESHOLDS).levels) == 2  # 2048 tokens x 2 requests


def test_calibrated_cost_model_chooses_the_faster_plan() -> None:
    """Batches measured on the H200 (CUDA-graph times; benchmarks/calibrate_planner.py): a
    4096-token prefix shared by 64 decodes runs 2.7x faster as a cascade; 512 tokens shared by 32
    decodes (256 own each) 1.2x faster as a cascade whose shared level runs in the decodes' launch,
    and so, at page size 1, do 1024 tokens shared by 16; 256 tokens shared by 16 decodes (64 own)
    run 1.1x faster as one level. With no cost model the thresholds share those 256 tokens."""
    assert len(plan_of(decode_batch([(256, 64)], unique_pages=32)).levels) == 2
    assert len(plan_of(decode_batch([(32, 32)], unique_pages=16)).levels) == 2
    assert len(plan_of(decode_batch([(1024, 16)], unique_pages=64, page_size=1)).levels) == 2
    assert len(plan_of(decode_batch([(16, 16)], unique_pages=4)).levels) == 1
    assert len(plan_of(decode_batch([(16, 16)], unique_pages=4), CascadePlanner(cost_model=None)).levels) == 2


def test_a_shared_level_that_joins_the_decode_launch_costs_no_launch() -> None:
    """The packaged model's launch count: 32 decodes sharing a prefix join the decode launch, 33 do
    not (128 rows per group at 32/8 heads), nor do 32 over a prefix whose decode tiles would read
    over 2^25 KV elements (8 tiles of 4 decodes over 2048 tokens, K and V of 8 heads of 128), nor a
    second prefix of 32 decodes past one wave (132 SMs x 4 decode programs over 8 KV heads: 66
    tiles, against 64 + 8 + 8)."""
    model = CostModel.load()
    cases = (([(64, 32)], 1), ([(64, 33)], 2), ([(128, 32)], 1), ([(129, 32)], 2), ([(64, 32)] * 2, 2))
    for groups, launches in cases:
        plan = plan_of(decode_batch(groups), EAGER[1])
        assert len(plan.levels) == 2
        assert model.features(plan).launches == launches, groups


@given(batch=batches(), planner=planners)
@settings(max_examples=60, deadline=None)
def test_one_level_plans_keep_the_engine_order(batch: Batch, planner: CascadePlanner) -> None:
    """A backend may skip the q gather and output scatter of a one-level plan: the planner keeps the
    engine's order there (requests without queries last), so its query_order is the identity."""
    plan = plan_of(batch, planner)
    if len(plan.levels) > 1:
        return
    active = batch.qo_lens > 0
    assert plan.request_order.tolist() == [*np.flatnonzero(active), *np.flatnonzero(~active)]
    assert plan.query_order.tolist() == list(range(int(batch.qo_lens.sum())))


def test_one_level_plan_of_shared_prefix_keeps_the_engine_order() -> None:
    """A cost model that folds 256 tokens shared by 8 decodes into one level; two such groups
    interleaved (which sorting by table would pull apart), with a request without queries among
    them: the engine's order stands, that request last."""
    first = decode_batch([(16, 8)], unique_pages=16)
    second = decode_batch([(16, 8)], unique_pages=16)
    tables: list[np.ndarray] = []
    for a, b in zip(first.block_tables, second.block_tables, strict=True):
        tables += [a, b + first.num_pages]
    kv = np.repeat(first.kv_lens, 2)
    qo = np.ones(16, dtype=np.int64)
    qo[3] = 0
    batch = Batch(tables, kv, qo, first.page_size, 2 * first.num_pages)
    folds = dataclasses.replace(CostModel.load(), launch_us=1e6, level_us=1e6)
    plan = plan_of(batch, CascadePlanner(cost_model=folds))
    assert len(plan.levels) == 1
    assert plan.request_order.tolist() == [*range(3), *range(4, 16), 3]
    assert plan.query_order.tolist() == list(range(15))
    # Sorted by table, as a two-level plan would be, the groups are contiguous.
    sorted_plan = plan_of(batch, THRESHOLDS)
    assert len(sorted_plan.levels) == 2
    assert sorted_plan.request_order.tolist()[:8] == list(range(0, 16, 2))


def test_nested_sharing_makes_nested_levels() -> None:
    # A 512-token system prompt shared by 32 requests; 4 conversations of 1024 more tokens, 8 samples each.
    tables, page = [], 1000
    for c in range(4):
        for _ in range(8):
            tables.append(np.r_[np.arange(32), 100 + 64 * c + np.arange(64), np.arange(page, page + 3)])
            page += 3
    batch = Batch(tables, np.array([t.shape[0] * 16 for t in tables]), np.ones(32, dtype=np.int64), 16, page)
    plan = plan_of(batch, THRESHOLDS)
    assert len(plan.levels) == 3
    assert plan.levels[0].qo_indptr.tolist() == [0, 32]
    assert plan.levels[1].qo_indptr.tolist() == [0, 8, 16, 24, 32]
    assert np.diff(plan.levels[1].kv_indptr).tolist() == [64] * 4
    # Two levels at most: the deeper nodes fold into the unique level.
    assert (
        len(
            plan_of(
                batch, CascadePlanner(min_shared_tokens=256, min_saved_tokens=7 * 256, max_levels=2)
            ).levels
        )
        == 2
    )
    # A folded system prompt goes to each conversation's segment.
    plan = plan_of(batch, CascadePlanner(min_shared_tokens=1024))
    assert len(plan.levels) == 2 and np.diff(plan.levels[0].kv_indptr).tolist() == [96] * 4


def test_shared_segment_stops_before_new_tokens() -> None:
    # Two prefill chunks over the same 40 pages: one's queries start inside page 30.
    tables = [np.arange(40, dtype=np.int32), np.r_[np.arange(40), np.arange(50, 60)].astype(np.int32)]
    kv, qo = np.array([640, 800]), np.array([160, 5])
    plan = CascadePlanner(min_shared_tokens=16, min_saved_tokens=0).plan(tables, kv, qo, 16)
    check_plan(plan, Batch(tables, kv, qo, 16, 60))
    assert plan.levels[0].kv_indices.tolist() == list(range(30))  # (640 - 160) // 16 whole pages


def test_edge_cases() -> None:
    empty = plan_of(Batch([], np.zeros(0, int), np.zeros(0, int), 16, 0))
    assert (
        len(empty.levels) == 1 and empty.num_query_tokens == 0 and empty.levels[0].qo_indptr.tolist() == [0]
    )
    single = plan_of(Batch([np.arange(10)], np.array([150]), np.array([1]), 16, 10))
    assert len(single.levels) == 1 and single.levels[0].kv_indices.tolist() == list(range(10))
    # kv_len 0 and qo_len 0 requests, identical tables.
    same = [np.arange(40)] * 4
    batch = Batch(
        [*same, np.zeros(0, int)], np.array([640, 640, 640, 0, 0]), np.array([1, 1, 0, 0, 0]), 16, 40
    )
    plan = plan_of(batch, CascadePlanner(min_shared_tokens=16, min_saved_tokens=0))
    assert plan.request_order.tolist()[:2] == [0, 1] and len(plan.levels) == 2
    assert plan.levels[0].kv_indices.tolist() == list(range(39))


NAN = float("nan")


@pytest.mark.parametrize(
    ("tables", "kv", "qo", "page_size", "error", "message"),
    [
        ([[0]], [1], [1], 0, ValueError, "page_size"),
        ([[0]], [1], [1], 2**31, ValueError, "page_size"),
        ([[0]], [1], [1], 16.0, TypeError, "page_size"),
        ([[0]], [1], [1], True, TypeError, "page_size"),
        ([[0]], [-1], [0], 16, ValueError, ">= 0"),
        ([[0]], [1], [-1], 16, ValueError, ">= 0"),
        ([[0]], [1], [2], 16, ValueError, "exceeds"),
        ([[0]], [17], [1], 16, ValueError, "needs 2"),
        ([[0], [1]], [1], [1], 16, ValueError, "one entry per request"),
        ([[0]], [1, 1], [1, 1], 16, ValueError, "one entry per request"),
        ([[-1]], [1], [1], 16, ValueError, "page ids"),
        ([[2**31]], [1], [1], 16, ValueError, "page ids"),
        # The same through a 2-D array (checked as a whole, not row by row).
        (np.array([[0]]), [17], [1], 16, ValueError, "request 0: 1 pages for kv_len 17, needs 2"),
        (np.array([[0, 1], [-1, 5]]), [17, 17], [1, 1], 16, ValueError, r"page ids .* range \[-1, 5\]"),
        (np.array([[2**31, 0]]), [1], [1], 16, ValueError, "page ids"),
        # Nothing is converted: NaN, floats, bools and extra dimensions are refused by name.
        ([np.array([NAN])], [1], [1], 16, TypeError, r"block_tables\[0\]"),
        (np.array([[0.0, NAN]]), [17], [1], 16, TypeError, "block_tables"),
        ([[0.0]], [1], [1], 16, TypeError, r"block_tables\[0\]"),
        ([np.array([True])], [1], [1], 16, TypeError, r"block_tables\[0\].*bool"),
        (np.array([[True]]), [1], [1], 16, TypeError, "block_tables.*bool"),
        ([[0, True]], [17], [1], 16, TypeError, r"block_tables\[0\].*bool"),
        ([np.zeros((1, 2), int)], [17], [1], 16, ValueError, r"block_tables\[0\] must be 1-D"),
        (np.zeros((1, 1, 2), int), [17], [1], 16, ValueError, "block_tables must be 2-D"),
        ([[0]], [1.0], [1], 16, TypeError, "kv_lens"),
        ([[0]], [NAN], [1], 16, TypeError, "kv_lens"),
        ([[0]], np.array([True]), [1], 16, TypeError, "kv_lens.*bool"),
        ([[0], [1]], [1, True], [1, 1], 16, TypeError, "kv_lens.*bool"),
        ([[0]], [[1]], [1], 16, ValueError, "kv_lens must be 1-D"),
        ([[0]], 1, [1], 16, ValueError, "kv_lens must be 1-D"),
        ([[0]], [2**70], [1], 16, ValueError, "kv_lens.*out of range"),
        ([[0]], [1], [0.5], 16, TypeError, "qo_lens"),  # would plan the request without its query
        ([[0]], [1], [True], 16, TypeError, "qo_lens.*bool"),
        ([[0]], [1], [[1]], 16, ValueError, "qo_lens must be 1-D"),
        ([[0, 1]], [2**31], [2**31], 2**30, ValueError, "qo_lens must sum"),
    ],
)
def test_invalid_input(tables: list, kv: list, qo: list, page_size: int, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CascadePlanner().plan(tables, kv, qo, page_size)


def test_entries_past_the_used_pages_are_not_checked() -> None:
    """Rows of a 2-D table padded past a request's pages (with -1, or anything) plan like the pages."""
    clean = [np.arange(40), np.arange(20)]
    padded = np.full((2, 48), -1, dtype=np.int64)
    padded[0, :40], padded[1, :20] = clean
    padded[1, 30] = 2**40
    planner = CascadePlanner(min_shared_tokens=16, min_saved_tokens=0)
    want = planner.plan(clean, [640, 320], [1, 1], 16)
    got = planner.plan(padded, [640, 320], [1, 1], 16)
    assert len(got.levels) == len(want.levels) == 2
    for a, b in zip(got.levels, want.levels, strict=True):
        assert a.kv_indices.tolist() == b.kv_indices.tolist() and a.qo_indptr.tolist() == b.qo_indptr.tolist()


@pytest.mark.parametrize("container", ["2-D int32", "rows int32", "2-D int64"])
@pytest.mark.parametrize(
    ("requests", "column", "raises"),
    [
        ([0, 1, 2], 5, True),  # in the prefix shared by requests 0-2 (a shared level)
        ([0], 5, True),  # a page request 0 no longer shares (the unique level)
        ([1], 70, True),  # past the shared prefix
        ([2], 99, True),  # the last page, holding the query
        ([3], 5, True),  # a request without queries: read by no level, checked all the same
        ([1], 100, False),  # past request 1's 100 pages: not checked
        ([3], 60, False),  # past request 3's 50 pages
    ],
)
def test_negative_page_ids_raise_wherever_they_are_used(
    container: str, requests: list[int], column: int, raises: bool
) -> None:
    """int32 page ids are range-checked where the planner reads them (no pass of their own): a
    negative used id raises wherever it sits, one past a request's pages does not."""
    tables = np.arange(4 * 104, dtype=np.int32).reshape(4, 104)
    tables[:3, :64] = np.arange(64)  # requests 0-2 share 64 pages
    tables[requests, column] = -7
    kv, qo = [100 * 16, 100 * 16, 100 * 16, 50 * 16], [1, 1, 1, 0]
    pages = {"2-D int32": tables, "rows int32": list(tables), "2-D int64": tables.astype(np.int64)}[container]
    for planner in (CascadePlanner(), CascadePlanner(min_shared_tokens=16, min_saved_tokens=0)):
        if raises:
            with pytest.raises(ValueError, match=r"page ids must be in \[0, 2\*\*31\), got range \[-7, "):
                planner.plan(pages, kv, qo, 16)
        else:
            plan = planner.plan(pages, kv, qo, 16)
            assert all((level.kv_indices >= 0).all() for level in plan.levels)


def test_integer_inputs_of_any_width_and_container_plan_alike() -> None:
    tables = np.array([np.arange(40), np.arange(40)])
    reference = CascadePlanner(min_shared_tokens=16, min_saved_tokens=0).plan(tables, [640, 640], [1, 1], 16)
    for t, kv, qo, ps in [
        (tables.astype(np.uint16), np.array([640, 640], np.uint32), np.array([1, 1], np.int8), np.int64(16)),
        ([row.tolist() for row in tables], (640, 640), (1, 1), 16),
        (list(tables.astype(np.int64)), np.array([640, 640]), [1, 1], 16),
    ]:
        plan = CascadePlanner(min_shared_tokens=16, min_saved_tokens=0).plan(t, kv, qo, ps)
        assert plan.page_size == 16 and type(plan.page_size) is int
        assert len(plan.levels) == len(reference.levels) == 2
        for got, want in zip(plan.levels, reference.levels, strict=True):
            assert got.kv_indices.dtype == np.int32
            assert got.kv_indices.tolist() == want.kv_indices.tolist()
            assert got.qo_indptr.tolist() == want.qo_indptr.tolist()


def test_invalid_cost_model() -> None:
    for bad in ({"min_shared_tokens": 0}, {"min_saved_tokens": -1}, {"max_levels": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CascadePlanner(**bad)
    # Not integers: a NaN threshold would turn sharing off in silence, a fraction or a bool is no count.
    for bad in (
        {"max_levels": 1.5},
        {"max_levels": True},
        {"min_shared_tokens": 2.5},
        {"min_saved_tokens": float("nan")},
        {"min_saved_tokens": "7"},
    ):
        with pytest.raises(TypeError, match=f"{next(iter(bad))} must be an int"):
            CascadePlanner(**bad)
    planner = CascadePlanner(
        min_shared_tokens=np.int64(16), min_saved_tokens=np.int32(0), max_levels=np.int64(2)
    )
    assert (type(planner.min_shared_tokens), type(planner.max_levels)) == (int, int)


def test_plans_a_large_batch_as_its_sharing_tree() -> None:
    # 256 requests x 2000 pages of 16 tokens: a system prompt, 16 conversations of 16 samples.
    # (How fast: benchmarks/bench_planner.py plans exactly this batch.)
    tables = np.empty((256, 2000), dtype=np.int32)
    tables[:, :1000] = np.arange(1000)
    tables[:, 1000:1500] = 1000 + 500 * (np.arange(256)[:, None] // 16) + np.arange(500)
    tables[:, 1500:] = 10_000 + 500 * np.arange(256)[:, None] + np.arange(500)
    kv, qo = np.full(256, 2000 * 16 - 5), np.ones(256, dtype=np.int64)
    plan = CascadePlanner().plan(tables, kv, qo, 16)
    system, conversation, own = plan.levels
    np.testing.assert_array_equal(system.qo_indptr, [0, 256])
    np.testing.assert_array_equal(system.kv_indices, np.arange(1000))
    np.testing.assert_array_equal(conversation.qo_indptr, np.arange(0, 257, 16))
    np.testing.assert_array_equal(conversation.kv_indptr, np.arange(0, 16 * 500 + 1, 500))
    np.testing.assert_array_equal(own.kv_indptr, np.arange(0, 256 * 500 + 1, 500))
    np.testing.assert_array_equal(own.kv_last_page_len, np.full(256, 11))
    order = plan.request_order
    np.testing.assert_array_equal(conversation.kv_indices[:500], tables[order[0], 1000:1500])
    np.testing.assert_array_equal(own.kv_indices, tables[order, 1500:].ravel())


def _sorted_by_bytes_and_lcp(
    pages: list | np.ndarray, share: np.ndarray, active: np.ndarray, whole: bool
) -> tuple[list, list]:
    """The definition: requests with queries in the order (stable) of the bytes of their rows, then the
    others; neighbours' common prefixes counted page by page. Rows: with ``whole``, the tables' rows
    as they are, unless two neighbours in their order with different shareable counts agree past the
    smaller count or nothing is shareable; else key rows, the first width + 1 int32 page ids (zeros
    past a list row's end) with a -1 after the shareable pages."""
    width = int(share[active].max(initial=0))
    active_ids = np.flatnonzero(active).tolist()

    def key(i: int) -> bytes:
        row = np.zeros(width + 1, dtype=np.int32)
        n = min(width + 1, len(pages[i]))
        row[:n] = pages[i][:n]
        row[share[i]] = -1
        return row.tobytes()

    def agree(a: int, b: int) -> int:
        n = 0
        while n < min(len(pages[a]), len(pages[b])) and pages[a][n] == pages[b][n]:
            n += 1
        return n

    ids = sorted(active_ids, key=key)
    if whole and width > 0:  # nothing shareable: the engine's order
        raw = sorted(active_ids, key=lambda i: np.asarray(pages[i], dtype=np.int32).tobytes())
        pairs = list(itertools.pairwise(raw))
        if not any(share[a] != share[b] and agree(a, b) > min(share[a], share[b]) for a, b in pairs):
            ids = raw
    lcp = [min(agree(a, b), share[a], share[b]) for a, b in itertools.pairwise(ids)]
    return ids + np.flatnonzero(~active).tolist(), lcp


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_sort_and_lcp_match_their_definition(data: st.DataObject) -> None:
    """Sorting rows as bytes and comparing sorted neighbours a block at a time gives the order of the
    definition and the page-by-page common prefixes, for whole rows (with and without the fall back
    to key rows), key rows of a 2-D array and of a list, whatever the entries after a request's
    shareable pages hold; the requests holding a prefix are contiguous."""
    n = data.draw(st.integers(1, 150))
    width = data.draw(st.integers(1, 6))
    # Few distinct ids (many shared prefixes, and rows agreeing past their shareable pages), some
    # spanning several bytes, some with 0xff bytes like the -1 after the shareable pages.
    values = data.draw(
        st.lists(st.sampled_from([0, 1, 255, 256, 65535, 65537, 2**24, 2**31 - 1]), min_size=2, max_size=3)
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tables = np.array(values, dtype=np.int32)[rng.integers(0, len(values), size=(n, width + 1))]
    active = rng.random(n) < 0.9
    share = np.where(active, rng.integers(0, width + 1, size=n), 0)
    rows = [row[: s + 1] for row, s in zip(tables, share, strict=True)]
    for pages, whole in ((tables, tables), (tables, None), (rows, None)):
        want_order, want_lcp = _sorted_by_bytes_and_lcp(pages, share, active, whole is not None)
        order, lcp = _sort_and_lcp(pages, share, active, whole)
        assert order.tolist() == want_order
        assert lcp.tolist() == want_lcp
        # What the planner needs of the order, told without it: the requests whose shareable pages
        # start with the same k pages sit in one run.
        planned = order.tolist()
        for k in range(1, width + 1):
            for prefix in {tables[i, :k].tobytes() for i in planned if share[i] >= k}:
                run = [
                    p for p, i in enumerate(planned) if share[i] >= k and tables[i, :k].tobytes() == prefix
                ]
                assert run == list(range(run[0], run[-1] + 1))


def test_sort_and_lcp_part_equal_pages_at_the_shareable_count() -> None:
    """All-zero tables (page 0 in every entry) part where each request's shareable pages end: whole
    rows tie, so key rows decide, and an extension sorts before its prefix, at any count."""
    tables = np.zeros((3, 301), dtype=np.int32)
    share = np.array([1, 300, 256])
    for whole in (None, tables):
        order, lcp = _sort_and_lcp(tables, share, np.ones(3, dtype=bool), whole)
        assert order.tolist() == [1, 2, 0] and lcp.tolist() == [256, 1]


def test_a_page_one_request_writes_while_others_read_it_does_not_part_them() -> None:
    """Requests 0 and 2 share pages 1 and 2; request 1 shares page 1 and writes its new tokens into
    page 2 (a batch no engine should send: the attention of 0 and 2 reads what 1 overwrites). Its
    whole row sorts between theirs, so the planner falls back to key rows, and 0 and 2 still read
    page 2 in one group, as they do from a list of rows."""
    tables = np.array([[1, 2, 3], [1, 2, 5], [1, 2, 7]], dtype=np.int32)
    kv, qo = np.array([3, 3, 3]), np.array([1, 2, 1])
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0)
    batch = Batch(list(tables), kv, qo, 1, 8)
    plan = planner.plan(tables, kv, qo, 1)
    check_plan(plan, batch)
    assert [level.kv_indices.tolist() for level in plan.levels[:-1]] == [[1], [2]]
    assert reads(plan)[0][2] == ([2], 1, frozenset({0, 2}))
    assert_same_plan(plan, plan_of(batch, planner))


def test_largest_values_in_range_are_accepted() -> None:
    """The upper ends of the documented ranges: page size 2**31 - 1, page id 2**31 - 1 (each
    container), query tokens summing to 2**31 - 1."""
    assert CascadePlanner().plan([[0]], [1], [1], 2**31 - 1).page_size == 2**31 - 1
    top = 2**31 - 1
    for tables in ([[top]], [np.array([top])], np.array([[top]], np.int64), np.array([[top]], np.int32)):
        plan = CascadePlanner().plan(tables, [1], [1], 16)
        assert plan.levels[-1].kv_indices.tolist() == [top]
    kv, qo, _, _, _ = check_plan_inputs([[0, 1]], [top], [top], 2**30)  # no plan: 2**31 query tokens
    assert kv.tolist() == qo.tolist() == [top]


@pytest.mark.parametrize("container", ["2-D int32", "rows int32"])
@pytest.mark.parametrize(
    ("request_", "column"),
    [
        (0, 5),  # a shared page
        (1, 99),  # the last page, holding the query
        (3, 49),  # the last page of a request without queries
    ],
)
def test_page_id_minus_one_raises_wherever_it_is_used(container: str, request_: int, column: int) -> None:
    """-1 (the usual padding value) in a used entry of int32 tables raises like any negative id,
    the last used page of a request without queries included."""
    tables = np.arange(4 * 104, dtype=np.int32).reshape(4, 104)
    tables[:3, :64] = np.arange(64)
    tables[request_, column] = -1
    pages = tables if container == "2-D int32" else list(tables)
    kv, qo = [100 * 16, 100 * 16, 100 * 16, 50 * 16], [1, 1, 1, 0]
    for planner in (CascadePlanner(), CascadePlanner(min_shared_tokens=16, min_saved_tokens=0)):
        with pytest.raises(ValueError, match=r"page ids must be in \[0, 2\*\*31\), got range \[-1, "):
            planner.plan(pages, kv, qo, 16)


# ----------------------------------------------------------------------------------------------
# cascade_planner.py


def test_min_saved_tokens_counts_the_reads_saved() -> None:
    """A node saves (q - 1)·L token reads: 256 tokens shared by 7 requests save 1536 < 7·256."""
    assert len(plan_of(decode_batch([(16, 7)]), THRESHOLDS).levels) == 1
    assert len(plan_of(decode_batch([(16, 8)]), THRESHOLDS).levels) == 2
    # Exactly min_saved_tokens saved is enough: 2 requests sharing 512 tokens save 512.
    assert len(plan_of(decode_batch([(32, 2)]), CascadePlanner(min_saved_tokens=512)).levels) == 2
    assert len(plan_of(decode_batch([(32, 2)]), CascadePlanner(min_saved_tokens=513)).levels) == 1


def test_one_explicit_threshold_decides_without_the_cost_model() -> None:
    """The cost model decides only when both thresholds are None: 256 tokens shared by 16 decodes,
    which it folds into one level (test_calibrated_cost_model_chooses_the_faster_plan), get a shared
    level as soon as either threshold is given."""
    batch = decode_batch([(16, 16)], unique_pages=4)
    assert len(plan_of(batch).levels) == 1
    assert len(plan_of(batch, CascadePlanner(min_saved_tokens=7 * 256)).levels) == 2
    assert len(plan_of(batch, CascadePlanner(min_shared_tokens=256)).levels) == 2


@settings(max_examples=150, deadline=None)
@given(
    batch=batches(),
    rule=st.fixed_dictionaries({
        "group_size": st.integers(1, 4), "min_rows": st.just(16), "max_rows": st.sampled_from([32, 64, 128]),
        "join_rows": st.integers(0, 48), "join_tile_tokens": st.integers(0, 300),
        "sms_per_kv_head": st.floats(0.5, 12),
    }),
)  # fmt: skip
def test_cost_model_compares_the_features_of_both_plans(batch: Batch, rule: dict) -> None:
    """What the cost model is asked about: the candidates' cascade, then the one-level plan, each
    with the features ``CostModel.features`` reads off the plan itself (requests without queries
    included in the batch, not in the features; shared levels in or out of the decode launch).
    These batches are too small for the one-level plan's floor to rule it out unasked;
    tests/test_calibration.py covers that skip."""
    seen: list = []

    class Recording(CostModel):
        def time_us(self, features):
            seen.append(features)
            return super().time_us(features)

    steps = (64,) * ((rule["max_rows"] // rule["min_rows"]).bit_length() - 1) + (128,)  # one per tile
    coefficients = {"merge_us": 1.0, "step_us": 1.0, "item_us": 1.0, "kv_tile_tokens": steps}
    model = Recording(1.0, 1.0, 1.0, 1.0, 1.0, **rule, **coefficients)
    with pytest.MonkeyPatch.context() as mp:  # candidates at any size, so that small batches have some
        mp.setattr(cascade_planner, "_MIN_SHARED_TOKENS", 1)
        mp.setattr(cascade_planner, "_MIN_SAVED_TOKENS", 0)
        plan_of(batch, CascadePlanner(cost_model=model))
    args = (batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size)
    cascade = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, cost_model=None).plan(*args)
    if len(cascade.levels) == 1:
        assert seen == []  # no candidate: nothing to compare
        return
    flat = CascadePlanner(max_levels=1, cost_model=None).plan(*args)
    assert seen == [model.features(cascade), model.features(flat)]


def test_a_2d_table_with_equal_lengths_and_shared_segments_of_different_depths() -> None:
    """Every request reads the same number of pages but their shared segments end at different
    depths: the unique level cannot take the one-gather path."""
    tables = np.array([[0, 1, 2, 3, 10], [0, 1, 2, 3, 11], [0, 5, 6, 7, 12]], dtype=np.int32)
    batch = Batch(list(tables), np.array([80, 80, 80]), np.ones(3, dtype=np.int64), 16, 13)
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0)
    plan = planner.plan(tables, batch.kv_lens, batch.qo_lens, 16)
    check_plan(plan, batch)
    assert_same_plan(plan, plan_of(batch, planner))


@pytest.mark.parametrize("position", [63, 64, 65, 127, 128])
def test_sort_and_lcp_at_a_block_boundary(position: int) -> None:
    """A row that differs from the others in its first page, sorted to each side of the 64-row
    blocks that neighbours are compared in, shares nothing with its neighbours."""
    n = position + 1
    tables = np.zeros((n, 4), dtype=np.int32)
    tables[position] = 1  # sorts last (bytes 01 00 00 00 after 00 00 00 00)
    for whole in (None, tables):
        order, lcp = _sort_and_lcp(tables, np.full(n, 3), np.ones(n, dtype=bool), whole)
        assert order.tolist()[-1] == position
        assert lcp.tolist() == [3] * (n - 2) + [0]
    # The same through the planner: the odd request reads its pages in its own group.
    kv, qo = np.full(n, 4 * 16), np.ones(n, dtype=np.int64)
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(tables, kv, qo, 16)
    check_plan(plan, Batch(list(tables), kv, qo, 16, 2))

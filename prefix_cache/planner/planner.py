"""The cascade planner: finds the page prefixes a batch's requests share and lays them out as levels.

Requests are sorted by their page tables, so that requests sharing a prefix are neighbours; the longest
common prefixes of neighbours give the sharing tree (every branching point of the trie over page ids)
in O(total pages · log batch). A cost model walks the tree top-down and keeps the nodes worth a shared
call; each kept node becomes a group at the level of its depth among kept nodes, and whatever a
request has left after its deepest kept node goes to the last, causal level.

Pass page tables as numpy arrays, best one C-contiguous int32 array (sorted without a copy): 256
requests × 2000 pages plan in about 0.51 ms from one (0.60 ms when their lengths differ) and 1.1 ms
from a list of rows on a shared 2-core Xeon (benchmarks/bench_planner.py); lists of Python ints
cost a conversion and a type check of every page id (about 21 ms).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from prefix_cache.planner.cost_model import CostModel, LevelShape, PlanFeatures, default_cost_model
from prefix_cache.planner.inputs import Pages, check_plan_inputs, check_read_page_ids, check_setting
from prefix_cache.planner.plan import CascadeLevel, CascadePlan

_I32 = np.int32
# Candidate thresholds when none are given (see CascadePlanner).
_MIN_SHARED_TOKENS = 256
_MIN_SAVED_TOKENS = 7 * 256


@functools.cache
def _packaged_cost_model() -> CostModel:
    return default_cost_model()


class _Node(NamedTuple):
    """A kept shared node: planned positions ``lo:hi`` read pages ``start:end`` of their tables."""

    level: int
    lo: int
    hi: int
    start: int
    end: int


@dataclass(frozen=True)
class CascadePlanner:
    """Turns a batch's page tables into a ``CascadePlan``.

    Which shared nodes get a level of their own: a shared node whose segment holds L tokens and is
    read by q requests saves (q - 1)·L tokens of reads, and costs a launch plus a merge of the batch's
    states whatever L is. A node is a candidate when both hold:

    min_shared_tokens: L >= this (None: 256). Short segments are cheaper to read again than to merge.
    min_saved_tokens: (q - 1)·L >= this (None: 7·256, the break-even of a 256-token prefix shared by
        8 requests, the corner vLLM's cascade heuristic uses; it also lets 2 requests share a long
        conversation).
    max_levels: at most this many levels in all, the unique level included (1 disables sharing).
        Nodes are kept top-down, so when the budget runs out the deepest nodes are folded.
    cost_model: when both thresholds are left at None, the calibrated ``CostModel`` then compares the
        cascade of the candidates with one level (every request over its whole table) and keeps the
        faster; explicit thresholds (tests, tuning) decide alone. None: thresholds only.

    A node that is not kept is folded: its pages go to its kept descendants' segments, or to the
    unique level.
    """

    min_shared_tokens: int | None = None
    min_saved_tokens: int | None = None
    max_levels: int = 4
    cost_model: CostModel | None = field(default_factory=lambda: _packaged_cost_model())

    def __post_init__(self) -> None:
        for name, low in (("min_shared_tokens", 1), ("min_saved_tokens", 0), ("max_levels", 1)):
            value = getattr(self, name)
            if value is not None or name == "max_levels":
                object.__setattr__(self, name, check_setting(name, value, low))

    def plan(
        self,
        block_tables: np.ndarray | Sequence[Sequence[int] | np.ndarray],
        kv_lens: Sequence[int] | np.ndarray,
        qo_lens: Sequence[int] | np.ndarray,
        page_size: int,
    ) -> CascadePlan:
        """Plan one batch.

        block_tables: per request, its page ids (a 2-D int array, or a sequence of 1-D ones); request i
            uses the first ceil(kv_lens[i] / page_size) entries, later ones are ignored.
        kv_lens: per request, its KV length in tokens, its new tokens included.
        qo_lens: per request, its number of query tokens (its last qo_lens[i] KV tokens); 0 allowed.
        page_size: tokens per page.

        Requests without queries take no part: they sit last in planned order with no KV anywhere.
        A shared segment never reaches a request's new tokens: a node is capped at the whole pages
        before the first new token of every member.

        Nothing is converted that is not an integer already: page ids or lengths that are floats (NaN
        included) or bools raise TypeError, and a wrong shape or a value out of range raises
        ValueError, each naming the argument.
        """
        kv, qo, pages, page_size, unchecked = check_plan_inputs(block_tables, kv_lens, qo_lens, page_size)
        batch = kv.shape[0]
        active = qo > 0
        # Whole pages of KV computed before this step: the most a request can share.
        shareable = (kv - qo) // page_size * active

        order, lcp = _sort_and_lcp(pages, shareable, active, _whole_rows(block_tables, pages))
        min_shared = _MIN_SHARED_TOKENS if self.min_shared_tokens is None else self.min_shared_tokens
        min_saved = _MIN_SAVED_TOKENS if self.min_saved_tokens is None else self.min_saved_tokens
        lcp_bytes = lcp.astype(np.int64, copy=False).tobytes()
        nodes, shared_end = _sharing(lcp_bytes, batch, page_size, min_shared, min_saved, self.max_levels)

        qo_planned, kv_planned = qo[order], kv[order]
        qo_indptr = np.zeros(batch + 1, dtype=np.int64)
        qo_planned.cumsum(out=qo_indptr[1:])
        qo_at = qo_indptr.tolist()

        # Each shared level's groups (_level_groups), laid out once for the cost model and the level.
        level_groups = [_level_groups(level, qo_at) for level in _by_level(nodes)]
        # Per planned request, its KV tokens after its deepest shared segment (0 without queries).
        own = (kv_planned - shared_end * page_size) * (qo_planned > 0)
        if nodes and self._cost_model_decides():
            model = self.cost_model
            # Both plans read the same pages: each page of a shared prefix once (the LCPs are the
            # pages that sorted neighbours share).
            kv_read = int(kv @ active)
            distinct = float(kv_read - page_size * int(lcp.sum()))
            cascade = _cascade_features(model, level_groups, qo_planned, own, page_size, distinct)
            cascade_us = model.time_us(cascade)
            pairs = float(qo @ kv)
            # The one-level plan's schedule (costly to replay on the host) only where a floor of its
            # time does not exceed the cascade's already: the same choice, in far less time, for
            # long prefixes.
            requests = int(np.count_nonzero(active))
            if model.one_level_floor_us(distinct, pairs, kv_read, requests) <= cascade_us:
                # The one-level plan's groups: requests without queries hold no KV there.
                one = model.schedule([(qo, kv if active.all() else kv * active, True)])
                flat = PlanFeatures(1, one[0], one[1], distinct, pairs, one[2], one[3])
                if model.time_us(flat) <= cascade_us:
                    nodes, level_groups, shared_end = (), [], np.zeros(batch, dtype=np.int64)
        if not nodes:
            # One level: nothing to group, so keep the engine's order (requests without queries last,
            # holding no query tokens): query_order is then the identity and a backend needs no
            # permutation of q or the output.
            order = np.concatenate([np.flatnonzero(active), np.flatnonzero(~active)])
            qo_planned = qo[order]
            qo_planned.cumsum(out=qo_indptr[1:])
            own = kv[order] * (qo_planned > 0)

        rows = order.tolist() if nodes else []
        levels = [_shared_level(groups, pages, rows, page_size) for groups in level_groups]
        levels.append(_unique_level(pages, order, own, qo_indptr, shared_end, page_size))
        if unchecked:
            check_read_page_ids(pages, -(-kv // page_size), active, levels)

        inverse = np.empty(batch, dtype=_I32)
        inverse[order] = np.arange(batch, dtype=_I32)
        return CascadePlan(
            levels=tuple(levels),
            request_order=order.astype(_I32),
            request_inverse=inverse,
            query_order=_query_order(qo, order, qo_indptr),
            page_size=page_size,
        )

    def _cost_model_decides(self) -> bool:
        return (
            self.cost_model is not None and self.min_shared_tokens is None and self.min_saved_tokens is None
        )


@functools.lru_cache(maxsize=64)
def _sharing(
    lcp_bytes: bytes, batch: int, page_size: int, min_shared: int, min_saved: int, max_levels: int
) -> tuple[tuple[_Node, ...], np.ndarray]:
    """(kept nodes, shared_end): the sharing-tree nodes of these neighbour LCPs (int64, as bytes) that
    ``_choose`` keeps, and per planned position of a batch of ``batch`` requests the end of its
    deepest kept segment in pages (0 outside them; read-only).

    Remembered: a batch's LCPs stay the same from step to step (where its requests' tables part does
    not move), and walking the tree costs the host an order of magnitude more than the key."""
    nodes = _choose(
        _lcp_intervals(np.frombuffer(lcp_bytes, dtype=np.int64)), page_size, min_shared, min_saved, max_levels
    )
    shared_end = np.zeros(batch, dtype=np.int64)
    for node in nodes:  # pre-order: a deeper node overwrites its ancestors
        shared_end[node.lo : node.hi] = node.end
    shared_end.flags.writeable = False
    return tuple(nodes), shared_end


def _choose(
    intervals: list[tuple[int, int, int]], page_size: int, min_shared: int, min_saved: int, max_levels: int
) -> list[_Node]:
    """Keep the sharing-tree nodes worth a call, top-down (see ``CascadePlanner``). ``intervals`` are
    (pages, lo, hi) in pre-order; a kept node's segment starts where its nearest kept ancestor's
    ends."""
    kept: list[_Node] = []
    path: list[_Node] = []  # kept ancestors of the current node, outermost first
    deepest = max_levels - 1  # shared levels
    for depth, lo, hi in intervals:
        while path and path[-1].hi <= lo:
            path.pop()
        if len(path) >= deepest:
            continue
        start = path[-1].end if path else 0
        tokens = (depth - start) * page_size
        if tokens >= min_shared and (hi - lo - 1) * tokens >= min_saved:
            node = _Node(len(path), lo, hi, start, depth)
            kept.append(node)
            path.append(node)
    return kept


#: Sorted neighbours compared per block of this many rows (see _sort_and_lcp).
_LCP_BLOCK = 64


def _cascade_features(
    model: CostModel,
    level_groups: list[list[tuple[int, _Node | None]]],
    qo_planned: np.ndarray,
    own: np.ndarray,
    page_size: int,
    kv_tokens: float,
) -> PlanFeatures:
    """``model.features`` of the plan with these shared levels (``_level_groups`` of each) and a
    unique level of ``own`` KV tokens per planned request, without building it. ``kv_tokens``: the
    batch's distinct KV tokens."""
    # Each shared level's groups as _shared_level makes them (a group without KV counts in the
    # backend's split choice), summed as Python ints: a numpy call costs more than a dozen of those.
    shapes: list[LevelShape] = []
    shared_pairs = 0
    for groups in level_groups:
        queries, tokens, start = [], [], 0
        for end, node in groups:
            queries.append(end - start)
            tokens.append(0 if node is None else (node.end - node.start) * page_size)
            shared_pairs += queries[-1] * tokens[-1]
            start = end
        shapes.append((queries, tokens, False))
    pairs = float(shared_pairs + own @ qo_planned)
    shapes.append((qo_planned, own, True))
    launches, merge, chain, items = model.schedule(shapes)
    return PlanFeatures(len(level_groups) + 1, launches, merge, kv_tokens, pairs, chain, items)


def _whole_rows(block_tables: object, pages: Pages) -> np.ndarray | None:
    """The page tables as one C-contiguous int32 array whose row i starts with request i's pages (the
    caller's array, or the int32 copy of another dtype), else None."""
    if not isinstance(pages, np.ndarray):
        return None
    if pages.flags.c_contiguous:
        return pages
    if (
        isinstance(block_tables, np.ndarray)
        and block_tables.dtype == _I32
        and block_tables.flags.c_contiguous
    ):
        return block_tables
    return None


def _sort_and_lcp(
    pages: Pages, shareable: np.ndarray, active: np.ndarray, whole_rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcp). order: planned order, requests with queries sorted so that requests sharing a
    prefix are contiguous (the DFS order of the trie), requests without queries last. lcp[i]: pages
    that planned requests i and i+1 (both with queries) share at the start of their shareable pages.

    Rows are ordered by their bytes (int32, native byte order), stably; numpy sorts them as void
    items, comparing bytes (memcmp), and any set of rows that start alike is then contiguous. Which
    rows: ``whole_rows`` (``_whole_rows``) as they are, without a copy, when no two neighbours in
    their order with different shareable counts agree past the smaller count; past its shareable
    pages a request's row holds its pages being written this step (or unused entries), so only a
    page written by one request while another reads it can break that, and a prefix's requests are
    then contiguous. Otherwise key rows: each request's first ``width + 1`` page ids (``width``: the
    most shareable pages of any request; a request with queries has more pages than it can share)
    with a -1, which no page id is, in the column after its shareable pages. Either way the entries
    after a request's shareable pages order the requests that share all of them."""
    inactive = np.flatnonzero(~active)
    width = int(shareable.max(initial=0))
    if active.shape[0] - inactive.shape[0] < 2 or width == 0:
        ids = np.flatnonzero(active)
        return np.concatenate([ids, inactive]), np.zeros(max(ids.size - 1, 0), dtype=np.int64)
    if whole_rows is not None:
        perm = np.argsort(_void_rows(whole_rows), kind="stable")
        if inactive.size:
            perm = perm[active[perm]]
        share = shareable[perm]
        first = _first_differences(whole_rows, perm, width)
        low = np.minimum(share[:-1], share[1:])
        if not ((first > low) & (share[:-1] != share[1:])).any():
            return (np.concatenate([perm, inactive]) if inactive.size else perm), np.minimum(first, low)
    ids = np.flatnonzero(active)
    share = shareable[ids]
    # (One 2 MB temporary at most at 256 x 2000 pages: a larger peak makes the heap shrink and fault
    # in again on every plan, costing more than the sort.) A -1 rather than zeros after the shareable
    # pages: one write per row instead of a slice each (~100 us for 255 short rows of 2000 pages).
    if isinstance(pages, np.ndarray):
        rows = pages[ids, : width + 1]
    else:
        rows = np.zeros((ids.shape[0], width + 1), dtype=_I32)
        flat = rows.reshape(-1)
        for start, i, n in zip(range(0, flat.shape[0], width + 1), ids.tolist(), share.tolist(), strict=True):
            flat[start : start + n] = pages[i][:n]
    rows[np.arange(ids.shape[0]), share] = -1
    perm = np.argsort(_void_rows(rows), kind="stable")
    first = _first_differences(rows, perm, width)
    share = share[perm]
    return np.concatenate([ids[perm], inactive]), np.minimum(first, np.minimum(share[:-1], share[1:]))


def _void_rows(rows: np.ndarray) -> np.ndarray:
    """A C-contiguous 2-D array's rows as void items (compared as byte strings)."""
    return rows.view(np.dtype((np.void, rows.itemsize * rows.shape[1]))).ravel()


def _first_differences(rows: np.ndarray, perm: np.ndarray, width: int) -> np.ndarray:
    """first[i]: the first column below ``width`` where rows ``perm[i]`` and ``perm[i + 1]`` differ,
    ``width`` where they agree on all of those; ``perm`` orders the rows by their bytes.

    A block of sorted rows at a time, so that no sorted copy of every row is made. The rows sorted
    between two rows share the common prefix of those two: a block's first and last rows give
    leading columns that all its rows share, and only the columns after them are compared."""
    starts = np.arange(0, perm.shape[0] - 1, _LCP_BLOCK)
    ends = np.minimum(starts + _LCP_BLOCK, perm.shape[0] - 1)
    outer = rows[perm[starts], : width + 1] != rows[perm[ends], : width + 1]
    outer[:, width] = True
    first = np.empty(perm.shape[0] - 1, dtype=np.int64)
    for lo, shared in zip(starts.tolist(), outer.argmax(axis=1).tolist(), strict=True):
        block = rows[perm[lo : lo + _LCP_BLOCK + 1], shared : width + 1]
        differ = block[1:] != block[:-1]
        differ[:, -1] = True
        first[lo : lo + differ.shape[0]] = differ.argmax(axis=1) + shared
    return first


def _lcp_intervals(lcp: np.ndarray) -> list[tuple[int, int, int]]:
    """The sharing tree from neighbour LCPs: every maximal run lo:hi (hi - lo >= 2) of sorted requests
    that share `pages` > 0 pages, as (pages, lo, hi), in pre-order (ancestors first)."""
    found: list[tuple[int, int, int]] = []
    open_runs: list[tuple[int, int]] = []  # (pages, lo), pages increasing
    # A position whose value equals its left neighbour's opens and closes nothing: visit the others
    # (and the end, a 0 that closes every run).
    padded = np.zeros(lcp.shape[0] + 2, dtype=np.int64)  # a 0 before the first and after the last
    padded[1:-1] = lcp
    values = padded[1:]
    changes = np.flatnonzero(values != padded[:-1])
    for i, value in zip(changes.tolist(), values[changes].tolist(), strict=True):
        lo = i
        while open_runs and open_runs[-1][0] > value:
            pages, lo = open_runs.pop()
            found.append((pages, lo, i + 1))
        if value > 0 and (not open_runs or open_runs[-1][0] < value):
            open_runs.append((value, lo))
    found.sort(key=lambda node: (node[1], -node[2]))
    return found


def _by_level(nodes: Sequence[_Node]) -> list[list[_Node]]:
    """The kept nodes of each shared level. Nodes come in pre-order, so each level's are in planned
    order."""
    by_level: list[list[_Node]] = [[] for _ in range(max((n.level + 1 for n in nodes), default=0))]
    for node in nodes:
        by_level[node.level].append(node)
    return by_level


def _level_groups(nodes: list[_Node], qo_at: list[int]) -> list[tuple[int, _Node | None]]:
    """A shared level's groups, in planned order: (where its queries end, its node), one per node of
    the level and one without a node (no KV) per run of requests between them. ``qo_at``: the
    planned query offsets (``batch + 1``); each group's queries start where the last one's end."""
    groups: list[tuple[int, _Node | None]] = []
    position = 0
    for node in nodes:
        if qo_at[node.lo] > qo_at[position]:
            groups.append((qo_at[node.lo], None))
        groups.append((qo_at[node.hi], node))
        position = node.hi
    if qo_at[-1] > qo_at[position]:
        groups.append((qo_at[-1], None))
    return groups


def _shared_level(
    groups: list[tuple[int, _Node | None]], pages: Pages, rows: list[int], page_size: int
) -> CascadeLevel:
    """The level of these groups (``_level_groups``). ``rows``: the planned order (request per
    position)."""
    two_d = isinstance(pages, np.ndarray)
    # Members share a node's pages by construction; any member's table gives them.
    group_pages = [
        pages[rows[node.lo], node.start : node.end] if two_d else pages[rows[node.lo]][node.start : node.end]
        for _, node in groups
        if node is not None
    ]
    num_pages = [0 if node is None else node.end - node.start for _, node in groups]
    return CascadeLevel(
        qo_indptr=np.array([0, *(end for end, _ in groups)], dtype=_I32),
        kv_indptr=np.array([0, *itertools.accumulate(num_pages)], dtype=_I32),
        kv_indices=_concat(group_pages),
        kv_last_page_len=np.array([page_size if n else 0 for n in num_pages], dtype=_I32),
        causal=False,
    )


def _unique_level(
    pages: Pages,
    order: np.ndarray,
    own: np.ndarray,
    qo_indptr: np.ndarray,
    shared_end: np.ndarray,
    page_size: int,
) -> CascadeLevel:
    """One causal group per request: its pages after its deepest shared segment (none if it has no
    queries). ``own``: per planned request, its KV tokens after that segment; at least one for a
    request with queries (shared segments stop before new tokens), 0 for one without (which sits
    after every shared node, its shared_end 0)."""
    num_pages = -(own // -page_size)
    end = shared_end + num_pages
    first, stop = (int(shared_end[0]), int(end[0])) if end.size else (0, 0)
    if isinstance(pages, np.ndarray) and (shared_end == first).all() and (end == stop).all():
        # Every request reads the same columns (samples of one prompt in step): one 2-D gather.
        ids = pages[order, first:stop].reshape(-1)
    else:
        spans = zip(order.tolist(), shared_end.tolist(), end.tolist(), strict=True)
        # A 2-D array is sliced in one indexing step per request (no row view in between).
        ids = _concat(
            [pages[r, s:e] for r, s, e in spans]
            if isinstance(pages, np.ndarray)
            else [pages[r][s:e] for r, s, e in spans]
        )
    # Tokens in the last page: those after the whole pages before it, 0 without pages.
    last = np.minimum(own - (num_pages - 1) * page_size, own)
    return CascadeLevel(
        qo_indptr=qo_indptr.astype(_I32),
        kv_indptr=_indptr(num_pages),
        kv_indices=ids,
        kv_last_page_len=last.astype(_I32),
        causal=True,
    )


def _query_order(qo: np.ndarray, order: np.ndarray, qo_indptr: np.ndarray) -> np.ndarray:
    """Planned query token t -> engine query token; each request's queries stay contiguous."""
    if qo_indptr[-1] == qo.shape[0] and qo.min(initial=1) == 1:
        return order  # one query per request (decode): the tokens follow the requests
    engine_start = np.cumsum(qo) - qo
    lens = qo[order]
    shift = np.repeat(engine_start[order] - qo_indptr[:-1], lens)
    return np.arange(int(qo_indptr[-1]), dtype=np.int64) + shift


def _indptr(counts: np.ndarray) -> np.ndarray:
    indptr = np.zeros(counts.shape[0] + 1, dtype=_I32)
    np.cumsum(counts, out=indptr[1:])
    return indptr


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(_I32, copy=False) if parts else np.zeros(0, dtype=_I32)

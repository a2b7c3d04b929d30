"""A calibrated estimate of a cascade plan's attention time, for choosing cascade or one level.

The planner knows token counts, not kernels, so the model is linear in what it can count of a plan
(per layer, GPU time of our Triton kernels, an exact plan replayed in a CUDA graph):

    time_us = base_us + launch_us * (launches - 1) + level_us * (levels - 1) + merge_us * merge
              + kv_token_us * kv_tokens + pair_us * pairs + step_us * chain_steps + item_us * work_items

kv_tokens: the batch's KV tokens with every page of a prefix that requests share (before their new
tokens) counted once, the same in both plans of a batch (memory traffic: a page re-read by other
requests' programs comes from L2); pairs: query tokens x KV tokens summed over groups (tensor-core
work, which dominates when many queries share a long prefix); levels - 1: the shared levels; merge:
1 when the backend launches its merge (every cascade, and a one-level plan that splits a request's
KV), else 0; launches: the attention launches, 1 or 2. chain_steps: per launch, the KV steps (one
tile of KV tokens each) of its longest work item plus (waves - 1) x those of its mean item, summed
over launches: small decode steps are latency-bound, each step costing about the same whatever its
tile reads, and a launch past one wave of resident programs waits for a second (benchmarks/NOTES.md,
"what the cost model misses, on batches it never saw"). work_items: programs per
KV head (an M tile over one split of a group's KV), over all launches.

These follow the Triton backend's schedule, replayed here in tokens for the calibrated model shape.
Tiles (``triton_schedule.level_tiles``): a level's own tile holds its largest group's rows (query
tokens x ``group_size``, a power of two from ``min_rows`` to ``max_rows``); a plan runs the
narrowest and the widest of its levels' tiles, each level on the narrower that holds it; and a
shared level joins the narrow launch when it has at most ``join_rows`` rows, its narrow tiles read
at most ``join_tile_tokens`` KV tokens (each of a group's tiles reads the group's KV), and the
launch's tiles still fit one wave (``sms_per_kv_head`` x programs resident per SM: 1 at 128 rows, 2
at 64, 4 below). Splits (``prefix_cache.planner.kv_split``, the backend's ``auto_chunk``): a level whose M
tiles leave resident slots idle cuts its groups' KV into chunks of whole KV steps
(``kv_tile_tokens`` per step, by tile). A lone level of decodes that the backend moves to its own
tile of shorter steps (``lone_decode_tile``: the same work items) is counted on the decode tile,
the steps the model was calibrated on. Tests hold the counts to the backend's.

The numbers are fitted to times measured by ``benchmarks/calibrate_planner.py`` (one model shape:
Llama-3-8B heads, 32 query / 8 KV heads of 128) and kept as data in ``prefix_cache/planner/data/``; rerun it
to calibrate another GPU or shape. The calibration read a bf16 cache; ``for_kv_itemsize`` gives the
model of a cache of other element bytes (an fp8 cache: 1), its memory traffic per KV token scaled.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from prefix_cache.planner.kv_split import MAX_SPLITS, UNSPLIT, best_chunk, min_split_tokens
from prefix_cache.planner.plan import CascadePlan

_DATA = Path(__file__).resolve().parent / "data"
DEFAULT_PATH = _DATA / "cost_model_h200.json"
#: The coefficients, in the order ``time_us`` adds them (µs per unit of each feature).
COEFFICIENTS = (
    "base_us", "launch_us", "level_us", "merge_us", "kv_token_us", "pair_us", "step_us", "item_us",
)  # fmt: skip
#: The backend's schedule at the calibrated shape (see the module docstring).
TILE_RULE = (
    "group_size", "min_rows", "max_rows", "join_rows", "join_tile_tokens", "sms_per_kv_head",
    "kv_tile_tokens",
)  # fmt: skip
#: Levels of at most this many groups are counted in Python ints: one numpy call costs the host as
#: much as a dozen of those (a plan's shared levels have few groups, its unique level one per request).
_FEW = 16


@dataclass(frozen=True)
class PlanFeatures:
    """What the cost model reads off a plan (see the module docstring): levels and launches, merge
    (0 or 1), kv_tokens and pairs in tokens, chain_steps in KV steps, work_items per KV head."""

    levels: int
    launches: int
    merge: int
    kv_tokens: float
    pairs: float
    chain_steps: float
    work_items: int


#: A level as the schedule sees it: per group, its query tokens and its KV tokens (int64 arrays; a
#: level of few groups may come as lists of ints), and whether the level is causal.
LevelShape = tuple[np.ndarray | Sequence[int], np.ndarray | Sequence[int], bool]


@dataclass(frozen=True)
class CostModel:
    """Coefficients in microseconds, and the backend's schedule at the calibrated shape (see the
    module docstring). ``kv_tile_tokens``: KV tokens per step of the tiles of ``min_rows``, 2 x
    ``min_rows``, ... rows. ``source`` says where they came from."""

    base_us: float
    launch_us: float
    level_us: float
    kv_token_us: float
    pair_us: float
    group_size: int
    min_rows: int
    max_rows: int
    join_rows: int
    join_tile_tokens: int
    sms_per_kv_head: float
    merge_us: float = 0.0
    step_us: float = 0.0
    item_us: float = 0.0
    kv_tile_tokens: tuple[int, ...] = (64, 64, 64, 128)
    source: str = ""
    #: Bytes per K or V element of the cache the coefficients describe (the calibration's bf16).
    kv_itemsize: int = 2

    def __post_init__(self) -> None:
        tiles = (self.max_rows // self.min_rows).bit_length()  # min_rows, 2 x min_rows, ..., max_rows
        if len(self.kv_tile_tokens) != tiles:
            raise ValueError(
                f"kv_tile_tokens needs one entry per tile of {self.min_rows} to {self.max_rows} rows "
                f"({tiles}), got {len(self.kv_tile_tokens)}"
            )
        # sms_per_kv_head is SMs / KV heads: as that fraction, slots and programs compare in whole
        # numbers (programs per KV head x denominator against numerator x resident programs per SM),
        # as exactly as the backend counts them over all KV heads.
        ratio = Fraction(self.sms_per_kv_head).limit_denominator(256)
        object.__setattr__(self, "_sm_num", ratio.numerator)
        object.__setattr__(self, "_sm_den", ratio.denominator)

    def for_kv_itemsize(self, itemsize: int) -> CostModel:
        """This model for a cache of ``itemsize`` bytes per K or V element: ``kv_token_us`` (the time
        of reading a KV token) scaled by the bytes, everything else as it is (the kernels' tiles,
        steps and tensor-core work do not change with the KV dtype; an fp8 cache is dequantized to
        q's dtype in registers)."""
        if itemsize < 1:
            raise ValueError(f"itemsize must be >= 1, got {itemsize}")
        scaled = self.kv_token_us * itemsize / self.kv_itemsize
        return dataclasses.replace(self, kv_token_us=scaled, kv_itemsize=itemsize)

    def time_us(self, features: PlanFeatures) -> float:
        """Estimated GPU time of a plan with these features, per layer."""
        return (
            self.base_us
            + self.launch_us * (features.launches - 1)
            + self.level_us * (features.levels - 1)
            + self.merge_us * features.merge
            + self.kv_token_us * features.kv_tokens
            + self.pair_us * features.pairs
            + self.step_us * features.chain_steps
            + self.item_us * features.work_items
        )

    def one_level_floor_us(self, kv_tokens: float, pairs: float, kv_read: int, requests: int) -> float:
        """A lower bound of ``time_us`` of a batch's one-level plan, from counts the planner has
        without replaying the schedule: ``kv_tokens`` and ``pairs`` (its features), ``kv_read`` (the
        KV tokens of its requests with queries) and ``requests`` (how many those are). Each such
        request is one work item or more; its launch's items take ``kv_read`` / (KV tokens per step)
        steps or more in all, and chain_steps >= steps / (resident programs), since the longest item
        takes at least the mean and the waves are at least items / slots. ``-inf`` where a
        coefficient that the bound leaves out or scales is negative."""
        if min(self.merge_us, self.step_us, self.item_us) < 0:
            return float("-inf")
        steps = kv_read / max(self.kv_tile_tokens)
        return (
            self.base_us
            + self.kv_token_us * kv_tokens
            + self.pair_us * pairs
            + self.step_us * steps * self._sm_den / self._slots(self.min_rows)  # the most slots
            + self.item_us * requests
        )

    def _tile_rows(self, rows: int) -> int:
        # tile_config's rows (next_pow2, clamped): kernels/ needs torch, the cost model only numpy.
        return max(self.min_rows, min(1 << max(rows - 1, 0).bit_length(), self.max_rows))

    def _slots(self, tile: int) -> int:
        """Resident programs of a tile of ``tile`` rows (``TileConfig.resident_per_sm``) per KV head,
        times ``_sm_den``: compare with programs per KV head times ``_sm_den``."""
        return self._sm_num * (1 if tile >= 128 else 2 if tile >= 64 else 4)

    def _block_n(self, tile: int) -> int:
        return self.kv_tile_tokens[(tile // self.min_rows).bit_length() - 1]

    def schedule(self, levels: Sequence[LevelShape]) -> tuple[int, int, float, int]:
        """(launches, merge, chain_steps, work_items) of a plan with these levels (see the module
        docstring). merge: 1 for a plan of several levels (the planner's shared groups have queries
        and KV, so their tokens have a state per level), and for one level where a group with
        queries has other than one split."""
        g = self.group_size
        few = [_Few(q, kv) if len(q) <= _FEW else _Many(q, kv) for q, kv, _ in levels]
        rows = [level.top * g for level in few]
        own = [self._tile_rows(r) for r in rows]
        narrow, wide = min(own), max(own)
        on = [narrow if r <= narrow else wide for r in rows]
        tile_q = narrow // g
        programs = sum(level.tiles(tile_q) for level, tile in zip(few, on, strict=True) if tile == narrow)
        slots = self._slots(narrow)
        for i, ((_, _, causal), level) in enumerate(zip(levels, few, strict=True)):
            if on[i] == narrow or causal or rows[i] > self.join_rows:
                continue
            t, reads = level.tiles(tile_q), level.reads(tile_q)
            if reads <= self.join_tile_tokens and (programs + t) * self._sm_den <= slots:
                on[i], programs = narrow, programs + t
        chain, items, other, launches = 0.0, 0, False, 0
        # The model's shape has heads of 128 (see the module docstring).
        min_split = min_split_tokens(len(levels), narrow, 128)
        for tile in sorted(set(on)):
            bn, slots = self._block_n(tile), self._slots(tile)
            counts = [
                level.counts(tile // g, bn, slots, self._sm_den, min_split)
                for level, t in zip(few, on, strict=True)
                if t == tile
            ]
            launch_items = sum(c[0] for c in counts)
            if launch_items:
                # Whole waves of resident programs: the first runs the longest item, each later one
                # a mean item (the items run longest first).
                waves = -(-launch_items * self._sm_den // slots)
                chain += max(c[2] for c in counts) + (waves - 1) * sum(c[1] for c in counts) / launch_items
                items += launch_items
                launches += 1  # a tile without items is not launched
            other = other or any(c[3] for c in counts)
        return launches, int(len(levels) > 1 or other), float(chain), int(items)

    def features(self, plan: CascadePlan) -> PlanFeatures:
        """The features of a plan made by the planner (every group's KV tokens and query tokens)."""
        pairs = 0.0
        shapes = []
        for level in plan.levels:
            pages = np.diff(level.kv_indptr.astype(np.int64))
            kv_len = np.where(pages > 0, (pages - 1) * plan.page_size + level.kv_last_page_len, 0)
            q_len = np.diff(level.qo_indptr.astype(np.int64))
            pairs += float((kv_len * q_len).sum())
            shapes.append((q_len, kv_len, level.causal))
        launches, merge, chain, items = self.schedule(shapes)
        return PlanFeatures(len(plan.levels), launches, merge, distinct_kv_tokens(plan), pairs, chain, items)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> CostModel:
        """The model stored at ``path`` (JSON written by benchmarks/calibrate_planner.py)."""
        data = json.loads(Path(path).read_text())
        fields = {k: data[k] for k in (*COEFFICIENTS, *TILE_RULE)}
        fields["kv_tile_tokens"] = tuple(fields["kv_tile_tokens"])
        return cls(**fields, source=str(path))


def default_cost_model() -> CostModel:
    """The packaged calibration (an H200)."""
    return CostModel.load(DEFAULT_PATH)


def distinct_kv_tokens(plan: CascadePlan) -> float:
    """``PlanFeatures.kv_tokens`` of a plan: its requests' KV tokens (those with queries), less the
    pages of shareable prefixes that they share (a request's pages before its first new token), each
    counted once. What the planner counts from its neighbour LCPs; here each request's pages are
    gathered from its groups, level by level (slow: for tests and calibration)."""
    last = plan.levels[-1]  # one group per request, in planned order
    starts = last.qo_indptr[:-1].astype(np.int64)
    q_len = np.diff(last.qo_indptr.astype(np.int64))
    tables: list[list[int]] = [[] for _ in range(q_len.shape[0])]
    kv = np.zeros(q_len.shape[0], dtype=np.int64)
    for level in plan.levels:
        group = np.searchsorted(level.qo_indptr, starts, side="right") - 1
        pages = np.diff(level.kv_indptr.astype(np.int64))
        kv_len = np.where(pages > 0, (pages - 1) * plan.page_size + level.kv_last_page_len, 0)
        for r in np.flatnonzero(q_len > 0).tolist():
            g = int(group[r])
            tables[r] += level.kv_indices[level.kv_indptr[g] : level.kv_indptr[g + 1]].tolist()
            kv[r] += kv_len[g]
    shared = sorted(
        tuple(tables[r][: (int(kv[r]) - int(q_len[r])) // plan.page_size]) for r in np.flatnonzero(q_len > 0)
    )
    common = 0
    for a, b in itertools.pairwise(shared):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        common += n
    return float(kv.sum() - common * plan.page_size)


def _split(kv: int, chunk: int, block_n: int) -> tuple[int, int, int]:
    """(splits, KV steps in all, KV steps of the longest split) of a group of ``kv`` tokens cut into
    chunks of ``chunk`` (``levels_work``: equal splits of whole KV steps, at most MAX_SPLITS)."""
    if kv <= 0:
        return 0, 0, 0
    chunk = min(-(-chunk // block_n) * block_n, UNSPLIT)
    splits = min(-(-kv // chunk), MAX_SPLITS)
    per = -(-kv // splits)
    c = max(-(-per // block_n) * block_n, block_n)
    return splits, kv // c * (c // block_n) - (-(kv % c) // block_n), -(-min(c, kv) // block_n)


class _Few:
    """A level of few groups, counted in Python ints (remembered: a plan's shared levels keep their
    lengths from step to step)."""

    def __init__(self, q: np.ndarray | Sequence[int], kv: np.ndarray | Sequence[int]):
        self.q = tuple(q.tolist() if isinstance(q, np.ndarray) else q)
        self.kv = tuple(kv.tolist() if isinstance(kv, np.ndarray) else kv)
        self.top = _few_top(self.q, self.kv)

    def tiles(self, tile_q: int) -> int:
        """M tiles of the groups with KV."""
        return _few_tiles(self.q, self.kv, tile_q)[0]

    def reads(self, tile_q: int) -> int:
        """KV tokens its M tiles read."""
        return _few_tiles(self.q, self.kv, tile_q)[1]

    def counts(
        self, tile_q: int, block_n: int, slots: int, unit: int, min_split: int
    ) -> tuple[int, int, int, bool]:
        """(items, KV steps of all items, KV steps of the longest, whether a group with queries has
        other than one split) on a tile of ``tile_q`` query tokens, where a wave holds ``slots`` /
        ``unit`` programs per KV head, splits of at least ``min_split`` KV tokens."""
        return _few_counts(self.q, self.kv, tile_q, block_n, slots, unit, min_split)


@functools.lru_cache(maxsize=256)
def _few_top(q: tuple[int, ...], kv: tuple[int, ...]) -> int:
    """Query tokens of the largest group with KV."""
    return max((a for a, b in zip(q, kv, strict=True) if b > 0), default=0)


@functools.lru_cache(maxsize=256)
def _few_tiles(q: tuple[int, ...], kv: tuple[int, ...], tile_q: int) -> tuple[int, int]:
    """(M tiles of the groups with KV, KV tokens those tiles read) on a tile of ``tile_q`` queries."""
    m = [-(-a // tile_q) for a in q]
    return sum(t for t, b in zip(m, kv, strict=True) if b > 0), sum(t * b for t, b in zip(m, kv, strict=True))


@functools.lru_cache(maxsize=256)
def _few_counts(
    q: tuple[int, ...],
    kv: tuple[int, ...],
    tile_q: int,
    block_n: int,
    slots: int,
    unit: int,
    min_split: int,
) -> tuple[int, int, int, bool]:
    """``_Few.counts``, remembered: a plan's shared levels keep their lengths from step to step."""
    m = [-(-a // tile_q) for a in q]  # every group's M tiles count for the split (auto_chunk)
    chunk = UNSPLIT
    if q and sum(m) * unit < slots:
        kv_len, programs = np.array(kv, dtype=np.int64), np.array(m, dtype=np.int64) * unit
        chunk = best_chunk(kv_len, programs, block_n, slots, MAX_SPLITS, min_split)
    items = steps = longest = 0
    other = False
    for a, b, tiles in zip(q, kv, m, strict=True):
        splits, group_steps, top = _split(b, chunk, block_n)
        if a and splits != 1:
            other = True
        if tiles and splits:
            items, steps, longest = items + tiles * splits, steps + tiles * group_steps, max(longest, top)
    return items, steps, longest, other


class _Many:
    """A level of many groups (a unique level), counted in numpy, in as few calls as it can: at a
    few hundred groups each call's fixed cost, not the data, is what it costs."""

    def __init__(self, q: np.ndarray, kv: np.ndarray):
        self.q, self.kv = q, kv
        self.q_max = int(q.max(initial=0))
        self.with_q = np.count_nonzero(q)
        # KV of the groups with queries (those with programs): all of them in a batch of decodes.
        self.kv_read = kv if self.with_q == q.shape[0] else kv * (q > 0)
        self.top = self.q_max
        if self.q_max > 1:  # the largest group with KV: a level's rows (one query fits any tile)
            self.top = int((q * (kv > 0)).max())

    def _m(self, tile_q: int) -> np.ndarray | None:
        """M tiles per group with KV; None: one per group with queries and KV."""
        return None if self.top <= tile_q else -((self.q * (self.kv > 0)) // -tile_q)

    def tiles(self, tile_q: int) -> int:
        m = self._m(tile_q)
        return np.count_nonzero(self.kv_read) if m is None else int(m.sum())

    def reads(self, tile_q: int) -> int:
        m = self._m(tile_q)
        return int(self.kv_read.sum() if m is None else m @ self.kv)

    def counts(
        self, tile_q: int, block_n: int, slots: int, unit: int, min_split: int
    ) -> tuple[int, int, int, bool]:
        """``_Few.counts``."""
        m = self._m(tile_q)
        items = self.tiles(tile_q)
        # Groups without KV count in the split choice too.
        if items * unit < slots and int((-(self.q // -tile_q)).sum()) * unit < slots:
            active = np.flatnonzero(self.q | self.kv)  # groups with neither change nothing
            return _few_counts(
                tuple(self.q[active].tolist()),
                tuple(self.kv[active].tolist()),
                tile_q,
                block_n,
                slots,
                unit,
                min_split,
            )
        steps = (self.kv_read + (block_n - 1)) // block_n
        # Groups with queries but no KV have no split, and their tokens no state: the merge writes them.
        other = (
            self.q_max > 0 and self.with_q != items
            if m is None
            else bool(((self.q > 0) & (self.kv == 0)).any())
        )
        longest = -(-int(self.kv_read.max(initial=0)) // block_n)
        return items, int(steps.sum() if m is None else steps @ m), longest, other

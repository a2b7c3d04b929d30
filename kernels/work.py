"""Host-side scheduling of the attention kernel: tile shapes and work items (numpy only, no launches).

A level is a list of groups; group g owns query tokens ``qo_indptr[g]:qo_indptr[g+1]`` and KV pages
``kv_indices[kv_indptr[g]:kv_indptr[g+1]]`` (the last one holding ``kv_last_page_len[g]`` tokens).
One work item is one program's job for one KV head: an M tile of (query tokens of one group) x (the
query heads that share that KV head), over one split of the group's KV. ``level_work`` cuts a level
into work items (``levels_work`` all of a plan's levels in one pass); the kernel (``attention.py``)
runs any list of them, from any number of levels, in one launch.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from prefix_cache.kernels._common import cdiv, interpreting, next_pow2

from prefix_cache.planner.kv_split import DECODE_TILE_ROWS, MAX_SPLITS, MIN_SPLIT_TOKENS, UNSPLIT, best_chunk

# Columns of a work item (int32): query tokens [Q0, Q1) of the tile (planned order), the group's
# first entry in kv_indices, KV token range [KV0, KV1) of this split, the split's index, the causal
# diagonal (query token t may see KV positions <= t + DIAG) and the offset of the item's level in the
# o_rows table (token t's partial state goes to row o_rows[OROW + t] + SPLIT; an entry -1 - r instead
# sends the token's only state, its output, to row r of the final output).
Q0, Q1, PAGE0, KV0, KV1, SPLIT, DIAG, OROW = range(8)
WORK_COLS = 8
# levels_work's rows per group: a work item's columns, then these (see there).
_ROW_COLS = WORK_COLS + 7
_TILE_Q, _LEVEL, _NEG_TILE_Q, _BLOCK_N, _NEG_BLOCK_N, _NEG_CHUNK, _FIRST_ITEM = range(WORK_COLS, _ROW_COLS)

#: DIAG of a non-causal item: every KV position is visible to every query.
NO_MASK = 1 << 30


@dataclass(frozen=True)
class TileConfig:
    """Compile-time shape of one launch: M rows per tile, KV tokens per tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def resident_per_sm(self) -> int:
        """Programs of this shape one SM holds at once (registers and shared memory of the sm_90
        builds: 1 at 128 rows, 2 at 64, 4 below). Nominal at head dims over 128: the d256 decode tile
        fits 2 per SM (198 registers x 128 threads on 4 warps); splits and fixed grids were measured
        with these counts, so they stay (benchmarks/NOTES.md, "d256 decode tiles on 8 warps" and
        "32-bit K/V offsets")."""
        return 1 if self.block_m >= 128 else 2 if self.block_m >= 64 else 4


def tile_config(max_rows: int, group_size: int, head_dim: int, page_size: int) -> TileConfig:
    """The tile for a level whose largest group has ``max_rows`` query rows (tokens x group_size),
    over pages of ``page_size`` tokens. tl.dot needs every block dimension >= 16."""
    return _tile_config(next_pow2(max_rows), group_size, head_dim, page_size, interpreting())


def tile_configs(max_rows: Sequence[int], group_size: int, head_dim: int, page_size: int) -> list[TileConfig]:
    """``tile_config`` of each of ``max_rows`` (a plan's levels), looking at the environment once: for
    an unset variable ``os.environ`` raises and catches a KeyError, a cost per call comparable to
    the rest of a remembered lookup."""
    interpreted = interpreting()
    return [_tile_config(next_pow2(rows), group_size, head_dim, page_size, interpreted) for rows in max_rows]


@functools.lru_cache(maxsize=256)
def _tile_config(rows: int, group_size: int, head_dim: int, page_size: int, interpreted: bool) -> TileConfig:
    """``tile_config`` for ``rows`` query rows, a power of two. Remembered: a plan asks for a tile per
    level, and looking one up costs a fraction of making it."""
    block_d = max(16, next_pow2(head_dim))
    floor_m = max(16, next_pow2(group_size))
    if interpreted:
        # The interpreter is slow per operation, not per element; small KV tiles still exercise
        # multi-tile loops in tests at tiny sizes.
        return TileConfig(max(floor_m, min(rows, 64)), 16, 1, 1)
    cap_m = 128 if block_d <= 128 else 64
    block_m = max(floor_m, min(rows, cap_m))
    # Decode tiles (16 rows) over pages of 16+ tokens: two KV stages, not three, so more programs
    # stay resident per SM, which the unique levels of shared batches gain from more than a few
    # small one-level batches lose; pages of 1 token lost with two and keep three. Tiles of 128
    # rows read 128 KV tokens per step in two stages, which helps prefill and long shared prefixes
    # and nothing else changes (benchmarks/NOTES.md, "tile sweep on the H200" and "KV tiles without
    # masks, 128-row tiles over 128 KV tokens"). Head dims over 128 read 32 KV tokens per step,
    # except decode tiles, which read 64: long d256 decodes gain most, while 64 on the wider tiles
    # slowed d256 prefill ("where the losing batches spend their GPU time"). Those d256 decode tiles
    # run 4 warps and their whole KV tiles without masks (``_attention_kernel``): with 32-bit K/V
    # offsets that beat 8 warps on d256 decodes and cascades, though with 64-bit offsets 8 warps had
    # been faster ("32-bit K/V offsets; d256 decode tiles on 4 warps").
    wide = block_m >= 128
    stages = 2 if block_d > 128 or wide or (block_m <= 16 and page_size >= 16) else 3
    return TileConfig(
        block_m=block_m,
        block_n=(128 if wide else 64) if block_d <= 128 or block_m <= 16 else 32,
        num_warps=8 if wide else 4,
        num_stages=stages,
    )


def fixed_tile_configs(group_size: int, head_dim: int, page_size: int) -> tuple[TileConfig, ...]:
    """The tiles of a fixed-launch (CUDA-graph) schedule, narrowest first: the narrow tile fits one
    query token of a group (decode), the wide one is the largest, for groups of many queries, and
    between them, where it differs from both, the tile of half the wide one's rows, for levels whose
    groups fill at most that: on the wide tile, half empty, such levels replayed slower than on
    tiles of their own width (benchmarks/NOTES.md, "a middle tile under a capacity")."""
    narrow, wide = tile_configs([1, 1 << 20], group_size, head_dim, page_size)
    middle = tile_configs([wide.block_m // 2], group_size, head_dim, page_size)[0]
    return tuple(dict.fromkeys((narrow, middle, wide)))


# A plan's only level, on a decode tile (on a GPU two stages of 64 KV tokens; at most
# DECODE_TILE_ROWS rows, head dims up to 128, pages of 16+ tokens, 2+ query heads per KV head),
# whose programs number from LONE_DECODE_MIN_PROGRAMS up to one wave of the device's resident
# programs, each reading at most LONE_DECODE_MAX_ITEM_TOKENS KV tokens, runs on the same rows
# reading 32 KV tokens per step in three stages (``lone_decode_tile``): each program then has 4
# short steps in flight rather than 2 long ones, where nothing else runs beside it. One-level
# decodes that fill one wave with items of up to 128 tokens replayed faster so, at several GQA
# shapes and page sizes. Everything else measured lost and stays on the decode tile: longer items
# (split ones of 192-256 tokens most, unsplit ones of 256-512 about even, long unsplit ones
# clearly), fewer programs than a wave, more than a wave, every cascade, and MHA
# (benchmarks/NOTES.md, "a tile of its own for a lone level of decodes that fills one wave" and
# "the lone decode tile only for items of up to 128 KV tokens").
LONE_DECODE_MIN_PROGRAMS = 512
LONE_DECODE_MAX_ITEM_TOKENS = 128


def lone_decode_tile(tile: TileConfig, group_size: int, head_dim: int, page_size: int) -> TileConfig | None:
    """The tile that replaces decode ``tile`` for a plan's only level when its programs fill about one
    wave (``lone_decode_fits``), or None where the rule does not apply to ``tile`` (see above)."""
    if tile.block_m > DECODE_TILE_ROWS or group_size < 2 or head_dim > 128 or page_size < 16:
        return None
    return TileConfig(tile.block_m, 32, tile.num_warps, 3)


def lone_decode_fits(work: np.ndarray, num_kv_heads: int, tile: TileConfig, sms: int) -> bool:
    """Whether a plan's only level, cut into ``work`` items (``level_work``), runs on
    ``lone_decode_tile``: from LONE_DECODE_MIN_PROGRAMS programs (items x ``num_kv_heads``) up to one
    wave of ``tile``'s resident ones, none reading over LONE_DECODE_MAX_ITEM_TOKENS KV tokens."""
    programs = work.shape[0] * num_kv_heads
    if not LONE_DECODE_MIN_PROGRAMS <= programs <= sms * tile.resident_per_sm():
        return False
    return int((work[:, KV1] - work[:, KV0]).max()) <= LONE_DECODE_MAX_ITEM_TOKENS


@dataclass(frozen=True)
class LevelArrays:
    """A level's index arrays, checked, as int64 numpy arrays (``kv_indices`` in the integer dtype it came
    in, its values in [0, 2**31)); ``q_len`` and ``kv_len`` per group in tokens."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    q_len: np.ndarray
    kv_len: np.ndarray
    max_page: int

    @property
    def num_query_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def max_rows_per_group(self) -> int:
        """Query tokens of the largest group with KV: the most a tile must hold (a group without KV
        runs no program; the planner gathers a level's requests that do not share it into one)."""
        return int(self.q_len[self.kv_len > 0].max(initial=0))


def end_to_end(levels: Sequence[LevelArrays]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(q_len, kv_len, starts): the levels' groups laid end to end (int64), each level closed by one
    group without queries or KV, and where each level starts. A sum or a maximum per level over
    non-negative values is then one ``reduceat`` at ``starts``, whatever the levels hold (a level
    without groups reads its closing group only): numpy's fixed cost per call, not the data, is the
    cost of a plan's few hundred groups."""
    closing = np.zeros(1, dtype=np.int64)
    q_len = np.concatenate([a for level in levels for a in (level.q_len, closing)] or [closing[:0]])
    kv_len = np.concatenate([a for level in levels for a in (level.kv_len, closing)] or [closing[:0]])
    starts = itertools.accumulate((level.q_len.shape[0] + 1 for level in levels), initial=0)
    return q_len, kv_len, list(starts)[:-1]


def _as_int_array(name: str, a: np.ndarray | torch.Tensor, *, widen: bool = True) -> np.ndarray:
    """``a`` as a 1-D integer numpy array: int64 when ``widen``, else in its own dtype (no copy of a
    numpy array: page id lists are large, and their range is checked in place)."""
    arr = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False) if widen or arr.size == 0 else arr


@functools.cache
def _unsigned(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype of ``dtype``'s size and byte order."""
    return np.dtype(dtype.str.replace("i", "u"))


def _page_id_bound(ids: np.ndarray) -> int:
    """One past the largest page id in ``ids`` (non-empty, integer): at most 2**31 when every id is in
    [0, 2**31), more than 2**31 when any is not. Signed ids of 4 or 8 bytes in one pass: read as
    unsigned, a negative id is 2**31 or more."""
    if ids.dtype.kind == "i" and ids.dtype.itemsize >= 4:
        return int(ids.view(_unsigned(ids.dtype)).max()) + 1
    if ids.dtype.kind == "i" and ids.min() < 0:
        return 2**32
    return int(ids.max()) + 1


def check_level(
    qo_indptr: np.ndarray | torch.Tensor,
    kv_indptr: np.ndarray | torch.Tensor,
    kv_indices: np.ndarray | torch.Tensor,
    kv_last_page_len: np.ndarray | torch.Tensor,
    page_size: int,
) -> LevelArrays:
    """Validate a level's index arrays (see the module docstring) and compute its KV lengths."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    qo = _as_int_array("qo_indptr", qo_indptr)
    kvp = _as_int_array("kv_indptr", kv_indptr)
    idx = _as_int_array("kv_indices", kv_indices, widen=False)
    last = _as_int_array("kv_last_page_len", kv_last_page_len)
    num_groups = last.shape[0]
    if qo.shape[0] != num_groups + 1 or kvp.shape[0] != num_groups + 1:
        raise ValueError(
            f"qo_indptr {qo.shape}, kv_indptr {kvp.shape} and kv_last_page_len {last.shape} "
            "disagree on the group count"
        )
    q_len = qo[1:] - qo[:-1]
    num_pages = kvp[1:] - kvp[:-1]
    first_page, end_page = int(kvp[0]), int(kvp[-1])
    decreasing = np.minimum(q_len, num_pages).min(initial=0) < 0
    if qo[0] != 0 or first_page < 0 or end_page > idx.shape[0] or decreasing:
        raise ValueError("qo_indptr must start at 0, indptrs must be non-decreasing and within kv_indices")
    # Tokens missing from a group's last page: 0..page_size - 1 when its kv_last_page_len is valid;
    # anything else, negative ones included, reads as page_size or more unsigned.
    missing = np.where(num_pages > 0, page_size - last, 0)
    if missing.view(np.uint64).max(initial=0) >= page_size:
        raise ValueError(f"kv_last_page_len must be in 1..{page_size} for groups with pages")
    max_page = -1
    if end_page > first_page:
        max_page = _page_id_bound(idx[first_page:end_page]) - 1
        if max_page >= 2**31:
            raise ValueError("kv_indices must hold page ids in [0, 2**31)")
    kv_len = num_pages * page_size - missing
    if qo[-1] >= 2**30 or kv_len.max(initial=0) >= 2**30:
        raise ValueError("level too large: query tokens and KV lengths must stay below 2**30")
    return LevelArrays(qo, kvp, idx, q_len, kv_len, max_page)


#: A level's index arrays as ``check_level`` takes them: (qo_indptr, kv_indptr, kv_indices,
#: kv_last_page_len).
LevelIndices = tuple[np.ndarray | torch.Tensor, ...]


def check_levels(levels: Sequence[LevelIndices], page_size: int) -> list[LevelArrays]:
    """``check_level`` of each level, in order: the same arrays, and the same error for the first
    level it rejects. A plan's levels are checked together in ~20 numpy calls and one pass over each
    level's page ids, instead of ~30 calls per level (numpy's fixed cost per call is the cost on
    arrays of a few hundred groups); anything else (tensors, non-integer arrays, any check that
    fails) goes through ``check_level`` level by level, which raises its error."""
    checked = _check_together(levels, page_size)
    if checked is None:
        checked = [check_level(*level, page_size) for level in levels]
    return checked


def _check_together(levels: Sequence[LevelIndices], page_size: int) -> list[LevelArrays] | None:
    """``check_levels`` of 1-D integer numpy arrays that pass every check, else None.

    The indptrs of all levels are one int64 array, the qo_indptrs (T entries in all) then the
    kv_indptrs, differenced in one subtraction. The differences across a seam (one level's last
    entry and the next one's first, or the last qo_indptr entry and the first kv_indptr one) belong
    to no group and are zeroed; the kv_last_page_len arrays are laid out with one filler entry at
    each seam, so that they line up with the kv_indptr differences."""
    arrays = [a for level in levels for a in level]
    if page_size <= 0 or not levels or len(arrays) != 4 * len(levels):
        return None
    if not all(type(a) is np.ndarray and a.ndim == 1 and a.dtype.kind in "iu" for a in arrays):
        return None
    groups = [level[3].shape[0] for level in levels]
    if any(lv[0].shape[0] != n + 1 or lv[1].shape[0] != n + 1 for lv, n in zip(levels, groups, strict=True)):
        return None
    firsts = list(itertools.accumulate([n + 1 for n in groups[:-1]], initial=0))  # of each level's indptrs
    lasts = [first + n for first, n in zip(firsts, groups, strict=True)]
    total = lasts[-1] + 1
    indptrs = [lv[0] for lv in levels] + [lv[1] for lv in levels]
    ptr = np.concatenate(indptrs, dtype=np.int64, casting="unsafe")
    diff = ptr[1:] - ptr[:-1]
    diff[lasts + [total + last for last in lasts[:-1]]] = 0  # the seams
    filler = np.zeros(1, dtype=np.int64)
    last_len = np.concatenate(
        [a for lv in levels for a in (filler, lv[3])][1:], dtype=np.int64, casting="unsafe"
    )
    edges = ptr[firsts + lasts + [total + i for i in firsts + lasts]].tolist()
    qo_first, qo_last, kv_first, kv_last = (edges[i * len(levels) : (i + 1) * len(levels)] for i in range(4))
    if any(qo_first) or min(kv_first) < 0 or diff.min(initial=0) < 0:
        return None
    if any(end > lv[2].shape[0] for end, lv in zip(kv_last, levels, strict=True)):
        return None
    num_pages = diff[total:]
    missing = (page_size - last_len) * (num_pages > 0)  # check_level's, in fewer numpy calls
    if missing.view(np.uint64).max(initial=0) >= page_size:
        return None
    kv_len = num_pages * page_size - missing
    if max(qo_last) >= 2**30 or kv_len.max(initial=0) >= 2**30:
        return None
    checked = []
    for lv, first, last, start, end in zip(levels, firsts, lasts, kv_first, kv_last, strict=True):
        idx = lv[2] if lv[2].size else lv[2].astype(np.int64, copy=False)
        max_page = _page_id_bound(idx[start:end]) - 1 if end > start else -1
        if max_page >= 2**31:
            return None
        qo, kvp = ptr[first : last + 1], ptr[total + first : total + last + 1]
        checked.append(LevelArrays(qo, kvp, idx, diff[first:last], kv_len[first:last], max_page))
    return checked


def auto_chunk(
    kv_len: np.ndarray,
    programs: np.ndarray,
    tile: TileConfig,
    sms: int,
    max_splits: int = MAX_SPLITS,
    min_split: int = MIN_SPLIT_TOKENS,
) -> int:
    """KV tokens per split for a level whose group g runs ``programs[g]`` programs (M tiles x KV
    heads) over ``kv_len[g]`` tokens. Splits only when the unsplit level leaves SMs idle, into at most
    ``max_splits`` parts of at least ``min_split`` tokens (``kv_split.min_split_tokens``).

    Model: a wave of resident programs takes as long as its longest chunk. Among chunk lengths that
    cut the longest group into 1..64 equal parts, pick the fewest waves x chunk, moving to more
    splits only for a clear gain.
    """
    slots = sms * tile.resident_per_sm()
    if int(programs.sum()) >= slots or kv_len.size == 0:
        return UNSPLIT
    # The levels split for lack of programs are mostly shared ones, whose lengths stay the same from
    # step to step: the last choices are remembered.
    as_bytes = [a.astype(np.int64, copy=False).tobytes() for a in (kv_len, programs)]
    return _best_chunk(*as_bytes, tile.block_n, slots, max_splits, min_split)


@functools.lru_cache(maxsize=256)
def _best_chunk(
    kv_len_bytes: bytes, programs_bytes: bytes, block_n: int, slots: int, max_splits: int, min_split: int
) -> int:
    """``auto_chunk`` of a level that leaves SMs idle unsplit (int64 arrays as bytes): ``best_chunk``."""
    kv_len, programs = np.frombuffer(kv_len_bytes, np.int64), np.frombuffer(programs_bytes, np.int64)
    return best_chunk(kv_len, programs, block_n, slots, max_splits, min_split)


def level_work(
    level: LevelArrays,
    *,
    causal: bool,
    group_size: int,
    num_kv_heads: int,
    tile: TileConfig,
    sms: int,
    kv_chunk_size: int | None,
    max_splits: int = MAX_SPLITS,
    min_split: int = MIN_SPLIT_TOKENS,
) -> tuple[np.ndarray, np.ndarray]:
    """Cut a level into work items: (work int64 [W, WORK_COLS] with OROW 0, splits int64 [nq]: the
    partial states the level writes for each planned query token, 0 for tokens of groups without KV).

    kv_chunk_size: KV tokens per split (rounded up to a multiple of the KV tile); None splits only
    when the level has too few programs for the device (``auto_chunk``, no split under ``min_split``
    tokens). max_splits: per group.
    """
    work, splits, _ = levels_work(
        [level], causal=[causal], tiles=[tile], group_size=group_size, num_kv_heads=num_kv_heads, sms=sms,
        kv_chunk_size=kv_chunk_size, max_splits=max_splits, min_split=min_split, row_stride=0,
    )  # fmt: skip
    return work, splits[0]


def levels_work(
    levels: Sequence[LevelArrays],
    *,
    causal: Sequence[bool],
    tiles: Sequence[TileConfig],
    group_size: int,
    num_kv_heads: int,
    sms: int,
    kv_chunk_size: int | None,
    max_splits: int = MAX_SPLITS,
    min_split: int = MIN_SPLIT_TOKENS,
    row_stride: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``level_work`` of several levels over the same query tokens in one pass (a plan's levels):
    (work int64 [W, WORK_COLS], splits int64 [levels, nq], level int64 [W]: each item's). Level i's items are
    ``level_work``'s for it with ``causal[i]`` and ``tiles[i]``, in its order, level after level;
    their PAGE0 counts from the start of the levels' ``kv_indices`` laid end to end, and their OROW
    is ``i * row_stride``. Each level chooses its own split (``auto_chunk``, none shorter than
    ``min_split`` tokens) unless ``kv_chunk_size`` is given."""
    if kv_chunk_size is not None and kv_chunk_size <= 0:
        raise ValueError(f"kv_chunk_size must be positive, got {kv_chunk_size}")
    if not levels or len({level.num_query_tokens for level in levels}) != 1:
        raise ValueError("levels_work needs one or more levels over the same query tokens")
    if not len(levels) == len(causal) == len(tiles):
        raise ValueError(
            f"{len(levels)} levels need as many causal flags and tiles, got {len(causal)} and {len(tiles)}"
        )
    # Every array here is a few hundred entries: numpy's fixed cost per call is the cost, so the
    # work is laid out for few calls. One row per group holds the item columns, then per-level
    # constants (M tile in query tokens, level, KV tile; the M tile, KV tile and split chunk also
    # negated, for ceilings as -(a // -b)) and the group's first item; it is repeated once per item.
    # A level's constants are one row of ``per_level`` repeated over its groups (DIAG: NO_MASK when
    # not causal, replaced by the diagonal below when causal).
    groups = [level.kv_len.shape[0] for level in levels]
    per_level, page_base = [], 0
    for i, (level, tile, is_causal) in enumerate(zip(levels, tiles, causal, strict=True)):
        row = [0] * _ROW_COLS
        row[PAGE0], row[OROW], row[_LEVEL] = page_base, i * row_stride, i
        row[DIAG] = 0 if is_causal else NO_MASK
        row[_TILE_Q] = tile.block_m // group_size
        row[_NEG_TILE_Q] = -row[_TILE_Q]
        row[_BLOCK_N], row[_NEG_BLOCK_N] = tile.block_n, -tile.block_n
        per_level.append(row)
        page_base += level.kv_indices.shape[0]
    rows = np.array(per_level, dtype=np.int64).repeat(groups, axis=0)
    if len(levels) == 1:
        q_len, kv_len = levels[0].q_len, levels[0].kv_len
    else:
        q_len = np.concatenate([level.q_len for level in levels])
        kv_len = np.concatenate([level.kv_len for level in levels])
    neg_m_tiles = q_len // rows[:, _NEG_TILE_Q]  # -(M tiles): 0 for a group without queries
    m_tiles = -neg_m_tiles
    neg_chunk = rows[:, _NEG_CHUNK]
    start = 0
    for level, tile, n in zip(levels, tiles, groups, strict=True):
        chunk = kv_chunk_size
        if chunk is None:
            programs = m_tiles[start : start + n] * num_kv_heads
            chunk = auto_chunk(level.kv_len, programs, tile, sms, max_splits, min_split)
        neg_chunk[start : start + n] = -min(cdiv(chunk, tile.block_n) * tile.block_n, UNSPLIT)
        start += n
    # A group without KV gets no program and no partial row: the merge turns "no rows" into out 0
    # and lse -inf. Groups capped at max_splits take longer chunks instead of more splits.
    neg_splits = np.maximum(kv_len // neg_chunk, -max_splits)  # 0 exactly for a group without KV
    items = neg_splits * neg_m_tiles
    per = kv_len // np.minimum(neg_splits, -1)  # -(tokens per split)
    # KV0 holds the group's chunk and SPLIT its M-tile count until each item's own values replace them.
    np.maximum((per // rows[:, _BLOCK_N]) * rows[:, _NEG_BLOCK_N], rows[:, _BLOCK_N], out=rows[:, KV0])
    np.concatenate([level.qo_indptr[:-1] for level in levels], out=rows[:, Q0])
    np.add(rows[:, Q0], q_len, out=rows[:, Q1])
    rows[:, PAGE0] += np.concatenate([level.kv_indptr[:-1] for level in levels])
    rows[:, KV1] = kv_len
    np.maximum(m_tiles, 1, out=rows[:, SPLIT])
    start = 0
    for is_causal, n in zip(causal, groups, strict=True):
        if is_causal:
            group = slice(start, start + n)
            np.subtract(kv_len[group], rows[group, Q1], out=rows[group, DIAG])
        start += n
    np.subtract(items.cumsum(), items, out=rows[:, _FIRST_ITEM])
    work = rows.repeat(items, axis=0)
    s = np.arange(work.shape[0]) - work[:, _FIRST_ITEM]  # the item's index in its group
    # m-tiles innermost: the programs that read the same KV chunk run side by side and share it in L2.
    if m_tiles.max(initial=0) > 1:
        s, m = np.divmod(s, work[:, SPLIT])
        work[:, Q0] += m * work[:, _TILE_Q]
    np.minimum(work[:, Q0] + work[:, _TILE_Q], work[:, Q1], out=work[:, Q1])
    kv0 = s * work[:, KV0]
    kv1 = kv0 + work[:, KV0]
    np.minimum(kv0, work[:, KV1], out=work[:, KV0])
    np.minimum(kv1, work[:, KV1], out=work[:, KV1])
    work[:, SPLIT] = s
    return work[:, :WORK_COLS], (-neg_splits).repeat(q_len).reshape(len(levels), -1), work[:, _LEVEL]


def longest_first(work: np.ndarray, first_by: np.ndarray | None = None) -> np.ndarray:
    """Work items ordered by decreasing KV tokens x query tokens (stable): the long items start first,
    so that the short ones fill in behind them on every SM. ``first_by`` (one int per item): sort by
    it first, ascending (items of one launch together)."""
    neg_cost = (work[:, KV0] - work[:, KV1]) * (work[:, Q1] - work[:, Q0] + 1)
    return work[np.argsort(neg_cost, kind="stable") if first_by is None else np.lexsort((neg_cost, first_by))]

"""Which tile each level of a plan runs on, and the work lists of the Triton backend's launches.

The Triton backend (``triton_backend``) plans with these: ``level_tiles`` picks every level's tile
(at most two launches), ``schedule`` cuts the levels into work items (``prefix_cache.kernels.work``)
and groups them by launch, longest first. Pure host code on numpy arrays.
"""

from __future__ import annotations

import numpy as np

from prefix_cache.kernels.work import (
    MAX_SPLITS,
    LevelArrays,
    TileConfig,
    end_to_end,
    levels_work,
    lone_decode_fits,
    lone_decode_tile,
    longest_first,
    tile_configs,
)
from prefix_cache.planner.kv_split import min_split_tokens

# A shared (non-causal) level joins the decode tokens' launch on the narrow tile when it has at most
# SHARED_ON_NARROW_ROWS rows per group, its narrow M tiles read at most SHARED_ON_NARROW_READS KV
# elements (K and V over all KV heads, each M tile reading the level's KV, from L2 when they run side
# by side) and the launch's M tiles, unsplit, fit in one wave of resident programs. It saves a launch
# in an exact plan, and in any plan runs a level of few programs on 2-4x as many. Longer or busier
# levels lose more to the extra reads than they gain: in the sweep that set the limits, levels of
# 2-8 KV heads over a few thousand tokens gained and levels of 8k tokens and more lost. 128 rows
# rather than 64 because decode batches of a few dozen requests sharing a short prefix gained too,
# and only batches at the read limit lost a little (benchmarks/NOTES.md, "a small shared level on
# the decode tile, in the decode launch" and "a launch-aware planner").
SHARED_ON_NARROW_ROWS = 128
SHARED_ON_NARROW_READS = 1 << 25


def level_tiles(
    levels: list[LevelArrays],
    causal: list[bool],
    tiles: tuple[TileConfig, ...] | None,
    *,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sms: int,
    widest: bool = False,
) -> list[TileConfig]:
    """Each level's tile: the narrowest of ``tiles`` that holds its largest group's rows (under a
    capacity the fixed tiles, else the narrowest and widest of the levels' own, ``tile_config``),
    where a small shared level runs on the narrow tile instead, in the decode tokens' launch (see
    ``SHARED_ON_NARROW_ROWS``). At most two launches: the levels off the narrow tile all run on
    the widest tile one of them needs (on the last of ``tiles`` if ``widest``): the batch with
    three tile widths gained far more from losing its third launch than the other such batch lost
    to the wider tile (benchmarks/NOTES.md, "a small shared level on the decode tile", change 2).
    group: query heads per KV head; sms: the device's multiprocessors."""
    q_len, kv_len, starts = end_to_end(levels)
    q_with_kv = q_len * (kv_len > 0)
    rows = [r * group for r in np.maximum.reduceat(q_with_kv, starts).tolist()]
    if tiles is None:
        own = tile_configs(rows, group, head_dim, page_size)
        tiles = (min(own, key=lambda tile: tile.block_m), max(own, key=lambda tile: tile.block_m))
    fitting = [next((tile for tile in tiles if r <= tile.block_m), tiles[-1]) for r in rows]
    narrow = tiles[0]
    m_tiles = -(q_with_kv // -(narrow.block_m // group))  # per group with KV, on the narrow tile
    m_sums = np.add.reduceat(m_tiles, starts).tolist()  # per level
    read_sums = np.add.reduceat(m_tiles * kv_len, starts).tolist()  # KV tokens its M tiles read
    programs = sum(m for m, tile in zip(m_sums, fitting, strict=True) if tile == narrow)
    programs *= num_kv_heads
    slots = sms * narrow.resident_per_sm()
    chosen = []
    for tile, r, m, read, is_causal in zip(fitting, rows, m_sums, read_sums, causal, strict=True):
        extra = m * num_kv_heads
        reads = read * num_kv_heads * head_dim * 2
        small = not is_causal and r <= SHARED_ON_NARROW_ROWS and reads <= SHARED_ON_NARROW_READS
        if tile != narrow and small and programs + extra <= slots:
            tile, programs = narrow, programs + extra
        chosen.append(tile)
    others = [tile for tile in chosen if tile != narrow]
    if not others:
        return chosen
    second = tiles[-1] if widest else max(others, key=lambda tile: tile.block_m)
    return [tile if tile == narrow else second for tile in chosen]


def schedule(
    levels: list[LevelArrays],
    causal: list[bool],
    tiles: tuple[TileConfig, ...] | None,
    *,
    plan_levels: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sms: int,
    kv_chunk_size: int | None,
    row_stride: int,
    max_splits: int = MAX_SPLITS,
    widest: bool = False,
) -> tuple[list[TileConfig], list[np.ndarray], np.ndarray]:
    """Work items of ``levels`` (``causal`` per level), one list per tile, longest first: (tiles,
    [work per tile], splits [levels, nq]). ``tiles`` None: the plan's own pair (``level_tiles``),
    the launches narrowest first; else the fixed tiles, all listed (with no items if no level
    uses one). plan_levels: the plan's levels, counting one run outside these launches (on
    FlashInfer), whose merge folds several states per token; row_stride: partial rows per level
    (``levels_work``); ``widest``: see ``level_tiles``."""
    shape = dict(group=group, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, sms=sms)
    tiles_of = level_tiles(levels, causal, tiles, widest=widest, **shape)
    # Narrow launches (the unique level's decode) before wide ones (shared prefixes), as the
    # fixed pair runs: that order measured faster on several shared batches and slower on none
    # (benchmarks/NOTES.md, "an exact plan's launch order").
    used = sorted(set(tiles_of), key=lambda tile: tile.block_m) if tiles is None else list(tiles)
    min_split = min_split_tokens(plan_levels, min(t.block_m for t in tiles_of), head_dim)
    work, splits, item_level = levels_work(
        levels, causal=causal, tiles=tiles_of, group_size=group, num_kv_heads=num_kv_heads, sms=sms,
        kv_chunk_size=kv_chunk_size, max_splits=max_splits, min_split=min_split, row_stride=row_stride,
    )  # fmt: skip
    # A lone level of decodes filling one wave runs the same items on its own tile
    # (``lone_decode_tile``); under a capacity, a launch of its own after the fixed ones.
    if tiles is not None and (spare := lone_decode_tile(tiles[0], group, head_dim, page_size)):
        used.append(spare)
    lone = lone_decode_tile(tiles_of[0], group, head_dim, page_size)
    one_level = plan_levels == len(levels) == 1
    if lone is not None and one_level and lone_decode_fits(work, num_kv_heads, lone, sms):
        tiles_of = [lone]
        if tiles is None:
            used = [lone]
    if len(used) == 1:
        return used, [longest_first(work)], splits
    launch = np.array([used.index(tile) for tile in tiles_of])[item_level]
    work = longest_first(work, launch)
    ends = np.cumsum(np.bincount(launch, minlength=len(used))).tolist()
    return used, [work[start:end] for start, end in zip([0, *ends], ends, strict=False)], splits

"""How the Triton backend splits a level's KV across programs (numpy only, no torch).

Split-KV: when a level's programs (M tiles x KV heads) leave SMs idle, each group's KV is cut into
equal chunks, one program per chunk, and the merge combines the partial states. The choice lives
here, apart from the kernels, because the planner's cost model (``prefix_cache.planner.cost_model``, which
must import without torch) replays it to count a plan's programs and KV steps.
"""

from __future__ import annotations

import numpy as np

# Never give a level of a cascade a split of fewer KV tokens than this (below it, the partial rows
# and the merge cost more than the parallelism gains), nor a group more splits than MAX_SPLITS.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# A plan of one level on decode tiles (at most DECODE_TILE_ROWS query rows) of head dims up to 128
# splits from ONE_LEVEL_MIN_SPLIT_TOKENS: its merge is the only one, and its programs the launch's
# only ones. There the lower floor made one-level decodes of a few requests over a few hundred to a
# few thousand tokens faster (d64 and d128), while in cascades, where other levels' programs and
# merges share the device, it cost most batches, and at d256 it lost on one level too
# (benchmarks/NOTES.md, "splits and tiles of d256 decode" and "a lone level of decodes splits from
# 128 tokens").
DECODE_TILE_ROWS = 16
ONE_LEVEL_MIN_SPLIT_TOKENS = 128
#: The chunk of a level that is not split (longer than any level's KV).
UNSPLIT = np.iinfo(np.int32).max // 2


def min_split_tokens(levels: int, tile_rows: int, head_dim: int) -> int:
    """The fewest KV tokens of a split, for a level of a plan of ``levels`` levels (those run on
    FlashInfer included) on a tile of ``tile_rows`` query rows, of heads of ``head_dim``."""
    if levels == 1 and tile_rows <= DECODE_TILE_ROWS and head_dim <= 128:
        return ONE_LEVEL_MIN_SPLIT_TOKENS
    return MIN_SPLIT_TOKENS


def best_chunk(
    kv_len: np.ndarray,
    programs: np.ndarray,
    block_n: int,
    slots: int,
    max_splits: int,
    min_split: int,
) -> int:
    """KV tokens per split of a level whose group g runs ``programs[g]`` programs over ``kv_len[g]``
    tokens (int64 arrays), on a device of ``slots`` resident programs that the unsplit level leaves
    partly idle; ``block_n``: KV tokens per step of the level's tile. ``UNSPLIT`` when no split wins.

    Model: a wave of resident programs takes as long as its longest chunk. Among chunk lengths that
    cut the longest group into 2..max_splits equal parts (whole KV steps, at least ``min_split``
    tokens; ``min_split_tokens``), pick the fewest waves x chunk, moving to more splits only for a clear gain.
    ``programs`` and ``slots`` are whole numbers in any one unit (the backend counts programs over
    all KV heads; the cost model per KV head, scaled so that its slots are whole): only their ratio
    matters, and whole numbers keep each wave count exact."""
    longest = int(kv_len.max())
    # Every candidate at once: chunk lengths for 2..max_splits parts (non-increasing), cut where they
    # fall below min_split; the total programs of each in one [candidates, groups] product.
    parts = np.arange(2, max_splits + 1, dtype=np.int64)
    per_part = -(-longest // parts)
    chunks = -(-per_part // block_n) * block_n
    chunks = chunks[: np.count_nonzero(chunks >= min_split)]
    totals = np.maximum(-(-kv_len[None, :] // chunks[:, None]), 1) @ programs
    costs = (-(-totals // slots) * chunks).tolist()
    best_cost, best = longest, UNSPLIT  # one wave of the unsplit level
    for chunk, cost in zip(chunks.tolist(), costs, strict=True):
        # More splits must win clearly: each also costs partial rows to write and merge.
        if cost < 0.9 * best_cost:
            best_cost, best = cost, chunk
    return int(best)

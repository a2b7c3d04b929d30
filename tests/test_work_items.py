"""``level_work`` and ``levels_work`` against a per-group loop that writes each work item as the
work.py docstring defines it (host-side numpy only, no kernels)."""

import numpy as np
import pytest
from prefix_cache.kernels.work import (
    DIAG,
    KV0,
    KV1,
    NO_MASK,
    OROW,
    PAGE0,
    Q0,
    Q1,
    SPLIT,
    WORK_COLS,
    TileConfig,
    auto_chunk,
    check_level,
    check_levels,
    level_work,
    levels_work,
    longest_first,
    tile_config,
)

from prefix_cache.planner.kv_split import MIN_SPLIT_TOKENS, UNSPLIT


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _reference(qo, kvp, kv_len, *, causal, group_size, tile, chunk, max_splits):
    """Items group by group, splits outer and M tiles inner; per token, the splits of its group."""
    tile_q = tile.block_m // group_size
    chunk = _cdiv(chunk, tile.block_n) * tile.block_n
    items, token_splits = [], []
    for g in range(len(kv_len)):
        q_len, kv = int(qo[g + 1] - qo[g]), int(kv_len[g])
        splits = min(max(_cdiv(kv, chunk), 1), max_splits) if kv > 0 else 0
        token_splits += [splits] * q_len
        if splits == 0 or q_len == 0:
            continue
        per = _cdiv(_cdiv(kv, splits), tile.block_n) * tile.block_n
        for s in range(splits):
            for m in range(_cdiv(q_len, tile_q)):
                row = [0] * WORK_COLS
                row[Q0] = int(qo[g]) + m * tile_q
                row[Q1] = min(int(qo[g]) + (m + 1) * tile_q, int(qo[g + 1]))
                row[PAGE0] = int(kvp[g])
                row[KV0], row[KV1] = min(s * per, kv), min((s + 1) * per, kv)
                row[SPLIT] = s
                row[DIAG] = kv - q_len - int(qo[g]) if causal else NO_MASK
                items.append(row)
    return items, token_splits


@pytest.mark.parametrize("seed", range(20))
def test_level_work_matches_a_loop_over_groups(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        groups = int(rng.integers(1, 12))
        q_len = rng.integers(0, 40, groups) * (rng.random(groups) < 0.8)  # some groups without queries
        pages = rng.integers(0, 30, groups) * (rng.random(groups) < 0.8)  # some without KV
        page_size = int(rng.choice([1, 16]))
        last = np.where(pages > 0, rng.integers(1, page_size + 1, groups), 0)
        qo, kvp = np.concatenate([[0], np.cumsum(q_len)]), np.concatenate([[0], np.cumsum(pages)])
        level = check_level(qo, kvp, rng.integers(0, 99, int(kvp[-1])), last, page_size)
        causal, group_size = bool(rng.random() < 0.5), int(rng.choice([1, 4, 8]))
        tile = TileConfig(int(rng.choice([16, 64, 128])), 16, 4, 1)
        chunk, max_splits = int(rng.integers(1, 200)), int(rng.choice([64, 4, 1]))
        work, splits = level_work(
            level, causal=causal, group_size=group_size, num_kv_heads=2, tile=tile, sms=4,
            kv_chunk_size=chunk, max_splits=max_splits,
        )  # fmt: skip
        want_items, want_splits = _reference(
            qo, kvp, level.kv_len, causal=causal, group_size=group_size, tile=tile, chunk=chunk,
            max_splits=max_splits,
        )  # fmt: skip
        assert work.tolist() == want_items
        assert splits.tolist() == want_splits


def _random_level(rng: np.random.Generator, q_len: np.ndarray, page_size: int):
    """A level over the query tokens ``q_len`` splits into groups (some without queries or KV)."""
    groups = q_len.shape[0]
    pages = rng.integers(0, 30, groups) * (rng.random(groups) < 0.8)
    last = np.where(pages > 0, rng.integers(1, page_size + 1, groups), 0)
    qo, kvp = np.concatenate([[0], np.cumsum(q_len)]), np.concatenate([[0], np.cumsum(pages)])
    return check_level(qo, kvp, rng.integers(0, 99, int(kvp[-1])), last, page_size)


@pytest.mark.parametrize("seed", range(10))
def test_levels_work_is_each_levels_work_laid_end_to_end(seed: int) -> None:
    """One pass over several levels: level i's items are the per-group loop's for its own tile,
    causality and chunk, their pages counted from the levels' kv_indices laid end to end and their
    partial rows from i * row_stride."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(10):
        nq = int(rng.integers(0, 60))
        page_size, group_size = int(rng.choice([1, 16])), int(rng.choice([1, 4]))
        levels, causal, tiles = [], [], []
        for _ in range(int(rng.integers(1, 5))):
            cut = np.sort(rng.integers(0, nq + 1, int(rng.integers(0, 6))))
            q_len = np.diff(np.concatenate([[0], cut, [nq]]))
            levels.append(_random_level(rng, q_len, page_size))
            causal.append(bool(rng.random() < 0.5))
            tiles.append(TileConfig(int(rng.choice([16, 64, 128])), int(rng.choice([16, 32])), 4, 1))
        chunk, stride = int(rng.integers(1, 200)), nq + int(rng.integers(0, 3))
        work, splits, item_level = levels_work(
            levels, causal=causal, tiles=tiles, group_size=group_size, num_kv_heads=2, sms=4,
            kv_chunk_size=chunk, max_splits=8, row_stride=stride,
        )  # fmt: skip
        want_items, want_splits, want_level, page_base = [], [], [], 0
        for i, level in enumerate(levels):
            items, token_splits = _reference(
                level.qo_indptr, level.kv_indptr, level.kv_len, causal=causal[i], group_size=group_size,
                tile=tiles[i], chunk=chunk, max_splits=8,
            )  # fmt: skip
            for row in items:
                row[PAGE0] += page_base
                row[OROW] = i * stride
            want_items += items
            want_splits.append(token_splits)
            want_level += [i] * len(items)
            page_base += level.kv_indices.shape[0]
        assert work.tolist() == want_items
        assert splits.tolist() == want_splits
        assert item_level.tolist() == want_level


def _auto_chunk_reference(
    kv_len: list[int], programs: list[int], tile: TileConfig, sms: int, max_splits: int
) -> int:
    """The model of ``auto_chunk``'s docstring, candidate by candidate."""
    slots = sms * tile.resident_per_sm()
    if sum(programs) >= slots or not kv_len:
        return UNSPLIT
    longest = max(kv_len)
    best_cost, best = longest, UNSPLIT
    for parts in range(2, max_splits + 1):
        chunk = _cdiv(_cdiv(longest, parts), tile.block_n) * tile.block_n
        if chunk < MIN_SPLIT_TOKENS:
            break
        total = sum(max(_cdiv(n, chunk), 1) * p for n, p in zip(kv_len, programs, strict=True))
        cost = _cdiv(total, slots) * chunk
        if cost < 0.9 * best_cost:
            best_cost, best = cost, chunk
    return best


def test_auto_chunk_follows_its_model_every_call() -> None:
    """The split length against the docstring's model, on first calls and on repeated (remembered) ones."""
    rng = np.random.default_rng(11)
    cases = []
    for _ in range(300):
        groups = int(rng.integers(1, 12))
        kv_len = rng.integers(0, 40000, groups)
        programs = rng.integers(1, 9, groups)
        tile = TileConfig(int(rng.choice([16, 64, 128])), int(rng.choice([32, 64, 128])), 4, 2)
        sms, max_splits = int(rng.integers(1, 140)), int(rng.choice([8, 64]))
        cases.append((kv_len, programs, tile, sms, max_splits))
        # The same lengths with other programs, KV tile or SM count: a remembered choice must not leak.
        other = TileConfig(tile.block_m, 128 if tile.block_n != 128 else 32, 4, 2)
        cases.append((kv_len, programs * 2, tile, sms, max_splits))
        cases.append((kv_len, programs, other, sms + 7, max_splits))
    for _ in range(2):
        for kv_len, programs, tile, sms, max_splits in cases:
            want = _auto_chunk_reference(kv_len.tolist(), programs.tolist(), tile, sms, max_splits)
            assert auto_chunk(kv_len, programs, tile, sms, max_splits) == want


def test_levels_work_rejects_levels_that_disagree() -> None:
    """Levels over different query tokens, or flags and tiles that do not match the levels, raise."""
    rng = np.random.default_rng(7)
    two, three = _random_level(rng, np.array([2]), 16), _random_level(rng, np.array([3]), 16)
    tile = TileConfig(16, 16, 4, 1)
    common = dict(group_size=1, num_kv_heads=1, sms=4, kv_chunk_size=None, row_stride=3)
    with pytest.raises(ValueError, match="same query tokens"):
        levels_work([two, three], causal=[False, True], tiles=[tile, tile], **common)
    with pytest.raises(ValueError, match="same query tokens"):
        levels_work([], causal=[], tiles=[], **common)
    with pytest.raises(ValueError, match="causal flags and tiles"):
        levels_work([two, two], causal=[True], tiles=[tile, tile], **common)


def test_longest_first_by_launch() -> None:
    """Items of launch 0 first, then launch 1, each by decreasing KV x (queries + 1), ties in order."""
    rng = np.random.default_rng(5)
    work = np.zeros((200, WORK_COLS), dtype=np.int64)
    work[:, KV1] = rng.integers(0, 5, 200) * 64
    work[:, Q1] = rng.integers(1, 3, 200)
    work[:, SPLIT] = np.arange(200)  # identifies an item
    launch = rng.integers(0, 2, 200)
    cost = work[:, KV1] * (work[:, Q1] + 1)
    want = sorted(range(200), key=lambda i: (launch[i], -cost[i], i))
    assert longest_first(work, launch)[:, SPLIT].tolist() == want
    assert longest_first(work)[:, SPLIT].tolist() == sorted(range(200), key=lambda i: (-cost[i], i))


@pytest.mark.parametrize(
    ("qo", "kvp", "idx", "last", "page_size", "message"),
    [
        ([1, 2], [0, 1], [3], [4], 4, "qo_indptr must start at 0"),
        ([0, 1], [-1, 0], [3], [4], 4, "within kv_indices"),  # a group's pages from index -1
        ([0, 1, 2], [0, 2, 1], [3, 4], [4, 4], 4, "non-decreasing"),  # kv_indptr going back
        ([0, 1], [0, 1], [3], [0], 4, "kv_last_page_len must be in 1..4"),  # pages holding 0 tokens
        ([0, 1], [0, 1], [3], [1], 0, "page_size must be positive"),
        ([0, 1], [0, 1024], [0] * 1024, [2**20], 2**20, "level too large"),  # 2**30 KV tokens
    ],
)
def test_check_level_rejects(qo, kvp, idx, last, page_size, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_level(np.array(qo), np.array(kvp), np.array(idx), np.array(last), page_size)


def _outcome(check):
    """The arrays ``check()`` returns (as lists, with their dtypes) and each level's largest page id,
    or the error it raises."""
    try:
        levels = check()
    except ValueError as exc:
        return str(exc)
    return [
        (
            [(a.tolist(), a.dtype) for a in (lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.q_len, lv.kv_len)],
            lv.max_page,
        )
        for lv in levels
    ]


@pytest.mark.parametrize("seed", range(4))
def test_check_levels_is_check_level_of_each(seed: int) -> None:
    """A plan's levels checked together: check_level's arrays for each level, and check_level's error
    for the first level it rejects, whichever entry of whichever level is off (indptrs out of order
    or range, last page lengths, page ids, sizes at the 2**30 limit, a 2-D array)."""
    rng = np.random.default_rng(300 + seed)
    for _ in range(400):
        page_size = int(rng.choice([1, 4, 16]))
        levels = []
        for _ in range(int(rng.integers(1, 5))):
            groups = int(rng.integers(0, 6))
            pages = rng.integers(0, 4, groups) * (rng.random(groups) < 0.8)
            qo = np.concatenate([[0], np.cumsum(rng.integers(0, 4, groups))])
            kvp = np.concatenate([[0], np.cumsum(pages)])
            last = np.where(pages > 0, rng.integers(1, page_size + 1, groups), 0)
            arrays = [qo, kvp, rng.integers(0, 99, int(kvp[-1])), last]
            arrays = [a.astype(rng.choice([np.int32, np.int64, np.uint32])) for a in arrays]
            if rng.random() < 0.15:
                k = int(rng.integers(0, 4))
                off = arrays[k].astype(np.int64)
                if off.size:
                    off[int(rng.integers(0, off.size))] += int(rng.choice([-1, 1, -50, 2**30, 2**31]))
                arrays[k] = off
            if rng.random() < 0.03:
                arrays[int(rng.integers(0, 4))] = np.zeros((1, 1), dtype=np.int32)
            levels.append(tuple(arrays))
        each = _outcome(lambda: [check_level(*level, page_size) for level in levels])  # noqa: B023
        assert _outcome(lambda: check_levels(levels, page_size)) == each  # noqa: B023


def test_check_level_accepts_the_largest_values() -> None:
    level = check_level(
        np.array([0, 1]), np.array([0, 1024]), np.zeros(1024, int), np.array([2**20 - 1]), 2**20
    )
    assert level.kv_len.tolist() == [2**30 - 1]


def test_levels_work_counts_pages_from_whole_kv_indices() -> None:
    """A level's kv_indices may hold entries past its groups' pages (kv_indptr[-1] < len): the next
    level's PAGE0 still counts from the end of the whole array, as the backend lays them out."""
    first = check_level(np.array([0, 2]), np.array([1, 3]), np.arange(5), np.array([16]), 16)  # 2 extra
    second = check_level(np.array([0, 2]), np.array([0, 1]), np.array([9]), np.array([5]), 16)
    work, _, item_level = levels_work(
        [first, second], causal=[False, True], tiles=[TileConfig(16, 16, 1, 1)] * 2, group_size=1,
        num_kv_heads=1, sms=4, kv_chunk_size=None, row_stride=2,
    )  # fmt: skip
    assert work[item_level == 0, PAGE0].tolist() == [1]
    assert work[item_level == 1, PAGE0].tolist() == [5]


def test_auto_chunk_splits_only_when_sms_are_left_idle() -> None:
    """Programs that exactly fill the resident slots (sms x resident_per_sm) leave no SM idle: no
    split, though the model would prefer two waves of short chunks to one of the longest group."""
    assert [TileConfig(m, 64, 4, 2).resident_per_sm() for m in (16, 32, 64, 128)] == [4, 4, 2, 1]
    tile, kv_len = TileConfig(16, 64, 4, 2), np.array([4096, 10, 10, 10])
    assert auto_chunk(kv_len, np.array([1, 1, 1, 1]), tile, 1) == UNSPLIT  # 4 programs, 4 slots
    assert auto_chunk(kv_len[:3], np.array([1, 1, 1]), tile, 1) < UNSPLIT  # 3 programs: split


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("group_size", [1, 3, 8, 71, 128])
def test_a_tile_holds_a_token_of_every_query_head_of_a_group(
    interpret: str, group_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the rows, an M tile has 16 rows or more (tl.dot) and room for one query token of a
    group (MQA models have up to 128 query heads per KV head): tile_q = block_m // group_size >= 1."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    for rows in (0, 1, group_size, 5 * group_size, 1 << 20):
        for head_dim, page_size in ((16, 1), (128, 16), (256, 16)):
            tile = tile_config(rows, group_size, head_dim, page_size)
            assert tile.block_m >= 16 and tile.block_m // group_size >= 1
    if interpret == "0":  # the GPU tiles: 128 rows at most for head_dim 128, 64 above (registers)
        assert tile_config(1 << 20, 1, 128, 16).block_m == 128
        assert tile_config(1 << 20, 1, 256, 16).block_m == 64
        # Head dim 256: decode tiles read 64 KV tokens per step, wider tiles 32 (an H200 sweep).
        assert [tile_config(rows, 2, 256, 16).block_n for rows in (2, 64)] == [64, 32]


def test_levels_work_rejects_a_zero_chunk() -> None:
    level = check_level(np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([3]), 4)
    with pytest.raises(ValueError, match="kv_chunk_size must be positive"):
        levels_work(
            [level], causal=[True], tiles=[TileConfig(16, 16, 1, 1)], group_size=1, num_kv_heads=1, sms=4,
            kv_chunk_size=0, row_stride=1,
        )  # fmt: skip

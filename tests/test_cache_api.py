"""Unit tests of PrefixCache: the engine flow, bad input, collisions, LRU order, duplicates, events."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from test_cache_helpers import chain_keys, held_pages, run_prompt, snapshot
from xxhash import xxh3_64_intdigest

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.cache.prefix_cache import InvariantError, OutOfPages, PrefixCache, PrefixCacheError
from prefix_cache.cache.sequence import _cast_int_view
from prefix_cache.cache.stats import CacheStats


def test_engine_flow() -> None:
    cache = PrefixCache(num_pages=32, page_size=4)
    prompt = list(range(10))
    seq = cache.open(prompt)
    assert seq.num_cached_tokens == 0 and seq.num_tokens == 0 and len(seq.block_table) == 0
    cache.allocate(seq, 10)
    assert seq.num_allocated_tokens == 10
    assert seq.block_table.dtype == np.int32 and seq.block_table.tolist() == [0, 1, 2]
    cache.commit(seq, prompt)
    assert seq.num_tokens == 10 and seq.tokens.tolist() == prompt
    assert cache.num_cached_pages == 2  # the partial third page stays private
    for token in (10, 11, 12):
        cache.allocate(seq, 1)
        cache.commit(seq, [token])
    assert cache.num_cached_pages == 3
    cache.check_invariants()
    cache.close(seq)
    assert seq.closed and len(seq.block_table) == 0
    assert cache.num_free_pages == 29 and cache.num_evictable_pages == 3
    cache.check_invariants()

    again = cache.open(list(range(14)))
    assert again.num_cached_tokens == 12
    assert again.block_table.tolist() == [0, 1, 2]
    assert cache.num_evictable_pages == 0
    cache.close(again)
    cache.check_invariants()


def test_match_never_covers_last_token_and_changes_nothing() -> None:
    cache = PrefixCache(num_pages=16, page_size=4)
    run_prompt(cache, list(range(9)))  # two full pages cached
    before = snapshot(cache)
    assert cache.match(list(range(8))) == 4  # a fully cached prompt: last token left out
    assert cache.match(list(range(9))) == 8
    assert cache.match(list(range(20))) == 8
    assert cache.match([0, 1, 2, 3]) == 0
    assert cache.match([]) == 0
    assert cache.match(list(range(9)), namespace="other") == 0
    assert snapshot(cache) == before
    seq = cache.open(list(range(8)))
    assert seq.num_cached_tokens == 4
    # The engine commits the rest of the prompt; the now-full page is cached already, so the
    # sequence keeps its own copy (page 2) until it closes: block tables never change.
    cache.allocate(seq, 4)
    cache.commit(seq, [4, 5, 6, 7])
    assert seq.block_table.tolist() == [0, 2]
    cache.close(seq)
    assert cache.num_free_pages == 14
    cache.check_invariants()


def test_open_after_match_sees_changes_in_between() -> None:
    # open may reuse the walk of the match just before it; any change in between must show.
    cache = PrefixCache(num_pages=16, page_size=2)
    prompt = np.array([1, 2, 3, 4, 5], dtype=np.int32)
    run_prompt(cache, prompt)
    assert cache.match(prompt) == 4
    cache.evict(1)
    assert cache.open(prompt).num_cached_tokens == 2
    assert cache.match(prompt) == 2
    prompt[0] = 9  # the engine reuses its buffer
    assert cache.open(prompt).num_cached_tokens == 0
    assert cache.match([1, 2, 3, 4, 5]) == 2
    run_prompt(cache, [1, 2, 3, 4, 5])  # caches the second page again
    assert cache.open([1, 2, 3, 4, 5]).num_cached_tokens == 4
    assert cache.match([1, 2, 3, 4, 5], namespace="n") == 0
    assert cache.open([1, 2, 3, 4, 5], namespace="n").num_cached_tokens == 0
    cache.check_invariants()


def test_open_after_match_locks_the_same_pages() -> None:
    # The reused walk must take the references and fill the block table as a fresh walk does.
    cache = PrefixCache(num_pages=16, page_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    run_prompt(cache, prompt)
    fresh = cache.open(prompt)
    assert cache.match(prompt) == 6
    reused = cache.open(prompt)
    assert reused.num_cached_tokens == 6
    assert reused.block_table.tolist() == fresh.block_table.tolist()
    assert cache.num_evictable_pages == 0
    cache.check_invariants()
    cache.close(fresh)
    cache.close(reused)
    assert cache.num_evictable_pages == 3
    cache.check_invariants()


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        lambda t: np.asarray(t, dtype=np.int32),
        lambda t: np.asarray(t, dtype=np.int64),
        lambda t: np.asarray(t, dtype=np.uint16),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
)
def test_token_containers(make) -> None:
    cache = PrefixCache(num_pages=16, page_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    seq = cache.open(make(prompt))
    cache.allocate(seq, len(prompt))
    cache.commit(seq, make(prompt[:5]))
    cache.commit(seq, make(prompt[5:6]))
    cache.commit(seq, make(prompt[6:]))
    assert seq.tokens.tolist() == prompt
    cache.close(seq)
    assert cache.match(make(prompt)) == 8
    cache.check_invariants()


BAD_TOKENS = [
    ([1, -1], ValueError),
    ([1.0, 2.0], TypeError),
    ([1, 2.5], TypeError),
    ([1, True], TypeError),
    ([True], TypeError),
    ([2**31], ValueError),
    ([2**70], ValueError),
    ([[1, 2], [3, 4]], ValueError),
    ([[1, 2], [3]], ValueError),
    ("1234", TypeError),
    (b"1234", TypeError),
    (7, TypeError),
    (None, TypeError),
    (["1"], TypeError),
    (np.array([1, -2], dtype=np.int32), ValueError),
    (np.array([-(2**31), 1], dtype=np.int32), ValueError),
    (np.array([1, 2, -1, 4], dtype=np.int32)[::2], ValueError),  # strided view
    (np.r_[np.arange(4000), -1].astype(np.int32), ValueError),  # long enough for numpy's check
    (np.r_[np.arange(2000), -1].astype(np.int32), ValueError),
    (np.array([1, 2**31], dtype=np.int64), ValueError),
    (np.array([1.0]), TypeError),
    (np.array([True]), TypeError),
    (np.zeros((2, 2), dtype=np.int32), ValueError),
    (np.int32(3), TypeError),
    (torch.tensor([1.0, 2.0]), TypeError),
    (torch.tensor([True]), TypeError),
    (torch.zeros(2, 2, dtype=torch.int64), ValueError),
]


@pytest.mark.parametrize(("tokens", "error"), BAD_TOKENS)
def test_bad_tokens_are_refused_and_change_nothing(tokens, error) -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    run_prompt(cache, [1, 2, 3, 4, 5])
    seq = cache.open([1, 2, 3, 4, 9])
    cache.allocate(seq, 4)
    before = snapshot(cache)
    with pytest.raises(error):
        cache.match(tokens)
    with pytest.raises(error):
        cache.open(tokens)
    with pytest.raises(error):
        cache.commit(seq, tokens)
    assert snapshot(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize("token", [-1, 2**31, 1.5, True, "a", None, [1]])
def test_bad_single_token_on_the_decode_path(token) -> None:
    cache = PrefixCache(num_pages=4, page_size=2)
    seq = cache.open([1, 2, 3])
    cache.allocate(seq, 4)
    before = snapshot(cache)
    with pytest.raises((TypeError, ValueError)):
        cache.commit(seq, [token])
    assert snapshot(cache) == before


def test_commit_beyond_allocation() -> None:
    cache = PrefixCache(num_pages=8, page_size=4)
    seq = cache.open([1, 2, 3])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="allocate first"):
        cache.commit(seq, [1])
    cache.allocate(seq, 3)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="reserved"):
        cache.commit(seq, [1, 2, 3, 4])
    assert snapshot(cache) == before
    cache.commit(seq, [1, 2, 3])
    with pytest.raises(ValueError):
        cache.commit(seq, [4])
    with pytest.raises(ValueError):
        cache.commit(seq, np.array([4], dtype=np.int32))
    cache.commit(seq, [])  # nothing to commit is fine
    cache.check_invariants()


def test_closed_foreign_and_non_sequences() -> None:
    cache = PrefixCache(num_pages=8, page_size=4)
    other = PrefixCache(num_pages=8, page_size=4)
    seq = cache.open([1, 2, 3])
    foreign = other.open([1, 2, 3])
    before = snapshot(cache)
    for call in (lambda s: cache.allocate(s, 1), lambda s: cache.commit(s, [1]), cache.close):
        with pytest.raises(ValueError, match="another PrefixCache"):
            call(foreign)
        with pytest.raises(TypeError, match="Sequence"):
            call("not a sequence")
    assert snapshot(cache) == before
    cache.close(seq)
    after_close = snapshot(cache)
    for call in (lambda s: cache.allocate(s, 1), lambda s: cache.commit(s, [1]), cache.close):
        with pytest.raises(ValueError, match="closed"):
            call(seq)
    assert snapshot(cache) == after_close
    cache.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_pages": 0}, ValueError),
        ({"num_pages": -3}, ValueError),
        ({"num_pages": 2**31}, ValueError),
        ({"num_pages": 4.0}, TypeError),
        ({"num_pages": True}, TypeError),
        ({"num_pages": "4"}, TypeError),
        ({"num_pages": 4, "page_size": 0}, ValueError),
        ({"num_pages": 4, "page_size": 1025}, ValueError),
        ({"num_pages": 4, "page_size": 2.0}, TypeError),
        ({"num_pages": 4, "hash_fn": 3}, TypeError),
    ],
)
def test_constructor_arguments(kwargs, error) -> None:
    with pytest.raises(error):
        PrefixCache(**kwargs)


def test_constructor_accepts_numpy_ints_and_bounds() -> None:
    assert PrefixCache(num_pages=np.int64(1), page_size=np.int32(1024)).num_pages == 1
    assert PrefixCache(num_pages=1, page_size=1).page_size == 1


@pytest.mark.parametrize(
    ("count", "error"), [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("2", TypeError)]
)
def test_bad_counts(count, error) -> None:
    cache = PrefixCache(num_pages=4, page_size=2)
    seq = cache.open([1, 2, 3])
    before = snapshot(cache)
    with pytest.raises(error):
        cache.allocate(seq, count)
    with pytest.raises(error):
        cache.evict(count)
    assert snapshot(cache) == before
    cache.allocate(seq, np.int64(2))
    assert seq.num_allocated_tokens == 2


@pytest.mark.parametrize("namespace", [1.5, True, [1], ("a",)])
def test_bad_namespace(namespace) -> None:
    cache = PrefixCache(num_pages=4, page_size=2)
    with pytest.raises(TypeError, match="namespace"):
        cache.match([1, 2, 3], namespace)
    with pytest.raises(TypeError, match="namespace"):
        cache.open([1, 2, 3], namespace)
    assert cache.num_live_sequences == 0


def test_namespaces_never_share_pages() -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    run_prompt(cache, prompt, namespace="tenant-a")
    assert cache.match(prompt, "tenant-a") == 4
    for namespace in (None, "tenant-b", b"tenant-a", 0, "0", b"0"):
        assert cache.match(prompt, namespace) == 0
        assert cache.open(prompt, namespace).num_cached_tokens == 0


def constant_hash(data: bytes, parent: int) -> int:
    return 7


def test_colliding_hash_never_serves_other_tokens() -> None:
    cache = PrefixCache(num_pages=32, page_size=2, hash_fn=constant_hash)
    first = run_prompt(cache, [1, 2, 3, 4, 5])
    # Only the first page could be cached: the second page's key was taken by the first.
    assert cache.num_cached_pages == 1 and cache.stats.collision_pages == 1
    assert cache.match([1, 2, 3, 4, 5]) == 2
    assert first.closed
    # Same key, other tokens: a miss, and the new pages stay private.
    seq = run_prompt(cache, [9, 9, 3, 4, 5], close=False)
    assert seq.num_cached_tokens == 0
    assert cache.match([9, 9, 3, 4, 5]) == 0
    assert cache.stats.collision_pages == 3  # pages, not sequences: 1 before and 2 here
    assert cache.num_cached_pages == 1
    held = set(seq.block_table.tolist())
    (cached,) = cache._tree.nodes()
    assert cache._tree.roots[None].index == {7} and cached.pages[0] not in held
    # Same tokens in another namespace: same key, different parent, so no hit either.
    assert cache.match([1, 2, 3], namespace="x") == 0
    cache.close(seq)
    assert cache.num_free_pages == 31
    cache.check_invariants()


def test_colliding_hash_keeps_namespaces_apart() -> None:
    # The key is the first token alone: equal pages in two namespaces get equal keys.
    cache = PrefixCache(num_pages=32, page_size=2, hash_fn=lambda data, parent: data[0])
    run_prompt(cache, [1, 2, 9])
    run_prompt(cache, [3, 4, 9], namespace="x")  # so namespace "x" has a cached page of its own
    assert cache.match([3, 4, 9], namespace="x") == 2
    assert cache.match([1, 2, 9], namespace="x") == 0
    seq = run_prompt(cache, [1, 2, 9], namespace="x", close=False)
    assert seq.num_cached_tokens == 0
    # Keys are unique per namespace: the default namespace's key 1 does not stop "x" caching.
    assert cache.stats.collision_pages == 0
    assert cache.match([1, 2, 9], namespace="x") == 2
    assert cache.match([1, 2, 9]) == 2


def test_one_tenant_cannot_stop_another_from_caching() -> None:
    # Namespace seeds are public, so a tenant can compute another tenant's block keys and craft
    # blocks with the same keys (simulated by a hash of the tokens alone): the victim's pages
    # must still be cached.
    cache = PrefixCache(num_pages=32, page_size=2, hash_fn=lambda data, parent: xxh3_64_intdigest(data))
    run_prompt(cache, [5, 6, 7, 8, 0], namespace="attacker")
    victim = run_prompt(cache, [5, 6, 7, 8, 1], namespace="victim")
    assert victim.num_cached_tokens == 0 and cache.stats.collision_pages == 0
    assert cache.match([5, 6, 7, 8, 2], namespace="victim") == 4
    cache.drain_events()
    cache.reset()
    cache.check_invariants()


def test_weak_hash_keeps_prefixes_exact() -> None:
    # Two-valued keys: lots of collisions; every hit must still be the exact prefix.
    cache = PrefixCache(num_pages=256, page_size=1, hash_fn=lambda data, parent: (data[0] + parent) & 1)
    rng = np.random.default_rng(1)
    committed: list[list[int]] = []
    for _ in range(50):
        prompt = rng.integers(0, 3, int(rng.integers(2, 8))).tolist()
        seq = cache.open(prompt)
        n = seq.num_cached_tokens
        assert any(c[:n] == prompt[:n] for c in committed) or n == 0
        assert seq.block_table[:n].tolist() == cache.open(prompt[: n + 1]).block_table[:n].tolist()
        cache.allocate(seq, len(prompt) - n)
        cache.commit(seq, prompt[n:])
        committed.append(prompt)
        cache.check_invariants()


def test_lru_evicts_least_recently_released_first() -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    prompts = {
        name: [base, base + 1, base + 2, base + 3, 99] for name, base in (("a", 10), ("b", 20), ("c", 30))
    }
    for prompt in prompts.values():
        run_prompt(cache, prompt)
    keys = {name: chain_keys(prompt, 2) for name, prompt in prompts.items()}
    cache.close(cache.open(prompts["a"]))  # "a" becomes the most recently used
    cache.drain_events()
    assert cache.evict(2) == 2
    assert cache.drain_events() == [BlockRemoved([keys["b"][1], keys["b"][0]])]
    assert cache.evict(1) == 1
    assert cache.drain_events() == [BlockRemoved([keys["c"][1]])]
    assert cache.evict(10) == 3
    assert cache.drain_events() == [BlockRemoved([keys["c"][0], keys["a"][1], keys["a"][0]])]
    assert cache.evict(1) == 0 and cache.drain_events() == []
    assert cache.num_free_pages == 64
    cache.check_invariants()


def test_parent_of_evicted_leaf_keeps_its_own_last_use() -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    run_prompt(cache, [1, 1, 2, 2, 0])  # caches pages (1 1) and (1 1)(2 2)
    run_prompt(cache, [5, 5, 0])
    run_prompt(cache, [6, 6, 0])
    cache.close(cache.open([1, 1, 7]))  # uses only page (1 1), after (5 5) and (6 6)
    cache.drain_events()
    order = []
    while cache.evict(1):
        (event,) = cache.drain_events()
        order.extend(event.block_hashes)
        cache.check_invariants()
    k1, k2 = chain_keys([1, 1, 2, 2], 2)
    assert order == [k2, chain_keys([5, 5], 2)[0], chain_keys([6, 6], 2)[0], k1]


def test_orphaned_parent_waits_behind_older_ones() -> None:
    # Evicting a leaf orphans its parent; in one ``evict`` call it must still yield to an older
    # orphaned parent that is already waiting.
    cache = PrefixCache(num_pages=64, page_size=2)
    run_prompt(cache, [1, 1, 2, 2, 0])  # E1 -> E2
    run_prompt(cache, [3, 3, 4, 4, 0])  # A1 -> A2
    run_prompt(cache, [1, 1, 0])  # E1 used again
    run_prompt(cache, [3, 3, 0])  # A1 used again, after E1
    run_prompt(cache, [5, 5, 0])  # Z1, the newest
    e1, e2 = chain_keys([1, 1, 2, 2], 2)
    a1, a2 = chain_keys([3, 3, 4, 4], 2)
    (z1,) = chain_keys([5, 5], 2)
    cache.drain_events()
    assert cache.evict(1) == 1  # E2; E1 now waits with its newer use
    assert cache.evict(2) == 2  # A2, then E1 (older than A1, which A2's eviction orphaned)
    assert cache.evict(5) == 2
    assert [key for event in cache.drain_events() for key in event.block_hashes] == [e2, a2, e1, a1, z1]
    cache.check_invariants()


def test_batch_eviction_follows_the_same_order_as_single_evictions() -> None:
    # ``evict(n)`` may shortcut an orphaned parent past the LRU structures; the order must be
    # exactly that of n calls of ``evict(1)``, which always go through them.
    rng = np.random.default_rng(3)
    caches = [PrefixCache(num_pages=400, page_size=2) for _ in range(2)]
    history: list[list[int]] = []
    for _ in range(60):
        base = history[int(rng.integers(len(history)))] if history and rng.random() < 0.7 else []
        cut = int(rng.integers(0, len(base) + 1))
        if cut > 2 and rng.random() < 0.3:
            prompt = base[:cut]  # refreshes the pages it reuses, so parents outlive their leaves
        else:
            prompt = base[:cut] + rng.integers(0, 4, int(rng.integers(1, 9))).tolist()
        history.append(prompt)
        keep = rng.random() < 0.1
        for cache in caches:
            run_prompt(cache, prompt, close=not keep)
            cache.drain_events()
    batched, single = caches
    order: list[list[int]] = [[], []]
    while True:
        size = int(rng.integers(1, 6))
        freed = batched.evict(size)
        for _ in range(size):
            single.evict(1)
        for cache, keys in zip(caches, order, strict=True):
            keys.extend(key for event in cache.drain_events() for key in event.block_hashes)
            cache.check_invariants()
        assert order[0] == order[1]
        if freed < size:
            break
    assert batched.num_evictable_pages == 0 and len(order[0]) > 50


def test_stale_lru_entries_are_dropped() -> None:
    # A parent that became a leaf by eviction waits in the heap; each reopen of it leaves a stale
    # heap entry behind, and those must not pile up.
    cache = PrefixCache(num_pages=8, page_size=2)
    run_prompt(cache, [1, 2, 3, 4, 5])
    tree = cache._tree
    for _ in range(3000):
        assert cache.evict(1) == 1  # the leaf goes, its parent enters the heap
        cache.close(cache.open([1, 2, 3]))  # the parent is acquired (stale entry) and released
        seq = cache.open([1, 2, 3, 4, 5])
        cache.allocate(seq, 2)
        cache.commit(seq, [3, 4])  # the leaf is cached again
        cache.close(seq)
    assert tree.num_lru == 1 and len(tree.older) < 1100
    cache.check_invariants()
    assert cache.evict(5) == 2


def test_held_pages_are_never_evicted() -> None:
    cache = PrefixCache(num_pages=8, page_size=2)
    holder = run_prompt(cache, [1, 2, 3, 4, 5], close=False)
    run_prompt(cache, [7, 8, 9])
    assert cache.num_evictable_pages == 1
    assert cache.evict(100) == 1
    assert cache.match([1, 2, 3, 4, 5]) == 4
    held = set(holder.block_table.tolist())
    assert len(held) == 3 and not held & set(cache._pool.free)
    cache.check_invariants()


def test_duplicate_commit_keeps_the_block_table() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = cache.open(prompt)
    b = cache.open(prompt)
    cache.allocate(a, 5)
    cache.allocate(b, 5)
    b_pages = b.block_table.tolist()
    cache.commit(a, prompt)
    free_before = cache.num_free_pages
    cache.drain_events()
    cache.commit(b, prompt)
    assert cache.drain_events() == []  # nothing new was cached
    # Append-only: b's block table is what the engine read before; its copies stay private.
    assert b.block_table.tolist() == b_pages
    assert cache.num_free_pages == free_before
    assert cache.stats.duplicate_pages == 2 and cache.stats.stored_pages == 2
    cache.check_invariants()
    free_before = cache.num_free_pages
    cache.close(a)
    # b's copies became the cached pages (b holds them); a's went back to the pool with its last.
    assert cache.num_evictable_pages == 0 and cache.num_free_pages == free_before + 3
    assert held_pages(b) == b_pages[:2]
    assert cache.match(prompt) == 4
    cache.close(b)
    assert cache.num_evictable_pages == 2 and cache.num_free_pages == 14
    cache.check_invariants()


def test_duplicates_then_new_pages_in_one_commit() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    a = cache.open([1, 2, 3])
    b = cache.open([1, 2, 3, 4, 5, 6, 7])
    cache.allocate(a, 3)
    cache.allocate(b, 7)
    cache.commit(a, [1, 2, 3])
    cache.drain_events()
    cache.commit(b, [1, 2, 3, 4, 5, 6, 7])
    keys = chain_keys([1, 2, 3, 4, 5, 6], 2)
    assert cache.drain_events() == [BlockStored(keys[1:], keys[0], [3, 4, 5, 6], 2, None)]
    assert b.block_table[0] != a.block_table[0]  # b's own copy of the first page
    assert held_pages(b) == [a.block_table[0], *b.block_table[1:3]]
    cache.check_invariants()
    cache.close(a)
    cache.close(b)
    assert cache.num_free_pages == 13 and cache.num_evictable_pages == 3
    cache.check_invariants()


def test_events_describe_stored_and_removed_blocks() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    seq = cache.open([1, 2, 3, 4, 5], namespace="t")
    cache.allocate(seq, 5)
    cache.commit(seq, [1, 2, 3, 4, 5])
    keys = chain_keys([1, 2, 3, 4, 5, 6], 2, "t")
    assert cache.drain_events() == [
        BlockStored(
            block_hashes=keys[:2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, namespace="t"
        )
    ]
    assert cache.drain_events() == []
    cache.allocate(seq, 1)
    cache.commit(seq, [6])
    assert cache.drain_events() == [BlockStored([keys[2]], keys[1], [5, 6], 2, "t")]
    cache.close(seq)
    assert cache.evict(1) == 1
    assert cache.drain_events() == [BlockRemoved([keys[2]], "t")]
    cache.reset()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.num_free_pages == 16 and cache.num_cached_pages == 0
    cache.check_invariants()


def test_reset_refuses_while_sequences_are_open() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    holder = run_prompt(cache, [1, 2, 3], close=False)
    run_prompt(cache, [5, 6, 7])
    cache.drain_events()
    before = snapshot(cache)
    with pytest.raises(PrefixCacheError, match="1 sequences open"):
        cache.reset()
    assert snapshot(cache) == before
    cache.close(holder)
    cache.reset()
    # Nothing computed before the reset matches after it, and a router is told so.
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.match([1, 2, 3]) == 0 and cache.match([5, 6, 7]) == 0
    assert cache.num_free_pages == 16 and cache.num_cached_pages == 0
    cache.check_invariants()


def test_events_can_be_turned_off() -> None:
    cache = PrefixCache(num_pages=16, page_size=2, record_events=False)
    run_prompt(cache, [1, 2, 3, 4, 5])
    cache.evict(1)
    cache.reset()
    assert cache.drain_events() == []


def test_out_of_pages_is_all_or_nothing() -> None:
    cache = PrefixCache(num_pages=6, page_size=2)
    holder = run_prompt(cache, [1, 2, 3, 4, 5], close=False)  # 3 pages held
    run_prompt(cache, [7, 8, 9])  # 1 cached, evictable, 1 freed
    seq = cache.open([20, 21, 22])
    assert cache.num_free_pages == 2 and cache.num_evictable_pages == 1
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match="need 4 pages but only 3") as info:
        cache.allocate(seq, 8)
    assert isinstance(info.value, PrefixCacheError)
    assert (info.value.needed, info.value.available) == (4, 3)
    assert snapshot(cache) == before
    cache.drain_events()
    cache.allocate(seq, 6)  # needs the evictable page too
    assert cache.drain_events() == [BlockRemoved(chain_keys([7, 8], 2))]
    assert cache.num_free_pages == 0 and cache.stats.evicted_pages == 1
    with pytest.raises(OutOfPages):
        cache.allocate(seq, 1)
    cache.close(holder)
    cache.allocate(seq, 1)
    cache.check_invariants()


def test_block_table_grows_by_doubling_and_keeps_pages() -> None:
    cache = PrefixCache(num_pages=512, page_size=1)
    seq = cache.open([3])
    # The arrays themselves, not their ids: a freed array's id can be reused by the next one.
    buffers = []
    for step in range(300):
        cache.allocate(seq, 1)
        cache.commit(seq, [step % 5])
        if not buffers or seq._pages is not buffers[-1]:
            buffers.append(seq._pages)
    assert seq.block_table.tolist() == list(range(300))
    assert seq.tokens.tolist() == [step % 5 for step in range(300)]
    assert len(buffers) <= 7  # doubling from 9 pages: a handful of buffers for 300 pages
    cache.check_invariants()


def test_cast_int_view_writes_through_as_c_int() -> None:
    # The view platforms whose numpy names int32 "l" get (here numpy names it "i"): writes and
    # array('i') copies go straight into the int32 buffer.
    buffer = np.zeros(4, dtype=np.int32)
    view = _cast_int_view(buffer)
    assert view.format == "i" and view.itemsize == 4 and len(view) == 4
    view[1:3] = array("i", [7, -2])
    view[3] = 2**31 - 1
    assert buffer.tolist() == [0, 7, -2, 2**31 - 1]


def test_accounting_partition() -> None:
    cache = PrefixCache(num_pages=40, page_size=3)
    rng = np.random.default_rng(0)
    live = []
    for _ in range(20):
        prompt = rng.integers(0, 2, int(rng.integers(1, 10))).tolist()
        live.append(run_prompt(cache, prompt, close=False))
        if len(live) > 3:
            cache.close(live.pop(0))
        held = {p for seq in live for p in seq.block_table.tolist()}
        assert cache.num_free_pages + cache.num_evictable_pages + len(held) == 40
        cache.check_invariants()


def test_stats_snapshot() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    assert cache.stats.hit_rate == 0.0
    run_prompt(cache, [1, 2, 3, 4, 5])
    run_prompt(cache, [1, 2, 3, 4, 6])
    stats = cache.stats
    assert isinstance(stats, CacheStats)
    assert (stats.query_tokens, stats.hit_tokens) == (10, 4)
    assert stats.hit_rate == pytest.approx(0.4)
    assert (stats.opened_sequences, stats.closed_sequences, stats.live_sequences) == (2, 2, 0)
    assert (stats.stored_pages, stats.duplicate_pages, stats.evicted_pages) == (2, 0, 0)
    assert (stats.free_pages, stats.cached_pages, stats.evictable_pages, stats.num_pages) == (14, 2, 2, 16)


def test_sequence_is_read_only() -> None:
    cache = PrefixCache(num_pages=4, page_size=2)
    seq = cache.open([1, 2, 3], namespace="n")
    assert seq.namespace == "n" and not seq.closed and "open" in repr(seq)
    with pytest.raises(AttributeError):
        seq.num_tokens = 5
    with pytest.raises(AttributeError):
        seq.extra = 1


def corrupt_cases():
    def free_page_twice(cache, seq):
        cache._pool.free.append(cache._pool.free[0])

    def leak_page(cache, seq):
        cache._pool.free.pop()

    def wrong_ref(cache, seq):
        seq._node.ref += 1

    def lost_lru_entry(cache, seq):
        cache._tree.recent.clear()

    def wrong_counter(cache, seq):
        cache._tree.num_unreferenced += 1

    def held_page_freed(cache, seq):
        cache._pool.free.append(int(seq.block_table[0]))

    def wrong_block_table(cache, seq):
        seq._pages[0] = cache._pool.free.pop()

    def wrong_tokens(cache, seq):
        seq._tokens[0] += 1

    # The prompts share their first page, so the first run has two children: the rest of the
    # held prompt's run, and the evictable leaf.
    def node_tokens_changed(cache, seq):
        node = seq._node
        node.tokens[:] = bytes(len(node.tokens))

    def stray_child(cache, seq):
        node = seq._node.parent
        node.children[b"stray"] = node

    def lost_child(cache, seq):
        node = seq._node.parent
        node.child = next(iter(node.children.values()))
        node.children = None

    def children_in_wrong_slot(cache, seq):
        node = seq._node.parent
        only = node.children.pop(seq._node.first_identity(8))
        node.children = {only.first_identity(8): only}

    def run_cut_short(cache, seq):
        node = seq._node
        del node.pages[-1:]

    def wrong_key(cache, seq):
        node = seq._node
        node.keys[-1] ^= 1

    def key_missing_from_index(cache, seq):
        seq._root.index.discard(seq._node.keys[-1])

    def held_count_wrong(cache, seq):
        seq._num_held -= 1

    def held_run_unlinked(cache, seq):
        # Out of the tree, counters and index adjusted: only the sequence still points at it.
        node = seq._node
        parent = node.parent
        del parent.children[node.first_identity(8)]
        (parent.child,) = parent.children.values()
        parent.children = None
        cache._tree.num_pages -= len(node.pages)
        seq._root.index.difference_update(node.keys)

    return [
        free_page_twice,
        leak_page,
        wrong_ref,
        lost_lru_entry,
        wrong_counter,
        held_page_freed,
        wrong_block_table,
        wrong_tokens,
        node_tokens_changed,
        stray_child,
        lost_child,
        children_in_wrong_slot,
        run_cut_short,
        wrong_key,
        key_missing_from_index,
        held_count_wrong,
        held_run_unlinked,
    ]


@pytest.mark.parametrize("corrupt", corrupt_cases())
def test_check_invariants_detects_corruption(corrupt) -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    run_prompt(cache, [1, 2, 7, 8, 9])  # an evictable leaf, so the LRU is not empty
    seq = run_prompt(cache, [1, 2, 3, 4, 5, 6, 7], close=False)
    assert len(seq._node.pages) == 2 and seq._node.parent.children is not None
    cache.check_invariants()
    corrupt(cache, seq)
    with pytest.raises(InvariantError):
        cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("num_pages", [63, 64, 65, 128, 200])
def test_long_chains_get_the_chained_keys(page_size: int, num_pages: int) -> None:
    # Long chains are hashed in chunks of pages: every page's key, across and after the chunk
    # boundaries, is still the plain chain, and a later commit extends it from its parent.
    cache = PrefixCache(num_pages=1024, page_size=page_size)
    prompt = [(7 * i) % 1000 for i in range(num_pages * page_size)]
    seq = run_prompt(cache, prompt, close=False)
    keys = chain_keys(prompt, page_size)
    assert len(keys) == num_pages
    assert cache.drain_events() == [BlockStored(keys, None, prompt, page_size)]
    tail = list(range(2000, 2000 + 70 * page_size))
    cache.allocate(seq, len(tail))
    cache.commit(seq, tail)
    more = chain_keys(prompt + tail, page_size)[num_pages:]
    assert cache.drain_events() == [BlockStored(more, keys[-1], tail, page_size)]
    cache.close(seq)
    cache.check_invariants()

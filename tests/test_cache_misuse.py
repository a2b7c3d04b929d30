"""Misuse that must neither corrupt the cache nor serve KV computed for other tokens: copies of
sequences, writes through the arrays it hands out, failing hash functions, memory errors, two
threads, resets, and unbounded event backlogs."""

from __future__ import annotations

import copy
import pickle
import threading
import types

import numpy as np
import pytest
from test_cache_helpers import chain_keys, run_prompt, snapshot

import prefix_cache.cache.sequence as sequence_module
from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.cache.hashing import default_hash_fn, namespace_seed
from prefix_cache.cache.page_pool import PagePool
from prefix_cache.cache.prefix_cache import ConcurrentUseError, InvariantError, PrefixCache


def test_a_sequence_cannot_be_copied() -> None:
    cache = PrefixCache(num_pages=8, page_size=2)
    seq = cache.open([1, 2, 3])
    cache.allocate(seq, 3)
    before = snapshot(cache)
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be"):
            duplicate(seq)
    assert snapshot(cache) == before
    cache.close(seq)
    cache.check_invariants()


def test_tokens_and_block_table_are_read_only() -> None:
    cache = PrefixCache(num_pages=8, page_size=2)
    seq = cache.open([1, 2, 3])
    cache.allocate(seq, 4)
    cache.commit(seq, [1])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="read-only"):
        seq.tokens[0] = 9
    with pytest.raises(ValueError, match="read-only"):
        seq.block_table[0] = 5
    assert snapshot(cache) == before
    cache.commit(seq, [2, 3, 4])
    assert seq.tokens.tolist() == [1, 2, 3, 4]
    cache.close(seq)
    assert cache.match([1, 2, 3, 4, 5]) == 4
    cache.check_invariants()


class FlakyHash:
    """The default hash until ``bad`` is set; then ``bad(data, parent)``'s result, or its error."""

    def __init__(self) -> None:
        self.bad = None

    def __call__(self, data: bytes, parent: int) -> object:
        if self.bad is None:
            return default_hash_fn(data, parent)
        return self.bad(data, parent)


def _raise(data: bytes, parent: int) -> int:
    raise RuntimeError("hash service down")


@pytest.mark.parametrize(
    "bad, error",
    [
        (_raise, RuntimeError),
        (lambda data, parent: "key", TypeError),
        (lambda data, parent: 1.5, TypeError),
        (lambda data, parent: np.uint64(3), TypeError),
        (lambda data, parent: True, TypeError),
        (lambda data, parent: -1, ValueError),
        (lambda data, parent: 2**64, ValueError),
    ],
)
def test_a_failing_hash_fn_leaves_commit_undone(bad, error) -> None:
    hash_fn = FlakyHash()
    cache = PrefixCache(num_pages=16, page_size=2, hash_fn=hash_fn)
    run_prompt(cache, [1, 2, 3])
    seq = cache.open([1, 2, 5, 6, 7, 8])
    cache.allocate(seq, 4)
    cache.drain_events()
    before = snapshot(cache)
    hash_fn.bad = bad
    with pytest.raises(error):
        cache.commit(seq, [5, 6, 7, 8])  # fills two pages
    assert snapshot(cache) == before
    cache.commit(seq, [5])  # fills no page: no hash
    before = snapshot(cache)
    with pytest.raises(error):
        cache.commit(seq, [6])  # the decode path fills a page
    assert snapshot(cache) == before
    assert seq.num_tokens == 3
    hash_fn.bad = None
    cache.commit(seq, [6, 7, 8])
    assert cache.drain_events() == [
        BlockStored(chain_keys([1, 2, 5, 6, 7, 8], 2)[1:], chain_keys([1, 2], 2)[0], [5, 6, 7, 8], 2)
    ]
    cache.close(seq)
    assert cache.match([1, 2, 5, 6, 7, 8, 9]) == 6
    cache.check_invariants()


@pytest.mark.parametrize("hash_fn", [lambda data: 1, lambda data, parent: "key", _raise, 42])
def test_a_hash_fn_with_the_wrong_signature_is_refused_at_construction(hash_fn) -> None:
    with pytest.raises(TypeError, match="hash_fn"):
        PrefixCache(num_pages=4, page_size=2, hash_fn=hash_fn)


class FailingNumpy(types.SimpleNamespace):
    """``numpy`` for ``prefix_cache.cache.sequence`` whose ``empty`` raises MemoryError."""

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    @staticmethod
    def empty(*args: object, **kwargs: object) -> np.ndarray:
        raise MemoryError


def test_memory_errors_in_open_and_allocate_change_nothing(monkeypatch) -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    run_prompt(cache, [1, 2, 3, 4, 5])
    seq = cache.open([1, 2, 3, 4, 5, 6, 7])
    cache.allocate(seq, 3)  # fills the buffers' headroom up to the next page only
    run_prompt(cache, [9, 9, 9])  # an evictable page, so allocate would evict
    before = snapshot(cache)
    monkeypatch.setattr(sequence_module, "np", FailingNumpy())
    with pytest.raises(MemoryError):
        cache.open([1, 2, 3, 4, 5, 9], namespace="fresh")
    with pytest.raises(MemoryError):
        cache.open([1, 2, 3, 4, 5, 9])
    with pytest.raises(MemoryError):
        cache.allocate(seq, 40)  # past the buffers' capacity: they must grow
    assert snapshot(cache) == before
    cache.check_invariants()
    monkeypatch.undo()
    cache.allocate(seq, 40)
    cache.close(seq)
    cache.check_invariants()


def test_memory_error_while_growing_at_the_edge_of_the_pool(monkeypatch) -> None:
    cache = PrefixCache(num_pages=12, page_size=1)
    seq = cache.open([1])
    cache.allocate(seq, 9)  # the buffers hold 9 pages: the next allocate must grow them
    run_prompt(cache, [4, 4])  # an evictable page
    before = snapshot(cache)
    monkeypatch.setattr(sequence_module, "np", FailingNumpy())
    with pytest.raises(MemoryError):
        cache.allocate(seq, 1)
    with pytest.raises(MemoryError):
        cache.allocate(seq, 3)  # would evict
    assert snapshot(cache) == before
    cache.check_invariants()


def test_concurrent_calls_fail_loudly() -> None:
    inside, proceed = threading.Event(), threading.Event()

    def slow_hash(data: bytes, parent: int) -> int:
        if data[0] == 77:
            inside.set()  # the main thread is inside commit, holding the cache
            proceed.wait(10)
        return default_hash_fn(data, parent)

    cache = PrefixCache(num_pages=32, page_size=2, hash_fn=slow_hash)
    run_prompt(cache, [1, 2, 3])
    other = cache.open([5, 6, 7])
    cache.allocate(other, 4)
    seq = cache.open([77, 1, 2])
    cache.allocate(seq, 3)
    errors: list[BaseException] = []

    def intrude() -> None:
        inside.wait(10)
        for call in (
            lambda: cache.open([1, 2, 3]),
            lambda: cache.match([1, 2, 3]),
            lambda: cache.allocate(other, 8),
            lambda: cache.commit(other, [5, 6]),
            lambda: cache.close(other),
            lambda: cache.evict(1),
            lambda: cache.reset(),
            lambda: cache.drain_events(),
        ):
            try:
                call()
            except ConcurrentUseError as error:
                errors.append(error)
        proceed.set()

    thread = threading.Thread(target=intrude)
    thread.start()
    cache.commit(seq, [77, 1, 2])
    thread.join()
    assert len(errors) == 8 and "two threads" in str(errors[0])
    # The intruder changed nothing: other's tokens, pages and the tree are as they were.
    assert other.num_tokens == 0 and not other.closed and len(other.block_table) == 2
    cache.check_invariants()
    cache.close(seq)
    cache.close(other)
    cache.check_invariants()


def test_reset_invalidates_everything_and_says_so() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    run_prompt(cache, [1, 2, 3, 4, 5])
    run_prompt(cache, [7, 8, 9], namespace="t")
    cache.drain_events()
    cache.reset()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.match([1, 2, 3, 4, 5]) == 0 and cache.match([7, 8, 9], "t") == 0
    assert cache.num_free_pages == 16
    cache.reset()  # an empty cache: still announced
    assert cache.drain_events() == [AllBlocksCleared()]
    cache.check_invariants()


def test_take_zero_pages_takes_nothing() -> None:
    pool = PagePool(4)
    assert pool.take(0).tolist() == [] and pool.free.tolist() == [3, 2, 1, 0]
    assert pool.take(2).tolist() == [0, 1] and pool.free.tolist() == [3, 2]


def test_collision_pages_counts_pages() -> None:
    cache = PrefixCache(num_pages=32, page_size=1, hash_fn=lambda data, parent: 7)
    run_prompt(cache, [1, 2, 3, 4, 5])  # page [1] cached; [2], [3], [4], [5] collide
    assert cache.stats.collision_pages == 4
    seq = run_prompt(cache, [1, 2, 3], close=False)  # [1] matched; [2] collides, [3] follows
    assert cache.stats.collision_pages == 4 + 2
    cache.allocate(seq, 2)
    cache.commit(seq, [8, 9])  # two more pages of a broken chain
    assert cache.stats.collision_pages == 4 + 2 + 2
    cache.check_invariants()


def _prefixes(events: list, model: dict) -> None:
    """Apply events to ``model`` (namespace, key) -> (namespace, prefix tokens)."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            model.clear()
        elif isinstance(event, BlockRemoved):
            for key in event.block_hashes:
                del model[(event.namespace, key)]
        else:
            ns = event.namespace
            prefix = () if event.parent_block_hash is None else model[(ns, event.parent_block_hash)][1]
            for i, key in enumerate(event.block_hashes):
                prefix = (*prefix, *event.token_ids[i * event.block_size : (i + 1) * event.block_size])
                model[(ns, key)] = (ns, prefix)


def cached_prefixes(cache: PrefixCache) -> set:
    """The tree's cached prefixes, read from the nodes (for comparison with a consumer's view)."""
    found = set()
    page_size = cache.page_size
    for node in cache._tree.nodes():
        tokens: list[int] = []
        walk = node.parent
        while walk.parent is not None:
            tokens[:0] = np.frombuffer(walk.tokens, dtype=np.int32).tolist()
            walk = walk.parent
        run = np.frombuffer(node.tokens, dtype=np.int32).tolist()
        for end in range(page_size, len(run) + 1, page_size):  # every page of the run
            found.add((walk.namespace, tuple(tokens + run[:end])))
    return found


def test_event_backlog_is_capped_and_resynchronises() -> None:
    cache = PrefixCache(num_pages=64, page_size=2, max_events=5)
    model: dict = {}
    rng = np.random.default_rng(3)
    overflowed = 0
    for round_ in range(30):
        for _ in range(int(rng.integers(0, 6))):
            prompt = rng.integers(0, 3, int(rng.integers(2, 12))).tolist()
            run_prompt(cache, prompt, namespace=int(rng.integers(0, 2)))
            cache.evict(int(rng.integers(0, 3)))
            assert len(cache._events.pending) <= 5
        events = cache.drain_events()
        if events and isinstance(events[0], AllBlocksCleared):
            overflowed += 1
            assert all(isinstance(event, BlockStored) for event in events[1:])
        _prefixes(events, model)
        assert set(model.values()) == cached_prefixes(cache), round_
        for (ns, key), (_, prefix) in model.items():
            assert key == chain_keys(list(prefix), 2, ns)[-1]
    assert overflowed >= 5
    cache.check_invariants()


def test_max_events_is_checked() -> None:
    for name in ("max_events", "max_event_bytes"):
        for bad, error in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match=name):
                PrefixCache(num_pages=4, **{name: bad})


def test_event_backlog_is_capped_in_bytes_too() -> None:
    # One long prefill is one event holding its whole prompt: the byte cap bounds memory where a
    # count of events would not, and the drain after the overflow describes the cache exactly.
    page_size, pages = 16, 64
    event_bytes = pages * page_size * 4 + pages * 8  # the prompt's token ids and block hashes
    prompt = np.arange(pages * page_size + 1, dtype=np.int32)
    for cap, overflows in ((event_bytes, False), (event_bytes - 1, True)):
        cache = PrefixCache(num_pages=256, page_size=page_size, max_event_bytes=cap)
        run_prompt(cache, prompt.tolist())
        assert cache._events.num_bytes <= cap
        events = cache.drain_events()
        assert isinstance(events[0], AllBlocksCleared) == overflows
        stored = [event for event in events if isinstance(event, BlockStored)]
        assert sum(len(event.block_hashes) for event in stored) == pages
        assert [t for event in stored for t in event.token_ids] == prompt[:-1].tolist()
        run_prompt(cache, prompt.tolist())  # all cached: nothing new to say, and nothing kept
        assert cache.drain_events() == [] and cache._events.num_bytes == 0


def test_block_removed_names_its_namespace() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    run_prompt(cache, [1, 2, 3], namespace="a")
    run_prompt(cache, [1, 2, 3], namespace="b")
    cache.drain_events()
    assert cache.evict(2) == 2
    key_a, key_b = chain_keys([1, 2], 2, "a")[0], chain_keys([1, 2], 2, "b")[0]
    assert cache.drain_events() == [BlockRemoved([key_a], "a"), BlockRemoved([key_b], "b")]
    assert key_a != key_b and namespace_seed("a") != namespace_seed("b")


def _with_private_copy() -> tuple[PrefixCache, object]:
    """A cache where sequence ``b`` holds a cached page and keeps its own copy of it."""
    cache = PrefixCache(num_pages=16, page_size=2)
    a = cache.open([1, 2, 3])
    b = cache.open([1, 2, 3])
    cache.allocate(a, 3)
    cache.allocate(b, 3)
    cache.commit(a, [1, 2, 3])
    cache.commit(b, [1, 2, 3])
    assert len(b._dups) == 1
    cache.check_invariants()
    return cache, b


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda cache, b: b._dups.clear(),  # the copy is leaked
        lambda cache, b: cache._pool.free.append(b._dups[0]),  # the copy is also free
        lambda cache, b: b._tokens.__setitem__(0, 9),  # its tokens differ from the cached page's
        lambda cache, b: b._dups.__setitem__(0, cache._pool.free[-1]),  # the record names another page
    ],
)
def test_check_invariants_checks_private_copies(corrupt) -> None:
    cache, b = _with_private_copy()
    corrupt(cache, b)
    with pytest.raises(InvariantError):
        cache.check_invariants()

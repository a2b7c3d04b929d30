"""The block tree's runs: a node holds a run of pages, split where prompts diverge, extended in
place by the one sequence that holds its leaf, and evicted from its end. Behaviour (matches,
block tables, events) is checked against keys computed without the tree; node counts show that
the work is per run."""

from __future__ import annotations

import pytest
from test_cache_helpers import chain_keys, held_nodes, run_prompt

from prefix_cache.cache.events import BlockRemoved, BlockStored
from prefix_cache.cache.prefix_cache import PrefixCache


def runs(cache: PrefixCache) -> list[list[int]]:
    """The page ids of every node's run, sorted (once the deferred decode pages are cached)."""
    assert cache.num_cached_pages >= 0  # caches the deferred pages
    return sorted(node.pages.tolist() for node in cache._tree.nodes())


def test_a_prompt_is_one_run_and_splits_where_another_diverges() -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    base = list(range(1, 21))  # ten pages
    first = run_prompt(cache, [*base, 0], close=False)
    assert runs(cache) == [list(range(10))]
    assert cache.match([*base[:9], 77, *base[10:], 0]) == 8  # the page's second token differs
    assert cache.match([*base[:18], 0]) == 18  # the prompt ends inside the run
    assert runs(cache) == [list(range(10))]  # match changes nothing
    branch = [*base[:8], 50, 51, 52, 53, 0]
    second = run_prompt(cache, branch, close=False)
    assert second.block_table[:4].tolist() == first.block_table[:4].tolist()
    # The run is cut after its fourth page; the branch hangs there.
    assert runs(cache) == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [11, 12]]
    assert [node.pages.tolist() for node in held_nodes(first)] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert [node.ref for node in held_nodes(first)] == [2, 1]
    assert cache.match(branch) == 12
    assert cache.match([*base[:8], 50, 51, 52, 99, 0]) == 10
    assert cache.match([*base, 0]) == 20
    keys = chain_keys(branch, 2)
    assert cache.drain_events()[-1] == BlockStored(keys[4:], keys[3], branch[8:12], 2, None)
    # A prompt that ends inside the tail run splits it again, and holds only the head.
    third = cache.open([*base[:14], 5])
    assert third.block_table.tolist() == list(range(7))
    assert runs(cache) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [11, 12]]
    for seq in (first, second, third):
        cache.close(seq)
        cache.check_invariants()
    assert cache.num_evictable_pages == 12


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("batch", [False, True])
def test_decoded_pages_are_matched_as_soon_as_committed(page_size: int, batch: bool) -> None:
    """The decode path defers full pages to a batch: every call that can see them sees them."""
    cache = PrefixCache(num_pages=256, page_size=page_size)
    prompt = [5, 6, 7, 8]
    seq, other = cache.admit(prompt), cache.admit([1])
    cache.commit(seq, prompt)
    stream = list(prompt)
    for token in range(100, 130):
        if batch:
            cache.allocate_batch([seq, other], 1)
            cache.commit_batch([seq, other], [token, 1])
        else:
            cache.allocate(seq, 1)
            cache.commit(seq, [token])
        stream.append(token)
        full = len(stream) // page_size * page_size
        assert cache.match([*stream, 0]) == full
        assert cache.num_cached_pages == full // page_size + len(other.tokens) // page_size
    twin = cache.open([*stream, 0])
    assert twin.num_cached_tokens == full
    assert twin.block_table.tolist() == seq.block_table.tolist()[: full // page_size]
    cache.close(seq)
    cache.check_invariants()


def test_decode_extends_the_own_leaf_run_in_place() -> None:
    cache = PrefixCache(num_pages=256, page_size=1)
    prompt = [5, 6, 7, 8]
    decoded = list(range(100, 200))
    seq = cache.admit(prompt)
    cache.commit(seq, prompt)
    for token in decoded:
        cache.allocate(seq, 1)
        cache.commit(seq, [token])
    assert len(cache._tree.nodes()) == 1  # one run of 104 pages, not a node per page
    assert cache.num_cached_pages == 104
    cache.check_invariants()
    keys = chain_keys([*prompt, *decoded], 1)
    events = cache.drain_events()
    assert events[0] == BlockStored(keys[:4], None, prompt, 1, None)
    # The decoded pages were cached in one batch, announced by one event.
    assert events[1:] == [BlockStored(keys[4:], keys[3], decoded, 1, None)]
    # A second sequence holds the run's head: its pages go into a run of its own, while the first
    # sequence, alone on the tail, still grows it.
    other = cache.open([*prompt, 0])
    cache.allocate(other, 2)
    cache.commit(other, [0, 42])
    cache.allocate(seq, 1)
    cache.commit(seq, [9])
    assert runs(cache) == [[0, 1, 2, 3], [*range(4, 104), 106], [104, 105]]
    # A third one holds the whole tail: the first sequence's next page starts a run of its own.
    third = cache.open([*prompt, *decoded, 9, 1])
    assert third.num_cached_tokens == 105
    cache.allocate(seq, 1)
    cache.commit(seq, [10])
    assert runs(cache) == [[0, 1, 2, 3], [*range(4, 104), 106], [104, 105], [107]]
    assert cache.match([*prompt, 0, 42, 1]) == 6 and cache.match([*prompt, *decoded, 9, 10, 1]) == 106
    for held in (seq, other, third):
        cache.close(held)
    cache.check_invariants()


def test_eviction_trims_a_run_from_its_end() -> None:
    cache = PrefixCache(num_pages=8, page_size=1)
    prompt = [1, 2, 3, 4, 5, 6, 0]
    run_prompt(cache, prompt)  # seven pages, one run
    keys = chain_keys(prompt, 1)
    cache.drain_events()
    assert cache.evict(3) == 3  # the run's last three pages, deepest first
    assert cache.drain_events() == [BlockRemoved(keys[:3:-1], None)]
    assert runs(cache) == [[0, 1, 2, 3]] and cache.num_evictable_pages == 4
    cache.check_invariants()
    assert cache.match(prompt) == 4
    # The trimmed run is still the oldest candidate; a newer run waits behind it.
    run_prompt(cache, [9, 9, 0])
    assert cache.evict(1) == 1
    assert cache.match(prompt) == 3 and cache.match([9, 9, 0]) == 2
    # Allocations of one page with the pool empty take pages from the end of the oldest run.
    cache.drain_events()
    seq = cache.open([7])
    for _ in range(4):
        cache.allocate(seq, 1)
        cache.check_invariants()
    assert cache.num_free_pages == 0
    assert cache.match(prompt) == 1 and cache.match([9, 9, 0]) == 2
    assert [key for event in cache.drain_events() for key in event.block_hashes] == keys[2:0:-1]
    cache.close(seq)
    # Decoding re-caches pages below the trimmed run, in the same run.
    seq = cache.open([1, 2])
    cache.allocate(seq, 2)
    for token in (2, 3):
        cache.commit(seq, [token])
    cache.close(seq)
    assert cache.match(prompt) == 3 and runs(cache) == [[0, 1, 2], [4, 5, 6]]
    cache.check_invariants()


def test_twins_inside_a_run_split_it() -> None:
    # Two sequences compute the same prompt; the second one's prompt ends inside the first one's
    # run, so it holds the run's head and keeps its own copies private.
    cache = PrefixCache(num_pages=32, page_size=2)
    long, short = list(range(1, 13)), list(range(1, 8))
    a, b = cache.open(long), cache.open(short)
    cache.allocate(a, len(long))
    cache.allocate(b, len(short))
    cache.commit(a, long)
    table = b.block_table.tolist()
    cache.commit(b, short)
    assert b.block_table.tolist() == table  # append-only: its copies stay in its table
    assert [node.pages.tolist() for node in held_nodes(b)] == [a.block_table[:3].tolist()]
    assert runs(cache) == [[0, 1, 2], [3, 4, 5]]
    assert cache.stats.duplicate_pages == 3
    cache.close(a)
    cache.check_invariants()
    assert cache.num_evictable_pages == 3  # the tail; b holds the head
    cache.close(b)
    assert cache.num_evictable_pages == 6 and cache.num_free_pages == 32 - 6
    cache.check_invariants()


def test_a_parent_orphaned_by_eviction_keeps_its_place_in_the_lru() -> None:
    cache = PrefixCache(num_pages=10, page_size=1)
    run_prompt(cache, [1, 2, 3, 0])  # one run, released first
    run_prompt(cache, [1, 2, 5, 0])  # splits it: [1, 2] with children [3, 0] and [5, 0]
    run_prompt(cache, [8, 8, 8, 0])  # the newest run
    assert cache.evict(2) == 2  # [3, 0]
    # [5, 0] goes whole; its parent [1, 2], orphaned and older than [8, 8, 8, 0], is next: one of
    # its pages goes in the same call and the rest waits, still the oldest candidate.
    assert cache.evict(3) == 3
    cache.check_invariants()
    assert cache.match([1, 2, 0]) == 1 and cache.match([8, 8, 8, 0]) == 3
    assert cache.evict(1) == 1
    assert cache.match([1, 2, 0]) == 0 and cache.match([8, 8, 8, 0]) == 3
    cache.check_invariants()


def test_a_single_page_allocation_evicts_an_older_orphaned_parent_first() -> None:
    cache = PrefixCache(num_pages=10, page_size=1)
    run_prompt(cache, [1, 2, 3, 0])
    run_prompt(cache, [1, 2, 5, 0])
    run_prompt(cache, [8, 8, 8, 0])
    assert cache.evict(2) == 2 and cache.evict(2) == 2  # [3, 0], then [5, 0]: [1, 2] is orphaned
    seq = cache.open([9])
    for _ in range(5):  # four free pages, then one evicted: the end of [1, 2], not of the newer run
        cache.allocate(seq, 1)
    assert cache.match([1, 2, 0]) == 1 and cache.match([8, 8, 8, 0]) == 3
    cache.close(seq)
    cache.check_invariants()


def test_new_pages_after_twins_that_end_inside_a_run() -> None:
    cache = PrefixCache(num_pages=32, page_size=2)
    long, forked = list(range(1, 13)), [1, 2, 3, 4, 9, 9, 9]
    a, c = cache.open(long), cache.open(forked)
    cache.allocate(a, len(long))
    cache.allocate(c, len(forked))
    cache.commit(a, long)
    cache.drain_events()
    cache.commit(c, forked)  # two twins inside a's run, then a page of its own below them
    keys = chain_keys(forked, 2)
    assert cache.drain_events() == [BlockStored(keys[2:], keys[1], [9, 9], 2, None)]
    assert runs(cache) == [[0, 1], [2, 3, 4, 5], [8]]
    assert cache.match([*forked, 0]) == 6
    cache.close(a)
    cache.close(c)
    cache.check_invariants()


def test_a_commit_that_reaches_waiting_pages_finds_them_cached_first() -> None:
    """Another sequence commits the blocks a decoding sequence has waiting: as when each page is
    cached at its commit, the decoding sequence's pages are the cached ones, the other's copies."""
    cache = PrefixCache(num_pages=64, page_size=1)
    first = cache.admit([1, 2, 3, 4])
    cache.commit(first, [1, 2, 3, 4])
    second = cache.open([1, 2, 9])  # holds [1, 2]: the run splits, [3, 4] is the first's alone
    for token in (5, 6):  # wait at the end of the first's run
        cache.allocate(first, 1)
        cache.commit(first, [token])
    cache.allocate(second, 4)
    cache.commit(second, [3, 4, 5, 6])
    assert cache.stats.duplicate_pages == 4
    third = cache.open([1, 2, 3, 4, 5, 6, 0])
    assert third.block_table.tolist() == first.block_table.tolist()[:6]
    cache.check_invariants()

"""Page accounting at the edges of the engine calls: blocks computed twice at the same time, the
buffers ``write_block_tables`` is given, and what ``admit`` costs before it refuses.

The accounting every test here ends on: each page is free, evictable, or in the block table of a
live sequence (``free + evictable + distinct pages of live block tables == num_pages``), which
``check_invariants`` checks too."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import numpy as np
import pytest
from test_cache_helpers import run_prompt, snapshot

from prefix_cache.cache.prefix_cache import OutOfPages, PrefixCache
from prefix_cache.cache.sequence import Sequence


def live_pages(seqs: list[Sequence]) -> set[int]:
    return {page for seq in seqs if not seq.closed for page in seq.block_table.tolist()}


def assert_accounted(cache: PrefixCache, seqs: list[Sequence]) -> None:
    cache.check_invariants()
    pages = cache.num_free_pages + cache.num_evictable_pages + len(live_pages(seqs))
    assert pages == cache.num_pages


@pytest.mark.parametrize("page_size", [1, 2])
def test_pages_of_a_closed_sequence_its_twin_still_holds_are_not_lost(page_size: int) -> None:
    """Two sequences commit the same prompt; the first closes: its cached pages are in no live
    block table, so they must be free or evictable, and the prompt still matches."""
    cache = PrefixCache(num_pages=32, page_size=page_size)
    prompt = list(range(1, 3 * page_size + 1))  # three full pages
    a, b = cache.open(prompt), cache.open(prompt)
    for seq in (a, b):
        cache.allocate(seq, len(prompt))
        cache.commit(seq, prompt)
    b_table = b.block_table.tolist()
    assert_accounted(cache, [a, b])
    cache.close(a)
    assert_accounted(cache, [b])
    assert b.block_table.tolist() == b_table  # append-only
    assert cache.match([*prompt, 0]) == 3 * page_size
    # b's reply is cached below the prompt, and b's pages hold the KV the prompt matches.
    cache.allocate(b, page_size)
    cache.commit(b, [7] * page_size)
    assert_accounted(cache, [b])
    c = cache.open([*prompt, *[7] * page_size, 9])
    assert c.num_cached_tokens == 4 * page_size
    assert c.block_table.tolist() == b.block_table.tolist()[:4]
    cache.close(b)
    assert_accounted(cache, [c])
    cache.close(c)
    assert cache.num_evictable_pages == 4 and cache.num_free_pages == 28
    assert_accounted(cache, [])


def test_twin_of_an_evictable_block_takes_its_place() -> None:
    """The first copy's sequence closed before the second commits: the second's copy is the one
    a live block table holds, so the cached block becomes that copy and the first is freed."""
    cache = PrefixCache(num_pages=16, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    b = cache.open(prompt)
    run_prompt(cache, prompt)  # cached, then its sequence closed: evictable
    assert cache.num_evictable_pages == 2
    cache.allocate(b, len(prompt))
    cache.commit(b, prompt)
    assert_accounted(cache, [b])
    assert cache.num_evictable_pages == 0
    c = cache.open(prompt)
    assert c.block_table.tolist() == b.block_table.tolist()[:2]


def test_twins_with_several_holders() -> None:
    """Three sequences compute the same prompt; the original and then one copy close."""
    cache = PrefixCache(num_pages=24, page_size=2)
    prompt = [5, 6, 7, 8, 9]
    seqs = [cache.open(prompt) for _ in range(3)]
    for seq in seqs:
        cache.allocate(seq, len(prompt))
        cache.commit(seq, prompt)
    assert_accounted(cache, seqs)
    for closing in range(3):
        cache.close(seqs[closing])
        assert_accounted(cache, seqs)
        assert cache.match(prompt) == 4
    assert cache.num_evictable_pages == 2


def test_write_block_tables_holds_no_callers_buffer() -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    seqs = [cache.admit([i, i + 1, i + 2]) for i in range(3)]
    buffer = np.zeros((4, 8), dtype=np.int32)
    assert cache.write_block_tables(seqs, buffer) == 6
    gone = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert gone() is None


def test_write_block_tables_with_a_new_view_each_step() -> None:
    """``tables[:n]`` each step: a new view every call, only new entries written, no growth."""
    cache = PrefixCache(num_pages=4096, page_size=1)
    seqs = [cache.admit([i, i + 1]) for i in range(4)]
    tables = np.full((8, 1024), -1, dtype=np.int32)
    assert cache.write_block_tables(seqs, tables[:4]) == 8
    for step in range(200):
        cache.allocate_batch(seqs, 1)
        assert cache.write_block_tables(seqs, tables[: len(seqs)]) == len(seqs)
        cache.commit_batch(seqs, [step % 7] * len(seqs))
    for row, seq in enumerate(seqs):
        assert tables[row, : len(seq.block_table)].tolist() == seq.block_table.tolist()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            assert cache.write_block_tables(seqs, tables[: len(seqs)]) == 0
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 10_000


def test_write_block_tables_into_a_fresh_buffer_writes_whole_rows() -> None:
    """A new buffer (even at the address of a dead one) gets every entry."""
    cache = PrefixCache(num_pages=64, page_size=2)
    seqs = [cache.admit([i, i + 1, i + 2]) for i in range(3)]
    for _ in range(20):
        buffer = np.full((4, 8), -1, dtype=np.int32)
        assert cache.write_block_tables(seqs, buffer) == 6
        assert buffer[:3, :2].tolist() == [seq.block_table.tolist() for seq in seqs]
        del buffer


@pytest.mark.parametrize("extra", [10**8, 10**12])
def test_admit_refuses_a_huge_request_before_sizing_anything(extra: int) -> None:
    cache = PrefixCache(num_pages=64, page_size=16)
    run_prompt(cache, list(range(40)))
    before = snapshot(cache)
    tracemalloc.start()
    try:
        with pytest.raises(OutOfPages):
            cache.admit(list(range(40)), extra_tokens=extra)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    assert snapshot(cache) == before


def test_admit_of_no_tokens_takes_no_page() -> None:
    cache = PrefixCache(num_pages=4, page_size=2)
    empty = cache.admit([])  # with a free page
    assert len(empty.block_table) == 0 and cache.num_free_pages == 4
    run_prompt(cache, [1, 2, 3, 4, 5])  # a cached run of two pages, evictable
    held = cache.admit([9, 9, 9])  # the free pages
    assert cache.num_free_pages == 0 and cache.num_evictable_pages == 2
    seq = cache.admit([])  # a full pool: nothing to evict for it
    assert len(seq.block_table) == 0 and seq.num_allocated_tokens == 0
    assert cache.num_evictable_pages == 2 and cache.num_free_pages == 0
    assert_accounted(cache, [empty, held, seq])
    one = cache.admit([], extra_tokens=1)
    assert len(one.block_table) == 1 and cache.num_evictable_pages == 1
    assert_accounted(cache, [empty, held, seq, one])


def test_write_block_tables_into_a_buffer_over_a_bytearray() -> None:
    """A buffer whose memory a bytearray owns is known through it: only new entries are written,
    and a new bytearray gets whole rows."""
    cache = PrefixCache(num_pages=64, page_size=2)
    seqs = [cache.admit([i, i + 1, i + 2]) for i in range(3)]
    for _ in range(3):
        buffer = np.frombuffer(bytearray(4 * 4 * 8), dtype=np.int32).reshape(4, 8)
        assert cache.write_block_tables(seqs, buffer) == 6
        assert cache.write_block_tables(seqs, buffer[:3]) == 0
        assert buffer[:3, :2].tolist() == [seq.block_table.tolist() for seq in seqs]

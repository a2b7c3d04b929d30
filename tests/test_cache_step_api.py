"""The per-step API: all-or-nothing admission, rollback of speculative slots, batch calls."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_helpers import run_prompt, snapshot

from prefix_cache.cache.prefix_cache import OutOfPages, PrefixCache


def test_admit_opens_and_allocates_the_uncached_prompt() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    run_prompt(cache, [1, 2, 3, 4, 5])
    seq = cache.admit([1, 2, 3, 4, 9, 9, 9], extra_tokens=2)
    assert seq.num_cached_tokens == 4 and seq.num_tokens == 4
    assert seq.num_allocated_tokens == 9 and len(seq.block_table) == 5
    cache.commit(seq, [9, 9, 9])
    assert cache.stats.opened_sequences == 2
    cache.close(seq)
    cache.check_invariants()


def test_admit_refusal_changes_nothing() -> None:
    cache = PrefixCache(num_pages=6, page_size=2)
    run_prompt(cache, [1, 2, 3, 4, 5])  # pages [1, 2] and [3, 4] cached, evictable
    holder = run_prompt(cache, [7, 8, 7], close=False)  # 2 pages held
    assert cache.num_free_pages == 2 and cache.num_evictable_pages == 2
    before = snapshot(cache)
    # 4 pages free or evictable, but 2 of them are this prompt's cached prefix: only 2 left for
    # the 3 uncached pages.
    with pytest.raises(OutOfPages, match="need 3 pages but only 2") as info:
        cache.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (info.value.needed, info.value.available) == (3, 2)
    assert snapshot(cache) == before  # no LRU stamp, no statistics, no events
    with pytest.raises(OutOfPages):
        cache.admit([9] * 9)  # 5 pages
    assert snapshot(cache) == before
    seq = cache.admit([1, 2, 3, 4, 5, 6])  # 1 uncached page: fits
    assert seq.num_cached_tokens == 4 and len(seq.block_table) == 3
    cache.close(seq)
    cache.close(holder)
    cache.check_invariants()


def test_admit_checks_its_arguments() -> None:
    cache = PrefixCache(num_pages=4, page_size=2)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="extra_tokens"):
        cache.admit([1, 2], extra_tokens=-1)
    with pytest.raises(TypeError, match="extra_tokens"):
        cache.admit([1, 2], extra_tokens=1.0)
    with pytest.raises(TypeError, match="namespace"):
        cache.admit([1, 2], namespace=1.5)
    assert snapshot(cache) == before


def test_rollback_gives_back_rejected_draft_slots() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    seq = cache.open([1, 2, 3])
    cache.allocate(seq, 3)
    cache.commit(seq, [1, 2, 3])
    table = seq.block_table.tolist()
    cache.allocate(seq, 5)  # 5 draft tokens: slots 3 .. 7, two more pages
    assert len(seq.block_table) == 4
    free = cache.num_free_pages
    cache.commit(seq, [4])  # one draft accepted
    cache.rollback(seq, seq.num_tokens)
    assert seq.num_allocated_tokens == 4 and seq.block_table.tolist() == table
    assert cache.num_free_pages == free + 2
    cache.check_invariants()
    # The rejected drafts never reach a cached page: the next tokens fill the page.
    cache.allocate(seq, 1)
    cache.commit(seq, [5])
    cache.close(seq)
    assert cache.match([1, 2, 3, 4, 5, 0]) == 4
    cache.check_invariants()


def test_rollback_cannot_drop_committed_tokens() -> None:
    cache = PrefixCache(num_pages=16, page_size=2)
    seq = cache.open([1, 2, 3])
    cache.allocate(seq, 4)
    cache.commit(seq, [1, 2, 3])
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[3, 4\]"):
        cache.rollback(seq, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.rollback(seq, 5)
    assert snapshot(cache) == before
    cache.rollback(seq, 4)  # nothing to give back
    assert snapshot(cache) == before


def test_allocate_batch_and_commit_batch() -> None:
    cache = PrefixCache(num_pages=32, page_size=2)
    seqs = [run_prompt(cache, [1, 2, i], close=False) for i in range(4)]
    for step in range(5):
        cache.allocate_batch(seqs, 1)
        cache.commit_batch(seqs, np.arange(4, dtype=np.int32) + 10 * step)
    for i, seq in enumerate(seqs):
        assert seq.tokens.tolist() == [1, 2, i, *(i + 10 * step for step in range(5))]
    cache.check_invariants()
    for seq in seqs:
        cache.close(seq)
    assert cache.match([1, 2, 3, 3, 13, 23, 0]) == 6
    cache.check_invariants()


def test_batch_calls_are_all_or_nothing() -> None:
    cache = PrefixCache(num_pages=5, page_size=2)
    a = run_prompt(cache, [1, 2], close=False)  # 1 page, full: the next token needs a page
    b = run_prompt(cache, [3, 4, 5], close=False)  # 2 pages, room for 1 token
    c = run_prompt(cache, [6, 7], close=False)  # 1 page, full
    assert cache.num_free_pages == 1
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match="need 2 pages but only 1"):
        cache.allocate_batch([a, b, c], 1)
    assert snapshot(cache) == before
    with pytest.raises(ValueError, match="no reserved slot"):
        cache.commit_batch([b, a], [0, 0])  # b has a slot, a does not
    with pytest.raises(ValueError, match="2 entries for 1"):
        cache.commit_batch([b], [0, 0])
    with pytest.raises(ValueError, match="twice"):
        cache.allocate_batch([b, b], 1)
    with pytest.raises(TypeError, match="list"):
        cache.allocate_batch(b, 1)
    assert snapshot(cache) == before
    cache.close(c)
    with pytest.raises(ValueError, match="closed"):
        cache.allocate_batch([a, c], 1)
    cache.allocate_batch([a, b], 1)
    cache.commit_batch([a, b], [8, 9])
    cache.check_invariants()


def test_write_block_tables_touches_only_new_entries() -> None:
    cache = PrefixCache(num_pages=64, page_size=2)
    seqs = [run_prompt(cache, [i, i, i], close=False) for i in range(3)]
    out = np.full((4, 16), -1, dtype=np.int32)
    assert cache.write_block_tables(seqs, out, rows=[2, 0, 1]) == 6
    assert out[2, :2].tolist() == seqs[0].block_table.tolist()
    assert cache.write_block_tables(seqs, out, rows=[2, 0, 1]) == 0  # nothing changed
    out[2, 0] = -7  # the buffer is not read back: entries already written are not rewritten
    cache.allocate_batch(seqs, 2)  # a new page each
    assert cache.write_block_tables(seqs, out, rows=[2, 0, 1]) == 3
    assert out[2, 0] == -7 and out[2, 2] == seqs[0].block_table[2]
    # A row that another sequence wrote in between is written in full.
    assert cache.write_block_tables([seqs[1]], out, rows=[2]) == 3
    assert cache.write_block_tables([seqs[0]], out, rows=[2]) == 3
    assert out[2, :3].tolist() == seqs[0].block_table.tolist()
    # After a rollback that removed pages the row is rewritten from the start.
    cache.rollback(seqs[0], seqs[0].num_tokens)
    cache.allocate(seqs[0], 3)
    assert cache.write_block_tables([seqs[0]], out, rows=[2]) == len(seqs[0].block_table)
    assert out[2, : len(seqs[0].block_table)].tolist() == seqs[0].block_table.tolist()
    # A second buffer has its own record.
    other = np.zeros((4, 16), dtype=np.int32)
    assert cache.write_block_tables(seqs, other) == sum(len(s.block_table) for s in seqs)
    cache.check_invariants()


def test_write_block_tables_checks_its_arguments() -> None:
    cache = PrefixCache(num_pages=64, page_size=1)
    seq = run_prompt(cache, [1, 2, 3, 4, 5], close=False)
    with pytest.raises(TypeError, match="int32"):
        cache.write_block_tables([seq], np.zeros((2, 8), dtype=np.int64))
    with pytest.raises(ValueError, match="5 pages, out has room for 3"):
        cache.write_block_tables([seq], np.zeros((2, 4), dtype=np.int32)[:, :3])
    with pytest.raises(ValueError, match="past out's 2 rows"):
        cache.write_block_tables([seq], np.zeros((2, 8), dtype=np.int32), rows=[2])
    with pytest.raises(ValueError, match="rows"):
        cache.write_block_tables([seq], np.zeros((2, 8), dtype=np.int32), rows=[-1])

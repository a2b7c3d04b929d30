"""Write-through for the host tier (``PrefixCache(..., write_through=True)``): single behaviours.
Random traffic against a byte model is ``tests/test_cache_tiers.py``, whose machine draws it."""

from __future__ import annotations

import pytest

from prefix_cache import PrefixCache
from prefix_cache.cache.events import BlockRemoved, BlockStored
from prefix_cache.events import BlockIndex


def done(cache: PrefixCache, ok: bool = True) -> int:
    """Take the queued copies and report them; the number of saves they held."""
    batch = cache.take_transfers()
    if batch is None:
        return 0
    cache.transfers_done(batch, ok=ok)
    return len(batch.saves)


def compute(cache: PrefixCache, prompt: list[int], namespace: object = None) -> None:
    """Admit, compute and close ``prompt``; its copies stay queued."""
    seq = cache.admit(prompt, namespace)
    cache.commit(seq, prompt[seq.num_tokens :])
    cache.close(seq)


def cpu_events(events: list) -> list[tuple[str, list[int]]]:
    return [
        (type(event).__name__, event.block_hashes)
        for event in events
        if isinstance(event, (BlockStored, BlockRemoved)) and event.medium == "CPU"
    ]


@pytest.mark.parametrize(("host_pages", "value", "error"), [(0, True, ValueError), (8, 1, TypeError)])
def test_write_through_is_checked(host_pages: int, value: object, error: type) -> None:
    with pytest.raises(error, match="write_through"):
        PrefixCache(8, 2, host_pages=host_pages, write_through=value)


def test_pages_are_saved_when_cached_and_gpu_eviction_copies_nothing() -> None:
    cache = PrefixCache(4, 2, host_pages=8, write_through=True)
    compute(cache, [1, 2, 3, 4, 9])
    batch = cache.take_transfers()
    assert batch is not None and len(batch.saves) == 2  # at commit, not at eviction
    assert cache.num_host_cached_pages == 2 and cache.match([1, 2, 3, 4, 9]) == 4
    cache.transfers_done(batch)
    cache.check_invariants()
    assert cache.evict(2) == 2
    assert cache.take_transfers() is None  # the copy is there: nothing to save
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 4)
    assert cache.stats.saved_pages == 2
    cache.check_invariants()


def test_a_copy_whose_save_is_not_done_is_matched_once_it_is() -> None:
    """GPU eviction before the save's batch is taken: the pages are free at once, the save still
    reads them first (same batch, or an earlier one), and the host copy is matched once done."""
    cache = PrefixCache(4, 2, host_pages=8, write_through=True)
    compute(cache, [1, 2, 3, 4, 9])
    assert cache.evict(2) == 2 and cache.num_free_pages == 4
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 0)
    batch = cache.take_transfers()
    assert len(batch.saves) == 2
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 0)
    cache.transfers_done(batch)
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 4)
    cache.check_invariants()


def test_a_failed_save_drops_the_host_copy_only() -> None:
    cache = PrefixCache(4, 2, host_pages=8, write_through=True)
    compute(cache, [1, 2, 3, 4, 9])
    assert done(cache, ok=False) == 2
    assert cache.match([1, 2, 3, 4, 9]) == 4  # the GPU copy stays
    assert cache.num_host_cached_pages == 0
    cache.check_invariants()
    cache.evict(2)  # no copy now: moved by write-back, a save queued
    assert done(cache) == 2
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 4)
    cache.check_invariants()


def test_a_failed_save_of_a_run_evicted_meanwhile_drops_it() -> None:
    cache = PrefixCache(4, 2, host_pages=8, write_through=True)
    compute(cache, [1, 2, 3, 4, 9])
    cache.evict(2)  # on the host only, its save not done
    assert done(cache, ok=False) == 2
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 0) and cache.num_host_cached_pages == 0
    compute(cache, [1, 2, 3, 4, 9])  # computed again, cached again
    assert cache.match([1, 2, 3, 4, 9]) == 4
    cache.check_invariants()


def test_host_eviction_drops_the_copy_of_a_run_on_both_tiers() -> None:
    """A full host tier makes room for a new copy by dropping the oldest copy; a run on both
    tiers stays on the GPU."""
    cache = PrefixCache(8, 2, host_pages=2, write_through=True)
    first, second = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    compute(cache, first)
    done(cache)
    compute(cache, second)
    done(cache)
    assert cache.match(first) == 4 and cache.match(second) == 4
    assert cache.stats.host_evicted_pages == 2
    cache.check_invariants()
    cache.evict(8)  # first has no copy now: it leaves (no room on the host), second moves free
    assert cache.match_tiers(first) == (0, 0) and cache.match_tiers(second) == (0, 4)
    cache.check_invariants()


def test_the_host_lru_follows_release_not_copy_order() -> None:
    """A copy made early but used since is newer than one made later and not used."""
    cache = PrefixCache(12, 2, host_pages=4, write_through=True)
    old, young = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    compute(cache, old)
    compute(cache, young)
    done(cache)
    # Old is used again and its new page needs room: young's copy goes, not old's.
    compute(cache, [*old, 7])
    assert done(cache) == 1
    assert cache.stats.host_evicted_pages == 2
    cache.evict(12)  # old moves free; young, without a copy, cannot push out old's newer one
    assert done(cache) == 0
    assert cache.match_tiers([*old, 7, 0]) == (0, 6)
    assert cache.match_tiers(young) == (0, 0)
    cache.check_invariants()


def test_a_held_run_is_the_host_tiers_newest() -> None:
    """A run a live sequence holds is in use: the host tier drops copies released before it."""
    cache = PrefixCache(12, 2, host_pages=4, write_through=True)
    old, young = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    compute(cache, old)
    compute(cache, young)
    done(cache)
    seq = cache.admit([*old, 7])  # holds old's run, released before young's
    compute(cache, [20, 21, 9])  # its copy needs a host page: young's copy goes
    done(cache)
    assert cache.evict(2) == 2  # young, without a copy now, and no older one to push out
    assert done(cache) == 0
    assert cache.match_tiers(young) == (0, 0)
    cache.close(seq)
    cache.evict(12)
    assert done(cache) == 0  # old's copy is there
    assert cache.match_tiers(old) == (0, 4)
    cache.check_invariants()


def test_a_run_loaded_back_keeps_its_host_copy() -> None:
    cache = PrefixCache(4, 2, host_pages=8, write_through=True)
    chat = [1, 2, 3, 4, 9]
    compute(cache, chat)
    done(cache)
    cache.evict(4)
    seq = cache.admit([*chat, 5])
    assert seq.num_loading_tokens == 4
    batch = cache.take_transfers()
    assert len(batch.loads) == 2 and len(batch.saves) == 0
    cache.transfers_done(batch)
    cache.commit(seq, [9, 5])
    cache.close(seq)
    cache.check_invariants()
    assert done(cache) == 1  # page [9 5], computed: the loaded ones kept their copy
    assert cache.num_host_cached_pages == 3
    cache.evict(4)
    assert done(cache) == 0  # evicted again: nothing to save
    assert cache.match_tiers([*chat, 5]) == (0, 4)


def test_a_run_computed_again_takes_over_the_host_copy() -> None:
    """A sequence that computed the pages of a run now on the host only gives the run its GPU
    pages; the run keeps its host copy, and nothing is saved again."""
    cache = PrefixCache(8, 2, host_pages=8, write_through=True)
    early = cache.admit([1, 2, 3, 4, 8])  # computes [1 2] [3 4] itself, later
    chat = [1, 2, 3, 4, 9]
    compute(cache, chat)
    done(cache)
    cache.evict(8)
    assert done(cache) == 0 and cache.match_tiers(chat) == (0, 4)
    cache.commit(early, [1, 2, 3, 4, 8])
    cache.close(early)
    cache.check_invariants()
    assert done(cache) == 0 and cache.num_host_cached_pages == 2
    assert cache.match(chat) == 4


def test_decoded_pages_get_copies_and_a_run_that_cannot_keep_one_drops_it() -> None:
    cache = PrefixCache(16, 2, host_pages=3, write_through=True)
    seq = cache.admit([1, 2, 3], extra_tokens=6)
    cache.commit(seq, [1, 2, 3])  # one page cached, copied
    assert done(cache) == 1
    for token in (4, 5, 6):  # pages [3 4], [5 6]: the run grows in place, copies follow
        cache.commit(seq, [token])
    assert cache.num_cached_pages == 3 and done(cache) == 2
    assert cache.num_host_cached_pages == 3
    cache.check_invariants()
    cache.allocate(seq, 2)
    for token in (7, 8):  # a fourth page: the tier holds 3, the run's own copy cannot go
        cache.commit(seq, [token])
    assert cache.num_cached_pages == 4
    assert done(cache) == 0 and cache.num_host_cached_pages == 0
    cache.check_invariants()
    cache.close(seq)
    cache.evict(16)
    assert done(cache) == 0  # four pages, three host pages: dropped, not moved
    cache.check_invariants()


def test_a_parent_is_a_host_candidate_again_once_its_children_copies_go() -> None:
    """A run whose only child with a host copy loses it (while another child is on the GPU only)
    becomes the host tier's candidate again, so the tier can make room with its copy."""
    cache = PrefixCache(4, 1, host_pages=3, write_through=True)
    for prompt, namespace in (([1, 1], "t"), ([0], None), ([1, 0, 0, 0], "t")):
        compute(cache, prompt, namespace)
        done(cache)
        cache.check_invariants()
    assert cache.num_host_cached_pages == 3  # [0 0 0]'s copy: room made from [1]'s copy too


def test_events_publish_copies_when_ready_and_remove_published_ones() -> None:
    cache = PrefixCache(4, 2, host_pages=2, write_through=True)
    index = BlockIndex(1, 2)
    first, second = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    compute(cache, first)
    events = cache.drain_events()
    assert cpu_events(events) == []  # not ready: not announced
    index.apply(0, events)
    done(cache)
    events = cache.drain_events()
    keys = events[0].block_hashes
    assert cpu_events(events) == [("BlockStored", keys)]
    index.apply(0, events)
    compute(cache, second)  # its copy takes first's host pages
    done(cache, ok=False)  # and fails: never announced
    events = cache.drain_events()
    assert cpu_events(events) == [("BlockRemoved", keys)]
    index.apply(0, events)
    assert index.match_tiers(first) == [(0, 0)] or index.match_tiers(first) == [(4, 0)]
    assert index.match_tiers(second) == [(cache.match(second), 0)]
    cache.evict(4)
    index.apply(0, cache.drain_events())
    done(cache)
    index.apply(0, cache.drain_events())
    for prompt in (first, second):
        gpu, host = cache.match_tiers(prompt)
        assert index.match_tiers(prompt) == [(gpu, host)]
    cache.check_invariants()


def test_an_event_overflow_restates_published_copies_only() -> None:
    cache = PrefixCache(8, 2, host_pages=8, write_through=True, max_events=2)
    compute(cache, [1, 2, 3, 4, 9])
    done(cache)
    compute(cache, [5, 6, 7, 8, 9])  # its save is not done
    compute(cache, [10, 11, 12, 13, 9])
    events = cache.drain_events()  # overflowed: the blocks restated
    stored = [event for event in events if isinstance(event, BlockStored)]
    gpu = [key for event in stored if event.medium == "GPU" for key in event.block_hashes]
    cpu = [key for event in stored if event.medium == "CPU" for key in event.block_hashes]
    assert len(gpu) == 6 and len(cpu) == 2
    index = BlockIndex(1, 2)
    index.apply(0, events)
    done(cache)
    index.apply(0, cache.drain_events())
    cache.evict(8)
    index.apply(0, cache.drain_events())
    for prompt in ([1, 2, 3, 4, 9], [5, 6, 7, 8, 9], [10, 11, 12, 13, 9]):
        assert index.match_tiers(prompt) == [cache.match_tiers(prompt)] == [(0, 4)]


def test_reset_empties_both_tiers() -> None:
    cache = PrefixCache(4, 2, host_pages=8, write_through=True)
    compute(cache, [1, 2, 3, 4, 9])
    batch = cache.take_transfers()
    cache.reset()
    stats = cache.stats
    assert stats.host_cached_pages == 0 and stats.free_host_pages == 8 and stats.free_pages == 4
    cache.transfers_done(batch)  # a batch taken before the reset: nothing comes back
    assert cpu_events(cache.drain_events()) == []
    assert cache.match_tiers([1, 2, 3, 4, 9]) == (0, 0)
    cache.check_invariants()


def decode(cache: PrefixCache, seq, token: int) -> None:
    cache.allocate(seq, 1)
    cache.commit(seq, [token])


def test_a_grown_run_that_loses_its_copy_removes_only_the_published_blocks() -> None:
    """A run extended by decode whose new page finds no host room drops its copy: the CPU removes
    name the blocks announced on the CPU, not the new one."""
    cache = PrefixCache(8, 2, host_pages=2, write_through=True)
    seq = cache.admit([1, 2, 3, 4, 5])
    cache.commit(seq, [1, 2, 3, 4, 5])
    done(cache)
    stored = {
        k
        for e in cache.drain_events()
        if isinstance(e, BlockStored) and e.medium == "CPU"
        for k in e.block_hashes
    }
    assert len(stored) == 2
    decode(cache, seq, 6)  # a third page, no host room: the copy goes
    removed = [
        k
        for e in cache.drain_events()
        if isinstance(e, BlockRemoved) and e.medium == "CPU"
        for k in e.block_hashes
    ]
    assert sorted(removed) == sorted(stored)
    cache.check_invariants()


def test_a_grown_run_with_a_copy_partly_published_drops_it_whole() -> None:
    """The same with the copy's last page saved but not yet done: no error, no host page lost,
    and the unfinished copy is never announced."""
    cache = PrefixCache(8, 2, host_pages=3, write_through=True)
    seq = cache.admit([1, 2, 3, 4, 5])
    cache.commit(seq, [1, 2, 3, 4, 5])
    done(cache)
    decode(cache, seq, 6)  # a third page and its copy, queued
    cache.drain_events()
    batch = cache.take_transfers()
    decode(cache, seq, 7)
    decode(cache, seq, 8)  # a fourth page, no host room: the copy goes
    events = cache.drain_events()
    cache.transfers_done(batch)
    events += cache.drain_events()
    cache.check_invariants()
    assert cache.stats.free_host_pages == 3
    assert not [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    removed = [k for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for k in e.block_hashes]
    assert len(removed) == 2


def test_copies_are_announced_in_the_order_their_batches_were_taken() -> None:
    """A child's copy in a batch done before its parent's batch is announced after the parent's,
    so a router that applies events in order knows every block's parent first."""
    cache = PrefixCache(8, 1, host_pages=8, write_through=True)
    seq = cache.admit([1, 2, 3, 4])
    cache.commit(seq, [1, 2])
    cache.close(seq)
    first = cache.take_transfers()
    seq = cache.admit([1, 2, 3, 4])
    cache.commit(seq, [3])
    cache.close(seq)
    second = cache.take_transfers()
    cache.drain_events()
    cache.transfers_done(second)
    assert not cpu_events(cache.drain_events())  # its parent's batch is not done
    cache.transfers_done(first)
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    known = set()
    for event in stored:
        assert event.parent_block_hash is None or event.parent_block_hash in known
        known.update(event.block_hashes)
    assert len(known) == 3
    cache.check_invariants()

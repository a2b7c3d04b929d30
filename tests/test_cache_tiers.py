"""The host tier: random engine traffic with copies made, delayed, completed in any order or
failed, checked against a model of what each GPU and host page holds.

The model never reads the cache's tree: it keeps the bytes of every page as the engine would
(``gpu[page]`` / ``host[page]``: per slot, the namespace and the tokens up to and including it),
writes them for the tokens the engine computes, and moves them only as the batches of
``take_transfers`` say, in the order they were taken. Every token a sequence counts as computed
must then read its own prompt's KV: a load that is not done, a page reused under a save, or a
match into another prompt's pages would show as wrong bytes. ``check_invariants`` runs after every
step: each page free, held, cached on one tier (or, with write-through, on both), or pinned by a
load in flight. With write-through a save may read a GPU page the cache freed since (a run on both
tiers evicted from the GPU before its save was taken): the model copies in batch order, so a later
write of that page must come after the save, as ``Transfers`` promises.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefix_cache import OutOfPages, PrefixCache, Transfers
from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.events import BlockIndex

VOCAB = 3
POISON = ("garbage",)


class TierMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.integers(1, 3),
        gpu_pages=st.integers(3, 10),
        host_pages=st.integers(1, 16),
        system=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=6),
        write_through=st.booleans(),
    )
    def setup(
        self, page_size: int, gpu_pages: int, host_pages: int, system: list[int], write_through: bool
    ) -> None:
        self.ps = page_size
        self.write_through = write_through
        self.cache = PrefixCache(gpu_pages, page_size, host_pages=host_pages, write_through=write_through)
        self.gpu: dict[int, list] = {page: [POISON] * page_size for page in range(gpu_pages)}
        self.host: dict[int, list] = {page: [POISON] * page_size for page in range(host_pages)}
        self.system = system
        # seq -> (namespace, prompt, committed tokens as the engine knows them)
        self.live: dict = {}
        self.prompts: list[tuple[object, list[int]]] = []
        # Batches taken and copied (or not), waiting for transfers_done: (batch, copied).
        self.in_flight: list[tuple[Transfers, bool]] = []
        # A router's view, from the cache's events alone.
        self.index = BlockIndex(1, page_size)
        #: Block key -> the tiers the events say hold it, for the order check in ``consistent``.
        self.announced: dict[int, set[str]] = {}

    # ------------------------------------------------------------------ the engine's side

    def slot(self, namespace, tokens: list[int], position: int) -> tuple:
        return (namespace, tuple(tokens[: position + 1]))

    def verify(self, seq) -> None:
        """Every token ``seq`` counts as computed (not loading) holds its own prompt's KV."""
        namespace, _, tokens = self.live[seq]
        table = seq.block_table.tolist()
        loading_from = seq.num_cached_tokens - seq.num_loading_tokens
        loading_to = seq.num_cached_tokens
        for position in range(seq.num_tokens):
            if seq.num_loading_tokens and loading_from <= position < loading_to:
                continue
            got = self.gpu[table[position // self.ps]][position % self.ps]
            assert got == self.slot(namespace, tokens, position), (
                f"token {position} of sequence {seq.seq_id} reads {got}"
            )

    def take(self, fail: bool = False) -> None:
        """Take the queued copies and make them (in order: saves, then loads), or not."""
        batch = self.cache.take_transfers()
        if batch is None:
            return
        assert batch.saves.dtype == np.int32 and batch.loads.dtype == np.int32
        # A mover refuses a destination named twice in one batch.
        assert len(set(batch.saves[:, 1].tolist())) == len(batch.saves)
        assert len(set(batch.loads[:, 1].tolist())) == len(batch.loads)
        for gpu, _host in batch.saves.tolist():
            # Only cached pages are saved: every slot holds KV the engine computed (or loaded).
            assert POISON not in self.gpu[gpu], f"save of GPU page {gpu} reads {self.gpu[gpu]}"
        if fail:
            for _gpu, host in batch.saves.tolist():
                self.host[host] = [POISON] * self.ps
            for _host, gpu in batch.loads.tolist():
                self.gpu[gpu] = [POISON] * self.ps
        else:
            for gpu, host in batch.saves.tolist():
                self.host[host] = list(self.gpu[gpu])
            for host, gpu in batch.loads.tolist():
                self.gpu[gpu] = list(self.host[host])
        self.in_flight.append((batch, not fail))

    def write(self, seq, tokens: list[int]) -> None:
        """The engine's forward: KV of ``tokens`` into the sequence's slots after ``num_tokens``,
        after the step's copies were taken (the order ``Transfers`` asks for)."""
        self.take()
        namespace, _prompt, known = self.live[seq]
        self.verify(seq)
        table = seq.block_table.tolist()
        start = seq.num_tokens
        known[start:] = tokens
        for position in range(start, start + len(tokens)):
            self.gpu[table[position // self.ps]][position % self.ps] = self.slot(namespace, known, position)

    # ------------------------------------------------------------------ rules

    @rule(
        data=st.data(),
        source=st.sampled_from(["fresh", "system", "repeat", "repeat"]),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
        namespace=st.sampled_from([None, "t"]),
        extra=st.integers(0, 2),
        run=st.booleans(),
    )
    def admit(self, data, source: str, suffix: list[int], namespace, extra: int, run: bool) -> None:
        """Admit a prompt (a new one, one after the system prompt, or a finished conversation
        with one more token, the next turn); with ``run``, prefill it at once and close it."""
        if len(self.live) > 2:
            self.close(data)
        if source == "repeat" and self.prompts:
            namespace, prefix = data.draw(st.sampled_from(self.prompts))
            prompt = prefix + suffix[:1]
        elif source == "system":
            prompt = self.system + suffix
        else:
            prompt = suffix
        try:
            seq = self.cache.admit(prompt, namespace, extra_tokens=extra)
        except OutOfPages:
            return
        assert seq.num_cached_tokens % self.ps == 0 and seq.num_cached_tokens < len(prompt)
        assert 0 <= seq.num_loading_tokens <= seq.num_cached_tokens
        assert seq.num_tokens == seq.num_cached_tokens
        self.live[seq] = (namespace, prompt, list(prompt[: seq.num_cached_tokens]))
        self.verify(seq)
        if run:
            if seq.num_loading_tokens and data.draw(st.booleans()):
                # The engine waits for the loads before the prefill.
                self.take()
                self.done(data, False)
            self.prefill(data, seq)
            self.close(data, seq)

    def pick(self, data, seq=None):
        return (
            seq if seq is not None else data.draw(st.sampled_from(sorted(self.live, key=lambda s: s.seq_id)))
        )

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def prefill(self, data, seq=None) -> None:
        """Compute the rest of a prompt (a loading sequence waits for its loads first, or goes on
        in stream order after them: both are allowed)."""
        seq = self.pick(data, seq)
        if seq not in self.live:
            return
        _, prompt, _ = self.live[seq]
        rest = prompt[seq.num_tokens :]
        room = seq.num_allocated_tokens - seq.num_tokens
        if not rest or len(rest) > room:
            return
        self.write(seq, rest)
        self.cache.commit(seq, rest)

    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    @precondition(lambda self: self.live)
    def decode(self, data, token: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live, key=lambda s: s.seq_id)))
        _, prompt, _ = self.live[seq]
        if seq.num_tokens < len(prompt):
            return
        try:
            self.cache.allocate(seq, 1)
        except OutOfPages:
            return
        self.write(seq, [token])
        self.cache.commit(seq, [token])

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def close(self, data, seq=None) -> None:
        seq = self.pick(data, seq)
        if seq not in self.live:
            return
        namespace, prompt, known = self.live.pop(seq)
        if seq.num_loading_tokens == 0 and seq.num_tokens >= len(prompt):
            self.prompts.append((namespace, known[: seq.num_tokens]))
        self.cache.close(seq)

    @rule(fail=st.booleans())
    def step(self, fail: bool) -> None:
        self.take(fail)

    @rule(data=st.data(), cancel=st.booleans())
    @precondition(lambda self: self.in_flight)
    def done(self, data, cancel: bool) -> None:
        """Complete any batch in flight, in any order: a batch not copied must report failure;
        one copied may still report it (the engine gave up on it)."""
        if not self.in_flight:
            return
        index = data.draw(st.integers(0, len(self.in_flight) - 1))
        batch, copied = self.in_flight.pop(index)
        ok = copied and not cancel
        waiting = [seq for seq in self.live if seq.num_loading_tokens]
        self.cache.transfers_done(batch, ok=ok)
        with pytest.raises(ValueError, match="not in flight"):
            self.cache.transfers_done(batch)
        for seq in waiting:
            if not seq.num_loading_tokens:
                # Loads done: verified in full now; failed: back to the GPU prefix.
                _namespace, _prompt, known = self.live[seq]
                del known[seq.num_tokens :]
                self.verify(seq)

    @rule(count=st.integers(0, 6))
    def evict(self, count: int) -> None:
        assert self.cache.evict(count) <= count

    @rule()
    @precondition(lambda self: not self.live)
    def reset(self) -> None:
        self.cache.reset()
        stats = self.cache.stats
        assert stats.host_cached_pages == 0 and stats.free_host_pages == stats.host_pages
        assert stats.free_pages == stats.num_pages
        self.prompts.clear()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()
            events = self.cache.drain_events()
            for event in events:
                # In event order, a stored run's parent is held on some tier (a router applying
                # events in order always knows it), and a removed block was announced there.
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    assert parent is None or self.announced.get(parent), event
                    for key in event.block_hashes:
                        self.announced.setdefault(key, set()).add(event.medium)
                elif isinstance(event, BlockRemoved):
                    for key in event.block_hashes:
                        assert event.medium in self.announced.get(key, ()), event
                        self.announced[key].discard(event.medium)
                elif isinstance(event, AllBlocksCleared):
                    self.announced.clear()
            self.index.apply(0, events)
            for namespace, prompt in self.prompts[-4:]:
                (gpu, host), cache_gpu, (_, cache_host) = (
                    self.index.match_tiers(prompt, namespace)[0],
                    self.cache.match(prompt, namespace),
                    self.cache.match_tiers(prompt, namespace),
                )
                # The events tell a router each block's tier; the cache loads no more than fit.
                assert gpu == cache_gpu and host >= cache_host, (gpu, host, cache_gpu, cache_host)
            for seq in self.live:
                assert seq.num_loading_tokens == 0 or seq.num_loading_tokens % self.ps == 0

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for seq in list(self.live):
            self.cache.close(seq)
        while self.in_flight:
            batch, copied = self.in_flight.pop()
            self.cache.transfers_done(batch, ok=copied)
        self.cache.check_invariants()
        assert self.cache.num_free_pages + self.cache.num_evictable_pages == self.cache.num_pages


TierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
test_tiers = TierMachine.TestCase


# ---------------------------------------------------------------------- single behaviours


def evicted_to_host(host_pages: int = 16) -> tuple[PrefixCache, list[list[int]]]:
    """A 6-page GPU pool (page 4) after three 9-token conversations, each moved to the host by
    the next: returns the cache and the conversations, oldest first."""
    cache = PrefixCache(6, 4, host_pages=host_pages)
    chats = [[base + i for i in range(9)] for base in (10, 30, 50)]
    for chat in [*chats, [70 + i for i in range(9)]]:
        seq = cache.admit(chat, extra_tokens=7)
        batch = cache.take_transfers()
        if batch is not None:
            cache.transfers_done(batch)
        cache.commit(seq, chat)
        cache.close(seq)
    return cache, chats


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("run_tokens", "moved_pages"), [(1024, None), (1024 + 16, 1)])
def test_a_run_of_up_to_1024_tokens_moves_to_the_host_whole(page_size, run_tokens, moved_pages) -> None:
    # The pool needs one page of an unreferenced run: one of up to 1024 tokens moves whole (a cut
    # costs more than moving the rest, which is as old), a longer one is cut. In tokens, so that a
    # page per token does not cut runs at every decode step's eviction.
    run_pages = run_tokens // page_size
    cache = PrefixCache(run_pages + 4, page_size, host_pages=2 * run_pages)
    prompt = list(range(1, run_tokens + 1))
    seq = cache.admit(prompt)
    cache.commit(seq, prompt)
    cache.close(seq)
    assert cache.match([*prompt, 0]) == run_tokens and cache.num_free_pages == 4
    seq = cache.admit([0] * (5 * page_size))  # one page more than the free ones
    moved = cache.take_transfers().saves
    assert len(moved) == (run_pages if moved_pages is None else moved_pages)
    assert cache.match([*prompt, 0]) == run_tokens - len(moved) * page_size
    cache.close(seq)
    cache.check_invariants()


def test_a_short_run_the_host_cannot_take_whole_is_cut_not_dropped() -> None:
    # 500 one-token pages, a host tier of 100: moving the run whole would drop it from both tiers;
    # the page the pool needs is cut off and moved instead.
    prompt = list(range(1, 501))
    cache = PrefixCache(504, 1, host_pages=100)
    seq = cache.admit(prompt)
    cache.commit(seq, prompt)
    cache.close(seq)
    seq = cache.admit([0] * 5)  # one page more than the free ones
    batch = cache.take_transfers()
    assert len(batch.saves) == 1 and cache.match([*prompt, 0]) == 499
    cache.transfers_done(batch)
    cache.close(seq)
    assert cache.match_tiers([*prompt, 0]) == (499, 1)
    cache.check_invariants()


@pytest.mark.parametrize("value", [-1, 2**31, 1.5, True, "8"])
def test_host_pages_out_of_range_is_refused(value) -> None:
    with pytest.raises((TypeError, ValueError), match="host_pages"):
        PrefixCache(8, 4, host_pages=value)


def test_without_a_tier_nothing_is_transferred() -> None:
    cache = PrefixCache(4, 4)
    assert cache.take_transfers() is None and cache.num_host_pages == 0
    with pytest.raises(ValueError, match="not in flight"):
        cache.transfers_done(Transfers(np.empty((0, 2), np.int32), np.empty((0, 2), np.int32), 1))
    with pytest.raises(TypeError, match="Transfers"):
        cache.transfers_done(None)


def test_a_run_evicted_from_the_gpu_comes_back_by_load() -> None:
    cache, chats = evicted_to_host()
    assert cache.match(chats[0]) == 0 and cache.match_tiers(chats[0]) == (0, 8)
    seq = cache.admit(chats[0] + [1])
    assert seq.num_cached_tokens == 8 and seq.num_loading_tokens == 8 and seq.num_tokens == 8
    batch = cache.take_transfers()
    assert batch.loads[:, 1].tolist() == seq.block_table[:2].tolist()
    with pytest.raises(TypeError, match="ok must be a bool"):
        cache.transfers_done(batch, ok=1)
    cache.transfers_done(batch)
    assert seq.num_loading_tokens == 0 and cache.match(chats[0]) == 8  # cached on the GPU again
    assert cache.stats.host_hit_tokens == 8 and cache.stats.loaded_pages == 2
    cache.close(seq)
    cache.check_invariants()


def test_a_full_host_tier_drops_its_oldest_run() -> None:
    cache, chats = evicted_to_host(host_pages=2)
    assert cache.match_tiers(chats[0]) == (0, 0)  # the oldest made room
    assert cache.match_tiers(chats[1]) == (0, 8)
    assert cache.stats.host_evicted_pages >= 2
    cache.check_invariants()


def test_a_failed_load_falls_back_to_the_gpu_prefix() -> None:
    cache, chats = evicted_to_host()
    seq = cache.admit(chats[1] + [1])
    batch = cache.take_transfers()
    cache.transfers_done(batch, ok=False)
    assert seq.num_cached_tokens == 0 and seq.num_tokens == 0 and seq.num_loading_tokens == 0
    assert seq.num_allocated_tokens == 10  # the pages stay, to be computed again
    assert cache.stats.hit_tokens == 0
    cache.commit(seq, chats[1] + [1])
    cache.close(seq)
    cache.check_invariants()


def test_closing_a_loading_sequence_drops_its_loads_and_pins() -> None:
    cache, chats = evicted_to_host()
    seq = cache.admit(chats[1] + [1])
    assert seq.num_loading_tokens == 8
    cache.close(seq)
    batch = cache.take_transfers()
    assert batch is None or len(batch.loads) == 0
    cache.check_invariants()
    assert cache.match_tiers(chats[1]) == (0, 8)  # still on the host


def test_a_run_split_before_its_save_is_taken_keeps_the_batch_whole() -> None:
    """A sequence computes the first page of a run still waiting for its save: the run splits,
    and the batch still pairs every saved GPU page with its host page."""
    cache = PrefixCache(6, 2, host_pages=8)
    early = cache.admit([1, 2, 8])  # will compute [1 2] itself
    chat = [1, 2, 3, 4, 5, 6, 7]
    seq = cache.admit(chat)
    cache.commit(seq, chat)
    cache.close(seq)  # pages [1 2] [3 4] [5 6] cached
    assert cache.evict(3) == 3  # the run moves to the host, saves queued
    cache.commit(early, [1, 2, 8])  # its page [1 2] takes the run's first page's place: a split
    cache.close(early)
    batch = cache.take_transfers()
    assert batch.saves.shape == (3, 2)
    cache.transfers_done(batch)
    cache.check_invariants()


def test_a_host_page_a_load_reads_is_not_saved_over() -> None:
    """The host tier is full and the run a pending load reads is its oldest: making room drops
    the run, but its pages stay pinned until the load is done, so no save of the same batch (nor
    of a later one before it) writes them."""
    cache, chats = evicted_to_host(host_pages=4)
    seq = cache.admit(chats[0] + [1])  # loads chats[0] from the host, pages pinned
    assert seq.num_loading_tokens == 8
    read = set(cache._tier.loads[0][0].tolist())
    for base in (80, 90, 100):  # new conversations push chats[1] and [2] out of the GPU
        other = cache.admit([base + i for i in range(9)], extra_tokens=3)
        cache.commit(other, [base + i for i in range(9)])
        cache.close(other)
    batch = cache.take_transfers()
    assert read == set(batch.loads[:, 0].tolist())
    assert read.isdisjoint(batch.saves[:, 1].tolist())
    cache.check_invariants()
    cache.transfers_done(batch)
    cache.close(seq)
    cache.check_invariants()


def cached(cache: PrefixCache, prompt: list[int]) -> None:
    """Compute and cache ``prompt`` (its copies taken and done at once)."""
    seq = cache.admit(prompt)
    batch = cache.take_transfers()
    if batch is not None:
        cache.transfers_done(batch)
    cache.commit(seq, prompt[seq.num_tokens :])
    cache.close(seq)


def test_a_run_is_matched_on_the_host_only_once_its_save_is_done() -> None:
    """A load never reads a page whose save may still fail: until the save's batch is done the run
    is recomputed, and after a failed save it is gone."""
    cache = PrefixCache(4, 2, host_pages=8)
    chat = [1, 2, 3, 4, 9]
    cached(cache, chat)
    cache.evict(2)  # to the host, saves queued
    assert cache.match_tiers(chat) == (0, 0)
    batch = cache.take_transfers()
    assert cache.match_tiers(chat) == (0, 0)  # taken, not done
    cache.transfers_done(batch, ok=False)
    assert cache.match_tiers(chat) == (0, 0) and cache.num_host_cached_pages == 0
    cached(cache, chat)
    cache.evict(2)
    cache.transfers_done(cache.take_transfers())
    assert cache.match_tiers(chat) == (0, 4)
    cache.check_invariants()


def test_a_failed_batch_drops_only_the_runs_it_wrote() -> None:
    """Host pages reused by a later batch after a failed batch's run left them keep the later run."""
    cache = PrefixCache(8, 2, host_pages=2)
    first, second = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    cached(cache, first)
    cache.evict(8)
    failing = cache.take_transfers()  # first -> host pages 0, 1; reported failed below
    cached(cache, second)
    cache.evict(8)  # second -> host: full, first dropped, second takes the pages
    cache.transfers_done(cache.take_transfers())
    assert cache.match_tiers(second) == (0, 4)
    cache.transfers_done(failing, ok=False)
    assert cache.match_tiers(second) == (0, 4)
    cache.check_invariants()


def test_a_batch_saves_into_each_host_page_once() -> None:
    """A run that leaves a full host tier before its save is taken gives its pages to the next
    run: the batch keeps the last save per host page (a mover refuses a page named twice)."""
    cache = PrefixCache(6, 2, host_pages=2)
    for prompt in ([1, 2, 3, 4, 9], [5, 6, 7, 8, 9]):
        cached(cache, prompt)
    seqs = [cache.admit([20, 21, 22, 23, 9]), cache.admit([30, 31, 32, 33, 9])]
    batch = cache.take_transfers()
    hosts = batch.saves[:, 1].tolist()
    assert len(hosts) == len(set(hosts)) == 2
    cache.transfers_done(batch)
    for seq in seqs:
        cache.close(seq)
    assert cache.match_tiers([5, 6, 7, 8, 9])[1] == 4  # the second run, in those pages
    cache.check_invariants()


def test_a_hash_fn_error_while_caching_loaded_pages_falls_back() -> None:
    from prefix_cache.cache.hashing import default_hash_fn

    armed = [False]

    def hash_fn(page: bytes, parent: int) -> int:
        if armed[0] and page[:4] == (7).to_bytes(4, "little"):
            raise RuntimeError("hash_fn failed")
        return default_hash_fn(page, parent)

    cache = PrefixCache(8, 2, host_pages=8, hash_fn=hash_fn)
    cached(cache, [1, 2, 3, 4, 9])
    cached(cache, [5, 6, 5, 6, 9])
    cache.evict(8)
    cache.transfers_done(cache.take_transfers())
    x = cache.admit([1, 2, 3, 4, 7, 7, 9])
    y = cache.admit([5, 6, 5, 6, 9])
    batch = cache.take_transfers()
    cache.commit(x, [7, 7, 9])  # committed while loading, in stream order after the loads
    armed[0] = True
    with pytest.raises(RuntimeError, match="hash_fn failed"):
        cache.transfers_done(batch)
    armed[0] = False
    assert x.num_loading_tokens == 0 and x.num_tokens == 0  # falls back: recompute
    assert y.num_loading_tokens == 0 and y.num_tokens == 4  # loaded
    cache.check_invariants()
    cache.close(x)
    cache.close(y)
    cache.check_invariants()


def test_another_caches_batch_is_refused() -> None:
    caches = [PrefixCache(4, 2, host_pages=8) for _ in range(2)]
    batches = []
    for cache in caches:
        cached(cache, [1, 2, 3, 4, 9])
        cache.evict(2)
        batches.append(cache.take_transfers())
    assert batches[0].ticket == batches[1].ticket
    with pytest.raises(ValueError, match="not in flight"):
        caches[1].transfers_done(batches[0])
    caches[1].transfers_done(batches[1])


def test_the_host_lru_keeps_few_stale_entries() -> None:
    cache = PrefixCache(4, 2, host_pages=1000)
    for _ in range(3000):
        seq = cache.admit([1, 2, 3, 4, 9])
        batch = cache.take_transfers()
        if batch is not None:
            cache.transfers_done(batch)
        cache.commit(seq, [1, 2, 3, 4, 9][seq.num_tokens :])
        cache.close(seq)
        cache.evict(4)
        cache.transfers_done(cache.take_transfers())
    assert len(cache._tier.heap) <= 2 * cache._tree.num_host_nodes + 1024
    cache.check_invariants()


def test_closing_before_the_load_takes_back_the_hit() -> None:
    cache, chats = evicted_to_host()
    seq = cache.admit(chats[1] + [1])
    assert cache.stats.host_hit_tokens == 8
    cache.close(seq)
    assert cache.stats.host_hit_tokens == 0 and cache.stats.hit_tokens == 0

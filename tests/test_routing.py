"""Routers and the replay of several replicas behind one router, events over real ZMQ sockets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from prefix_cache.__main__ import main
from prefix_cache.cache.events import BlockStored
from prefix_cache.events.index import BlockIndex, block_hashes
from prefix_cache.replay.cluster import _Cluster, replay_cluster
from prefix_cache.replay.routing import (
    ROUTERS,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    SessionAffinity,
    make_router,
)
from prefix_cache.replay.simulator import SchedulerConfig, replay
from prefix_cache.replay.synthetic import SyntheticConfig, synthetic_conversations

WORKLOAD = SyntheticConfig(
    conversations=40, system_prompt_tokens=64, max_turns=4, user_tokens=(8, 40), reply_tokens=(8, 40), seed=3
)
CONFIG = SchedulerConfig(num_pages=256, page_size=8, max_running=6, clients=16)


def stored(replica_tokens: list[int], page_size: int) -> list[BlockStored]:
    return [BlockStored(block_hashes(replica_tokens, page_size), None, replica_tokens, page_size)]


def test_prefix_router_prefers_the_longest_prefix_within_the_load_cap() -> None:
    index = BlockIndex(num_replicas=3, page_size=4)
    index.apply(1, stored(list(range(8)), 4))  # two pages of the prompt
    index.apply(2, stored(list(range(4)), 4))  # one page
    router = PrefixAware(index, load_slack=0.0)
    prompt = np.arange(12, dtype=np.int32)
    assert router.choose(prompt, 0, [0, 0, 0]) == 1
    assert router.choose(prompt, 0, [0, 2, 0]) == 1  # within the minimum slack of 2 requests
    assert router.choose(prompt, 0, [0, 3, 0]) == 2  # too busy: the next longest prefix
    assert router.choose(prompt, 0, [0, 3, 3]) == 0
    # No replica holds anything: the least loaded one.
    assert router.choose(np.arange(100, 112, dtype=np.int32), 0, [4, 1, 3]) == 1
    # The cap scales with the mean load.
    assert PrefixAware(index, load_slack=0.5).choose(prompt, 0, [10, 14, 20]) == 1


def test_simple_routers() -> None:
    prompt = np.arange(4, dtype=np.int32)
    rr = RoundRobin(3)
    assert [rr.choose(prompt, 0, [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert LeastLoaded().choose(prompt, 0, [3, 1, 1]) == 1
    session = SessionAffinity(4)
    picks = [session.choose(prompt, s, [0] * 4) for s in range(200)]
    assert picks == [session.choose(prompt, s, [9, 0, 0, 0]) for s in range(200)]  # sticky
    assert set(picks) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("random", 2)
    with pytest.raises(ValueError, match="needs a BlockIndex"):
        make_router("prefix", 2)


@pytest.mark.parametrize("think_time", [0.0, 0.5])
def test_one_replica_replays_exactly_like_the_single_engine(think_time: float) -> None:
    conversations = synthetic_conversations(WORKLOAD)
    config = replace(CONFIG, think_time=think_time)
    _, single = replay(conversations, config)
    for router in ("round-robin", "prefix"):
        res = replay_cluster(conversations, config, 1, router)
        assert (res.requests, res.prompt_tokens, res.cached_tokens, res.best_cached_tokens) == (
            single.requests,
            single.prompt_tokens,
            single.cached_tokens,
            single.best_cached_tokens,
        )
        assert res.steps == single.steps and res.imbalance == 1.0
    if think_time:
        assert single.cached_tokens < replay(conversations, CONFIG)[1].cached_tokens


def test_routers_over_zmq_on_a_multi_turn_workload() -> None:
    conversations = synthetic_conversations(WORKLOAD)
    results = {}
    for router in ROUTERS:
        cluster = _Cluster(conversations, CONFIG, 3, router, None)
        results[router] = res = cluster.run()
        # The router's index, fed over ZMQ, agrees with every replica's cache at the end.
        for conv in conversations[:10]:
            prompt = np.concatenate([conv.prefix, conv.turns[0].user, conv.turns[0].replies[0]])
            assert cluster.index.match(prompt) == [r.cache.match(prompt) for r in cluster.replicas]
        assert res.messages > 0 and res.event_bytes > res.messages * 8
        assert res.resyncs == 0
        assert cluster.loads == [0, 0, 0]  # the router's count of outstanding requests drained
        assert sum(r.result.requests for r in cluster.replicas) == res.requests
        assert res.requests == sum(len(t.replies) for conv in conversations for t in conv.turns)
    best = results["prefix"].best_hit_rate
    assert all(r.best_hit_rate == best for r in results.values())  # the same requests, the same bound
    # Each turn extends the previous one: following the prefix beats spreading turns around.
    assert results["prefix"].hit_rate > results["round-robin"].hit_rate + 0.1
    assert results["prefix"].hit_rate >= 0.9 * best


def test_cli_compares_routers(capsys: pytest.CaptureFixture[str]) -> None:
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
        "--max-reply-tokens",
        "20",
        "--replicas",
        "2",
        "--router",
        "session",
        "prefix",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 x (64 pages" in out and "one cache" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["session"], ["prefix"])]
    assert rows == ["session", "prefix"]


def test_cli_rejects_router_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--router", "prefix"])  # one replica: nothing to route
    assert "--replicas 2 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "--replicas", "2", "--router", "random"])
    with pytest.raises(SystemExit):
        main(["replay", "--replicas", "0"])
    with pytest.raises(SystemExit):
        main(["replay", "--replicas", "65"])
    assert "argument --replicas: must be in 1..64, got 65" in capsys.readouterr().err
    with pytest.raises(ValueError, match="replicas"):
        replay_cluster([], replace(CONFIG), 0, "prefix")

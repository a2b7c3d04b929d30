"""The router's side: the documented block hash, the block index, and the subscriber that feeds it
from ZMQ streams with gap recovery."""

from __future__ import annotations

import random
import time

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_kv_events_helpers import (
    LOOPBACK,
    ArrayBlockRemoved,
    ArrayBlockStored,
    Engine,
    FakeReplica,
    VllmBlockRemoved,
    VllmBlockStored,
    replay_request,
    vllm_payload,
)
from xxhash import xxh3_64_intdigest

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.events.index import BlockIndex, block_hashes
from prefix_cache.events.publisher import KVEventPublisher
from prefix_cache.events.subscriber import KVEventSubscriber
from prefix_cache.events.wire import BatchDecoder, to_wire

# ---------------------------------------------------------------------- the hash and the index


def documented_hashes(tokens: list[int], page_size: int, namespace: object) -> list[int]:
    """The block hash as docs/events.md documents it, written from the text alone."""
    if namespace is None:
        key = xxh3_64_intdigest(b"prefix-cache:none")
    elif isinstance(namespace, str):
        key = xxh3_64_intdigest(b"prefix-cache:s:" + namespace.encode("utf-8"))
    elif isinstance(namespace, bytes):
        key = xxh3_64_intdigest(b"prefix-cache:b:" + namespace)
    else:
        key = xxh3_64_intdigest(b"prefix-cache:i:" + str(namespace).encode("ascii"))
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        key = xxh3_64_intdigest(page, seed=key)
        keys.append(key)
    return keys


@pytest.mark.parametrize("namespace", [None, "tenant-a", b"salt", 7])
def test_published_hashes_follow_the_documented_recipe(namespace) -> None:
    tokens = [128000, 9906, 1917, 0, 5, 70000, 3, 3, 12, 99, 100]
    cache = PrefixCache(num_pages=8, page_size=3)
    seq = cache.open(tokens, namespace)
    cache.allocate(seq, len(tokens))
    cache.commit(seq, tokens)
    (stored,) = cache.drain_events()
    assert stored.block_hashes == documented_hashes(tokens, 3, namespace)
    assert block_hashes(tokens, 3, namespace) == documented_hashes(tokens, 3, namespace)


def test_extra_keys_reach_the_index_through_the_wire() -> None:
    """Pages under an image's placeholder tokens carry its key: in the published hashes, on the wire
    (vLLM's ``extra_keys``) and in the router's lookup, so two images never share those pages."""
    prompt = list(range(100, 124))  # 6 pages of 4; the image covers tokens 9..14 (pages 2 and 3)
    image_a, image_b = [(9, 15, b"image-a")], [(9, 15, b"image-b")]
    cache = PrefixCache(num_pages=16, page_size=4)
    seq = cache.open(prompt, extra_keys=image_a)
    cache.allocate(seq, len(prompt))
    cache.commit(seq, prompt)
    cache.close(seq)
    with KVEventPublisher(LOOPBACK, LOOPBACK) as pub:
        pub.publish(cache.drain_events())
        pub.flush()
        (_, _, _, payload), _ = replay_request(pub.replay_endpoint, 0)
    (stored,) = BatchDecoder().decode(payload)[1]
    assert stored.block_hashes == block_hashes(prompt, 4, extra_keys=image_a)
    assert stored.block_hashes[:2] == block_hashes(prompt, 4, num_pages=2)  # before the image
    assert stored.block_hashes[2] != block_hashes(prompt, 4, extra_keys=image_b)[2]
    assert stored.extra_keys[:3] == [None, None, len(b"image-a").to_bytes(4, "little") + b"image-a"]
    index = BlockIndex(num_replicas=1, page_size=4)
    index.apply(0, [stored])
    for extra in (image_a, image_b, None):
        got = index.match(prompt, extra_keys=extra)
        assert got == [cache.match(prompt, extra_keys=extra)] and got[0] in (20, 8)
    assert index.match(prompt, extra_keys=image_b) == [8]


def test_index_matches_each_cache() -> None:
    engines = [Engine(seed) for seed in (2, 3, 4)]
    for engine in engines[1:]:  # shared starting prompts, so replicas hold some blocks in common
        engine.prompts = engines[0].prompts
    index = BlockIndex(num_replicas=3, page_size=4)
    for _ in range(150):
        for replica, engine in enumerate(engines):
            index.apply(replica, engine.step())
        probes = engines[0].probes(3)
        for tokens, namespace in probes:
            assert index.match(tokens, namespace) == [e.cache.match(tokens, namespace) for e in engines]
    assert sum(index.num_blocks(r) for r in range(3)) > 20


def test_index_rejects_bad_input_unchanged() -> None:
    index = BlockIndex(num_replicas=2, page_size=4)
    index.apply(0, [BlockStored(block_hashes(list(range(8)), 4), None, list(range(8)), 4)])
    with pytest.raises(ValueError, match="replica"):
        index.apply(2, [])
    with pytest.raises(ValueError, match="blocks of 2 tokens"):
        index.apply(1, [BlockRemoved([1]), BlockStored([1], None, [1, 2], 2)])
    with pytest.raises(ValueError, match="num_replicas"):
        BlockIndex(num_replicas=0, page_size=4)
    assert index.match(list(range(9))) == [8, 0]
    assert index.match(list(range(9)), namespace="other") == [0, 0]


def test_block_hashes_of_a_prompt_are_its_prefix_chain() -> None:
    tokens = np.arange(40, dtype=np.int32)
    full = block_hashes(tokens, 8)
    assert len(full) == 5 and block_hashes(tokens[:20], 8) == full[:2]
    assert block_hashes(tokens, 8, num_pages=3) == full[:3]


# ---------------------------------------------------------------------- streams into the index


def test_subscriber_keeps_the_index_right_including_a_late_join() -> None:
    engines = [Engine(seed) for seed in (5, 6)]
    index = BlockIndex(num_replicas=2, page_size=4)
    pubs = [KVEventPublisher(LOOPBACK, LOOPBACK) for _ in engines]
    try:
        for _ in range(30):  # before anyone listens: PUB drops these, the replay buffer keeps them
            for pub, engine in zip(pubs, engines, strict=True):
                pub.publish(engine.step())
        for pub in pubs:
            pub.flush()
        with KVEventSubscriber(index) as sub:
            for replica, pub in enumerate(pubs):
                sub.connect(replica, pub.endpoint, pub.replay_endpoint)
            time.sleep(0.2)
            for _ in range(60):
                for pub, engine in zip(pubs, engines, strict=True):
                    pub.publish(engine.step())
                sub.wait_for({r: pub.next_seq for r, pub in enumerate(pubs)})
                for tokens, namespace in engines[0].probes(2) + engines[1].probes(2):
                    assert index.match(tokens, namespace) == [
                        e.cache.match(tokens, namespace) for e in engines
                    ]
            for replica in range(2):
                counters = sub.counters(replica)
                assert counters.gaps >= 1 and counters.replays >= 1 and counters.resyncs == 0
                assert counters.batches == pubs[replica].next_seq
    finally:
        for pub in pubs:
            pub.close()


def test_subscriber_resyncs_when_the_replay_buffer_is_too_short() -> None:
    engine = Engine(seed=7)
    index = BlockIndex(num_replicas=1, page_size=4)
    with KVEventPublisher(LOOPBACK, LOOPBACK, buffer_batches=3) as pub, KVEventSubscriber(index) as sub:
        for _ in range(30):
            pub.publish(engine.step())
        pub.flush()
        sub.connect(0, pub.endpoint, pub.replay_endpoint)
        for _ in range(40):
            pub.publish(engine.step())
            sub.wait_for({0: pub.next_seq})
            for tokens, namespace in engine.probes(3):
                # Blocks stored before the oldest replayed batch are unknown: never more than the cache.
                assert index.match(tokens, namespace)[0] <= engine.cache.match(tokens, namespace)
        assert sub.counters(0).resyncs == 1
        engine.cache.reset()  # AllBlocksCleared: from here on the index is exact again
        events = engine.cache.drain_events()
        assert events == [AllBlocksCleared()]
        pub.publish(events)
        for _ in range(20):
            pub.publish(engine.step())
        sub.wait_for({0: pub.next_seq})
        for tokens, namespace in engine.probes(10):
            assert index.match(tokens, namespace) == [engine.cache.match(tokens, namespace)]


@pytest.mark.parametrize("release", ["0.33", "older"])
@pytest.mark.parametrize("serve_replay", [True, False])
def test_a_lost_message_is_replayed_or_resynced(serve_replay: bool, release: str) -> None:
    """A vLLM replica of each kind: 0.33 (map events, replay framed (topic, seq, payload)) and an
    older one (array events, replay framed (seq, payload))."""
    a, b = block_hashes(list(range(8)), 4), block_hashes(list(range(100, 108)), 4)
    stored, removed = (
        (VllmBlockStored, VllmBlockRemoved) if release == "0.33" else (ArrayBlockStored, ArrayBlockRemoved)
    )
    batches = {
        0: vllm_payload([stored(a, None, list(range(8)), 4, None, "GPU", None)]),
        1: vllm_payload([removed([a[1]], "GPU")]),  # lost on the way
        2: vllm_payload([stored(b, None, list(range(100, 108)), 4, None, "GPU", None)]),
    }
    replica = FakeReplica(batches, serve_replay, topic=b"kv" if release == "0.33" else None)
    index = BlockIndex(num_replicas=1, page_size=4)
    try:
        with KVEventSubscriber(index, replay_timeout=2.0) as sub:
            sub.connect(0, replica.endpoint, replica.replay_endpoint)
            time.sleep(0.3)
            replica.send(0)
            while sub.next_seq(0) < 3:  # until batch 2 got through (PUB drops it before the subscription)
                replica.send(2)
                sub.poll(0.1)
            counters = sub.counters(0)
    finally:
        replica.close()
    assert counters.gaps >= 1 and counters.malformed == 0
    if serve_replay:
        # Batch 1 recovered: page 2 of prompt a was removed, prompt b is cached.
        assert index.match(list(range(9))) == [4] and index.match(list(range(100, 109))) == [8]
        assert counters.resyncs == 0 and replica.requests
    else:
        # Nothing to recover from: the replica's state is forgotten and rebuilt from batch 2 on.
        assert index.match(list(range(9))) == [0] and index.match(list(range(100, 109))) == [8]
        assert counters.resyncs == 1


def test_a_payload_that_does_not_decode_resyncs_the_replica() -> None:
    a, b = block_hashes(list(range(8)), 4), block_hashes(list(range(100, 108)), 4)
    batches = {
        0: vllm_payload([VllmBlockStored(a, None, list(range(8)), 4, None, "GPU", None)]),
        1: b"\xc1 not msgpack",
        2: vllm_payload([VllmBlockStored(b, None, list(range(100, 108)), 4, None, "GPU", None)]),
    }
    replica = FakeReplica(batches)
    index = BlockIndex(num_replicas=1, page_size=4)
    try:
        with KVEventSubscriber(index) as sub:
            sub.connect(0, replica.endpoint, replica.replay_endpoint)
            time.sleep(0.3)
            for seq in (0, 1):
                replica.send(seq)
            while sub.next_seq(0) < 3:
                replica.send(2)
                sub.poll(0.1)
            counters = sub.counters(0)
    finally:
        replica.close()
    assert counters.malformed == 1 and counters.resyncs >= 1
    assert index.match(list(range(9))) == [0] and index.match(list(range(100, 109))) == [8]


# ---------------------------------------------------------------------- events in order within a batch


def _stored(tokens: list[int], page_size: int = 4) -> BlockStored:
    keys = block_hashes(tokens, page_size)
    return BlockStored(keys, None, tokens[: len(keys) * page_size], page_size)


def test_clear_then_store_in_one_batch_keeps_what_follows_the_clear() -> None:
    a, b = list(range(12)), list(range(100, 112))
    index = BlockIndex(num_replicas=2, page_size=4)
    index.apply(0, [_stored(a)])
    index.apply(1, [_stored(a)])
    # What reset() and every overflow drain produce: a clear, then the blocks cached now.
    index.apply(0, [AllBlocksCleared(), _stored(b)])
    assert index.num_blocks(0) == 3 and index.match([*b, 0]) == [12, 0]
    assert index.match([*a, 0]) == [0, 12]
    index.apply(0, [BlockRemoved(block_hashes(b, 4)[1:])])  # removed after the clear: gone
    assert index.match([*b, 0]) == [4, 0] and index.num_blocks(0) == 1
    index.apply(1, [AllBlocksCleared(), _stored(a), AllBlocksCleared()])
    assert index.match([*a, 0]) == [0, 0] and index.num_keys() == 1


def test_index_follows_a_cache_through_overflow_drains() -> None:
    """A cache whose event backlog overflows drains AllBlocksCleared + BlockStored for every block
    cached: the index must end up with exactly the cache's blocks, and stay right afterwards."""
    engine = Engine(seed=11, num_pages=60)
    engine.cache = PrefixCache(num_pages=60, page_size=4, max_events=6)
    index = BlockIndex(num_replicas=1, page_size=4)
    overflows = 0
    for step in range(120):
        for _ in range(1 + step % 4):  # several requests per drain: the backlog overflows at times
            engine.step_without_drain()
        events = engine.cache.drain_events()
        if events and type(events[0]) is AllBlocksCleared and len(events) > 1:
            overflows += 1
        index.apply(0, events)
        assert index.num_blocks(0) == engine.cache.num_cached_pages
        for tokens, namespace in engine.probes(4):
            assert index.match(tokens, namespace) == [engine.cache.match(tokens, namespace)]
    assert overflows > 5


def test_match_checks_its_arguments_whatever_the_index_holds() -> None:
    index = BlockIndex(num_replicas=2, page_size=4)
    with pytest.raises(TypeError, match="namespace"):
        index.match(list(range(9)), namespace=1.5)
    with pytest.raises(ValueError, match="extra_keys"):
        index.match(list(range(9)), extra_keys=[(5, 50, b"x")])
    with pytest.raises(TypeError, match="extra_keys"):
        index.match(list(range(9)), extra_keys=[(0, 4)])
    with pytest.raises(ValueError):
        index.match([-1, 2, 3])


class IndexMachine(RuleBasedStateMachine):
    """BlockIndex against a model: per replica, each key's media as its events leave them, the
    events applied one at a time in order; batches mix stores and removals on both tiers (and on a
    medium the index does not follow), and clears."""

    PROMPTS = (
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23],
        [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37],
        [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
    )
    MEDIA = ("GPU", "CPU")

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(num_replicas=3, page_size=4)
        self.model: list[dict[int, set[str]]] = [{}, {}, {}]
        self.keys = [block_hashes(p, 4) for p in self.PROMPTS]

    @rule(
        replica=st.integers(0, 2),
        batch=st.lists(
            st.tuples(
                st.sampled_from(["store", "remove", "clear"]),
                st.integers(0, 3),
                st.integers(0, 2),
                st.integers(1, 3),
                st.sampled_from(["GPU", "GPU", "CPU", "CPU", "STORAGE"]),
            ),
            max_size=6,
        ),
    )
    def apply(self, replica: int, batch: list[tuple[str, int, int, int, str]]) -> None:
        events = []
        held = self.model[replica]
        for kind, prompt, start, stop, medium in batch:
            keys = self.keys[prompt][start:stop]  # a run of the chain: either tier may hold any part
            if kind == "store":
                events.append(
                    BlockStored(keys, None, self.PROMPTS[prompt][4 * start : 4 * stop], 4, medium=medium)
                )
                for key in keys:
                    held.setdefault(key, set()).add(medium)
            elif kind == "remove":
                events.append(BlockRemoved(keys, medium=medium))
                for key in keys:
                    held.get(key, set()).discard(medium)
            else:
                events.append(AllBlocksCleared())
                held.clear()
        self.index.apply(replica, events)

    @rule(replica=st.integers(0, 2))
    def clear(self, replica: int) -> None:
        self.index.clear(replica)
        self.model[replica] = {}

    def tiers(self, replica: int, key: int) -> set[str]:
        """The media the index follows that hold ``key`` on ``replica``, per the model."""
        return self.model[replica].get(key, set()) & set(self.MEDIA)

    @invariant()
    def agrees(self) -> None:
        holding = [{key for key in self.model[r] if self.tiers(r, key)} for r in range(3)]
        assert [self.index.num_blocks(r) for r in range(3)] == [len(keys) for keys in holding]
        assert self.index.num_keys() == len(set().union(*holding))
        for prompt, keys in zip(self.PROMPTS, self.keys, strict=True):
            want = []
            for replica in range(3):
                run = 0
                while run < len(keys) and self.tiers(replica, keys[run]):
                    run += 1
                gpu = 0
                while gpu < run and "GPU" in self.tiers(replica, keys[gpu]):
                    gpu += 1
                want.append((4 * gpu, 4 * (run - gpu)))
            assert self.index.match_tiers([*prompt, 0]) == want
            assert self.index.match([*prompt, 0]) == [gpu + host for gpu, host in want]


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_block_moved_to_the_host_and_back_keeps_its_place_in_the_prefix() -> None:
    """A move is a removal from one medium and a store on the other: the prefix stays matched, and
    match_tiers says which part is on the GPU and which would be loaded from the host."""
    prompt = list(range(16))  # 4 pages
    keys = block_hashes(prompt, 4)
    probe = [*prompt, 0]
    index = BlockIndex(num_replicas=2, page_size=4)
    index.apply(0, [_stored(prompt)])
    index.apply(1, [_stored(prompt[:8])])
    assert index.match_tiers(probe) == [(16, 0), (8, 0)]
    # Replica 0's last two pages go to the host, descendants first.
    tail = BlockStored(keys[2:], keys[1], prompt[8:], 4, medium="CPU")
    index.apply(0, [BlockRemoved(keys[3:]), BlockRemoved(keys[2:3]), tail])
    assert index.match_tiers(probe) == [(8, 8), (8, 0)]
    assert index.match(probe) == [16, 8] and index.num_blocks(0) == 4 and index.num_keys() == 4
    # Page 3 loaded back onto the GPU: the prefix on the GPU still ends at page 2, which is on the host.
    index.apply(0, [BlockRemoved(keys[3:], medium="CPU"), BlockStored(keys[3:], keys[2], prompt[12:], 4)])
    assert index.match_tiers(probe) == [(8, 8), (8, 0)]
    # Page 2 on both tiers: GPU all the way.
    index.apply(0, [BlockStored(keys[2:3], keys[1], prompt[8:12], 4)])
    assert index.match_tiers(probe) == [(16, 0), (8, 0)] and index.num_blocks(0) == 4
    # Leaving one tier keeps the block while the other holds it; leaving both forgets it.
    index.apply(0, [BlockRemoved(keys[2:3])])
    assert index.match_tiers(probe) == [(8, 8), (8, 0)]
    index.apply(0, [BlockRemoved(keys[3:]), BlockRemoved(keys[2:3], medium="CPU")])
    assert index.match_tiers(probe) == [(8, 0), (8, 0)] and index.num_blocks(0) == 2
    # Removing a block from a tier that does not hold it changes nothing.
    index.apply(1, [BlockRemoved(keys[:2], medium="CPU")])
    assert index.match_tiers(probe) == [(8, 0), (8, 0)]
    index.clear(0)
    assert index.match_tiers(probe) == [(0, 0), (8, 0)] and index.num_keys() == 2


def test_blocks_of_other_media_are_not_counted() -> None:
    """vLLM's "STORAGE" tier (disk) is neither tier the index follows: its events change nothing."""
    prompt = list(range(8))
    keys = block_hashes(prompt, 4)
    index = BlockIndex(num_replicas=1, page_size=4)
    index.apply(0, [BlockStored(keys, None, prompt, 4, medium="STORAGE")])
    assert index.match([*prompt, 0]) == [0] and index.num_blocks(0) == 0
    index.apply(0, [BlockStored(keys, None, prompt, 4, medium="CPU"), BlockRemoved(keys, medium="STORAGE")])
    assert index.match_tiers([*prompt, 0]) == [(0, 8)]


def test_host_tier_events_reach_the_index_through_the_wire() -> None:
    """A vLLM replica offloading to CPU memory: its "CPU" events, decoded, fill the host part."""
    prompt = list(range(12))
    keys = block_hashes(prompt, 4)
    payload = vllm_payload(
        [
            VllmBlockStored(keys, None, prompt, 4, None, "GPU", None),
            VllmBlockStored(keys[1:], keys[0], prompt[4:], 4, None, "CPU", None),
            VllmBlockRemoved(keys[1:], "GPU"),
        ]
    )
    index = BlockIndex(num_replicas=1, page_size=4)
    index.apply(0, BatchDecoder().decode(payload)[1])
    assert index.match_tiers([*prompt, 0]) == [(4, 8)] and index.match([*prompt, 0]) == [12]


def test_a_restarted_publisher_is_a_resync_not_duplicates() -> None:
    """An engine restarted on the same ports starts again at sequence number 0 with an empty cache:
    its batches must be applied, and the blocks from before the restart forgotten."""
    a, b = list(range(8)), list(range(100, 108))
    index = BlockIndex(num_replicas=1, page_size=4)
    first = KVEventPublisher(LOOPBACK, LOOPBACK)
    endpoints = first.endpoint, first.replay_endpoint
    with KVEventSubscriber(index, replay_timeout=2.0) as sub:
        sub.connect(0, *endpoints)
        time.sleep(0.2)
        first.publish([_stored(a)])
        for i in range(10):
            first.publish([BlockRemoved([i])])  # nothing held: a heartbeat
            sub.poll(0.01)
        sub.wait_for({0: first.next_seq})
        first.close()
        assert index.match([*a, 0]) == [8]
        deadline = time.monotonic() + 10
        while True:  # ZMQ releases a closed socket's port in its I/O thread, a moment later
            try:
                second = KVEventPublisher(*endpoints)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with second:
            second.publish([_stored(b)])
            deadline = time.monotonic() + 10
            while sub.counters(0).restarts == 0 and time.monotonic() < deadline:
                second.publish([BlockRemoved([1])])
                sub.poll(0.05)
            sub.wait_for({0: second.next_seq})
            counters = sub.counters(0)
    assert counters.restarts == 1 and counters.malformed == 0
    assert index.match([*b, 0]) == [8]  # the new engine's batch 0, replayed
    assert index.match([*a, 0]) == [0]  # the old engine's blocks: gone with it


@pytest.mark.parametrize(("seed", "keep"), [(1, None), (2, None), (3, 4), (4, 1)])
def test_a_lossy_stream_never_shows_a_block_the_replica_does_not_hold(seed: int, keep: int | None) -> None:
    """Live messages dropped (alone and in bursts) and sent twice at random, the replay buffer whole
    or short: with every
    missed batch replayable the index ends exact; with some gone it may miss blocks, never invent one."""
    rng = random.Random(seed)
    engine = Engine(seed=seed)
    batches: dict[int, bytes] = {}
    replica = FakeReplica(batches, keep=keep)
    index = BlockIndex(num_replicas=1, page_size=4)
    try:
        with KVEventSubscriber(index, replay_timeout=2.0) as sub:
            sub.connect(0, replica.endpoint, replica.replay_endpoint)
            burst = 0
            for seq in range(80):
                events = engine.step()
                batches[seq] = msgspec.msgpack.encode(to_wire(events or [AllBlocksCleared()], time.time(), 0))
                if rng.random() < 0.04:
                    burst = 5  # this batch and the next 4 lost: more than a short buffer keeps
                burst -= 1
                if burst < 0 and rng.random() < 0.8:  # else lost on the way
                    replica.send(seq)
                    if rng.random() < 0.1:
                        replica.send(seq)  # twice
                sub.poll(0.002)
            sub.wait_for({0: len(batches)})
            counters = sub.counters(0)
    finally:
        replica.close()
    assert counters.malformed == 0 and counters.restarts == 0
    for tokens, namespace in engine.probes(30):
        held, cached = index.match(tokens, namespace)[0], engine.cache.match(tokens, namespace)
        assert held == cached if counters.resyncs == 0 else held <= cached
    assert counters.gaps > 0 and (counters.resyncs == 0 if keep is None else counters.resyncs > 0)

"""KV events on the wire: vLLM's message format, the replay service, the block index, gap recovery.

The subscriber side of the format tests declares its own msgspec structs the way vLLM declares
them, so they check the bytes against vLLM's schema, not against the module that wrote them.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from xxhash import xxh3_64_intdigest

from prefix_cache.block_index import BlockIndex, block_hashes
from prefix_cache.cache import OutOfPages, PrefixCache
from prefix_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.kv_publisher import KVEventPublisher
from prefix_cache.kv_subscriber import KVEventSubscriber
from prefix_cache.kv_wire import END_SEQ

LOOPBACK = "tcp://127.0.0.1:0"


# ---------------------------------------------------------------------- vLLM's schema, declared here


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(VEventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


# ---------------------------------------------------------------------- a small engine


class Engine:
    """Random chats through one cache, a step at a time; prompts share prefixes so pages are reused,
    and the pool is small so pages are evicted."""

    def __init__(self, seed: int, num_pages: int = 40, page_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.cache = PrefixCache(num_pages=num_pages, page_size=page_size)
        self.prompts: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
        self.namespaces = [None, "tenant-a"]

    def step(self) -> list:
        """One request: a prompt extending a known one, prefilled, decoded a little, closed.
        Returns the events of the step."""
        rng = self.rng
        base = rng.choice(self.prompts)
        prompt = base[: rng.randint(1, min(len(base), 40))] + [
            rng.randint(0, 50) for _ in range(rng.randint(1, 12))
        ]
        namespace = rng.choice(self.namespaces)
        seq = self.cache.open(prompt, namespace)
        try:
            self.cache.allocate(seq, len(prompt) - seq.num_cached_tokens + 3)
        except OutOfPages:
            self.cache.close(seq)
            return self.cache.drain_events()
        self.cache.commit(seq, prompt[seq.num_cached_tokens :] + [rng.randint(0, 50) for _ in range(3)])
        self.prompts.append(seq.tokens.tolist())
        self.cache.close(seq)
        if rng.random() < 0.03:
            self.cache.reset()
        return self.cache.drain_events()

    def probes(self, count: int) -> list[tuple[list[int], object]]:
        rng = self.rng
        return [
            (rng.choice(self.prompts) + [rng.randint(0, 50) for _ in range(rng.randint(0, 5))], ns)
            for ns in self.namespaces
            for _ in range(count)
        ]


def recv_all(socket: zmq.Socket, timeout_ms: int = 2000) -> list[list[bytes]]:
    """Every message that arrives until none has for ``timeout_ms`` (50 ms once some came)."""
    messages = []
    while socket.poll(timeout_ms if not messages else 50):
        messages.append(socket.recv_multipart())
    return messages


def replay_request(endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay protocol from the client side: everything up to and including the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    frames = []
    while True:
        assert dealer.poll(5000), "no answer from the replay service"
        frame = dealer.recv_multipart()
        frames.append(frame)
        if frame[1] == END_SEQ:
            dealer.close()
            return frames


def vllm_view(event: BlockStored | BlockRemoved | AllBlocksCleared) -> VKVCacheEvent:
    """The event as a vLLM engine would have published it (GPU medium, no LoRA, no optional fields)."""
    if isinstance(event, BlockStored):
        return VBlockStored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, None, "GPU", None
        )
    if isinstance(event, BlockRemoved):
        return VBlockRemoved(event.block_hashes, "GPU")
    return VAllBlocksCleared()


# ---------------------------------------------------------------------- the wire format


def test_stream_and_replay_decode_to_the_cache_events_with_contiguous_seqs() -> None:
    engine = Engine(seed=1)
    context = zmq.Context.instance()
    with KVEventPublisher(LOOPBACK, LOOPBACK, topic="kv-events", data_parallel_rank=0) as pub:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(pub.endpoint)
        # PUB drops what it sends before the subscription reaches it: send warm-up batches until
        # one arrives, so that the batches under test all go out to an established subscriber.
        while True:
            pub.publish([AllBlocksCleared()])
            if sub.poll(100):
                break
        pub.flush()
        warmups = pub.next_seq
        assert len(recv_all(sub, 100)) <= warmups
        produced = []
        for _ in range(60):
            events = engine.step()
            if events:
                produced.append(events)
            pub.publish(events)
        pub.flush()
        live = recv_all(sub)
        replayed = replay_request(pub.replay_endpoint, warmups)
        sub.close()
    kinds = {type(e) for batch in produced for e in batch}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}  # the workload covers every event
    assert pub.published == warmups + len(produced) and pub.dropped == 0

    decoder = msgspec.msgpack.Decoder(VKVEventBatch)
    expected = [[vllm_view(e) for e in batch] for batch in produced]
    # Live: topic, 8-byte big-endian sequence numbers, contiguous, one message per batch.
    assert all(topic == b"kv-events" for topic, _, _ in live)
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in live]
    assert seqs == list(range(warmups, warmups + len(produced)))
    for (_, _, payload), events in zip(live, expected, strict=True):
        batch = decoder.decode(payload)
        assert batch.events == events and batch.data_parallel_rank == 0
        assert abs(batch.ts - time.time()) < 60
    # Replay from the first batch under test: each one again, in order, then the end marker.
    assert replayed[-1] == [b"", END_SEQ, b""]
    assert [int.from_bytes(f[1], "big") for f in replayed[:-1]] == seqs
    assert [f[2] for f in replayed[:-1]] == [payload for _, _, payload in live]


def test_payload_is_vllm_layout_field_for_field() -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK, data_parallel_rank=3) as pub:
        pub.publish(
            [BlockStored([11, 2**64 - 1], None, [1, 2, 3, 4], 2), BlockRemoved([11]), AllBlocksCleared()]
        )
        pub.flush()
        (_, seq, payload), end = replay_request(pub.replay_endpoint, 0)
    assert seq == (0).to_bytes(8, "big") and end[1] == END_SEQ
    ts, events, rank = msgspec.msgpack.decode(payload)  # an array of exactly three
    assert isinstance(ts, float) and rank == 3
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [11, 2**64 - 1],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_array_layout_decodes_with_the_older_vllm_structs() -> None:
    events = [BlockStored([5, 6], 4, [1, 2, 3, 4], 2), BlockRemoved([6]), AllBlocksCleared()]
    with KVEventPublisher(LOOPBACK, LOOPBACK, layout="array") as pub:
        pub.publish(events)
        pub.flush()
        (_, _, payload), _ = replay_request(pub.replay_endpoint, 0)
    assert msgspec.msgpack.decode(payload)[1][1] == ["BlockRemoved", [6], "GPU"]
    batch = msgspec.msgpack.Decoder(LegacyBatch).decode(payload)
    assert batch.events == [
        LegacyBlockStored([5, 6], 4, [1, 2, 3, 4], 2, None, "GPU", None),
        LegacyBlockRemoved([6], "GPU"),
        LegacyAllBlocksCleared(),
    ]


def test_replay_from_the_middle_and_a_bounded_buffer() -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK, buffer_batches=4) as pub:
        for i in range(10):
            pub.publish([BlockRemoved([i])])
        pub.publish([])  # nothing to say: no batch, no sequence number
        pub.flush()
        assert pub.next_seq == 10
        middle = replay_request(pub.replay_endpoint, 7)
        old = replay_request(pub.replay_endpoint, 0)
    decoder = msgspec.msgpack.Decoder(VKVEventBatch)
    assert [(int.from_bytes(f[1], "big"), decoder.decode(f[2]).events) for f in middle[:-1]] == [
        (i, [VBlockRemoved([i], "GPU")]) for i in (7, 8, 9)
    ]
    # Only the last 4 batches are kept: the answer starts later than asked.
    assert [int.from_bytes(f[1], "big") for f in old[:-1]] == [6, 7, 8, 9]


def test_publish_rejects_bad_input_and_never_blocks() -> None:
    with pytest.raises(ValueError, match="buffer_batches"):
        KVEventPublisher(LOOPBACK, buffer_batches=0)
    with pytest.raises(ValueError, match="layout"):
        KVEventPublisher(LOOPBACK, layout="json")
    with pytest.raises(ValueError, match="data_parallel_rank"):
        KVEventPublisher(LOOPBACK, data_parallel_rank=-1)
    with KVEventPublisher(LOOPBACK, max_queue_batches=2) as pub:
        with pytest.raises(TypeError, match="events must hold"):
            pub.publish([BlockRemoved([1]), "stored"])
        with pytest.raises(TypeError, match="events must be a list"):
            pub.publish(BlockRemoved([1]))
        assert pub.next_seq == 0  # rejected input spent nothing
        start = time.perf_counter()
        accepted = [pub.publish([BlockRemoved([i])]) for i in range(2000)]
        elapsed = time.perf_counter() - start
        pub.flush()
        assert pub.published + pub.dropped == 2000 == pub.next_seq
        assert accepted.count(False) == pub.dropped
    assert elapsed < 5  # a full queue drops, it does not wait
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([BlockRemoved([1])])


# ---------------------------------------------------------------------- the hash and the index


def documented_hashes(tokens: list[int], page_size: int, namespace: object) -> list[int]:
    """The block hash as README.md documents it, written from the text alone."""
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


class FakeReplica:
    """A replica speaking the protocol by hand: a PUB socket whose messages the test chooses (so it
    can leave one out) and a ROUTER answering replay requests from a dict, in its own thread."""

    def __init__(self, batches: dict[int, bytes], serve_replay: bool = True) -> None:
        context = zmq.Context.instance()
        self.batches = batches
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}" if serve_replay else None
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            identity, _, start = self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            for seq in sorted(self.batches):
                if seq >= start_seq:
                    self.router.send_multipart((identity, b"", seq.to_bytes(8, "big"), self.batches[seq]))
            self.router.send_multipart((identity, b"", END_SEQ, b""))

    def send(self, seq: int) -> None:
        self.pub.send_multipart((b"", seq.to_bytes(8, "big"), self.batches[seq]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close()
        self.router.close()


def vllm_payload(events: list) -> bytes:
    return msgspec.msgpack.encode(VKVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))


@pytest.mark.parametrize("serve_replay", [True, False])
def test_a_lost_message_is_replayed_or_resynced(serve_replay: bool) -> None:
    a, b = block_hashes(list(range(8)), 4), block_hashes(list(range(100, 108)), 4)
    batches = {
        0: vllm_payload([VBlockStored(a, None, list(range(8)), 4, None, "GPU", None)]),
        1: vllm_payload([VBlockRemoved([a[1]], "GPU")]),  # lost on the way
        2: vllm_payload(
            [VBlockStored(b, None, list(range(100, 108)), 4, None, "GPU", None, extra_keys=[None])]
        ),
    }
    replica = FakeReplica(batches, serve_replay)
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
    assert counters.gaps >= 1
    if serve_replay:
        # Batch 1 recovered: page 2 of prompt a was removed, prompt b is cached.
        assert index.match(list(range(9))) == [4] and index.match(list(range(100, 109))) == [8]
        assert counters.resyncs == 0 and replica.requests
    else:
        # Nothing to recover from: the replica's state is forgotten and rebuilt from batch 2 on.
        assert index.match(list(range(9))) == [0] and index.match(list(range(100, 109))) == [8]
        assert counters.resyncs == 1


def test_block_hashes_of_a_prompt_are_its_prefix_chain() -> None:
    tokens = np.arange(40, dtype=np.int32)
    full = block_hashes(tokens, 8)
    assert len(full) == 5 and block_hashes(tokens[:20], 8) == full[:2]
    assert block_hashes(tokens, 8, num_pages=3) == full[:3]


def test_a_payload_that_does_not_decode_resyncs_the_replica() -> None:
    a, b = block_hashes(list(range(8)), 4), block_hashes(list(range(100, 108)), 4)
    batches = {
        0: vllm_payload([VBlockStored(a, None, list(range(8)), 4, None, "GPU", None)]),
        1: b"\xc1 not msgpack",
        2: vllm_payload([VBlockStored(b, None, list(range(100, 108)), 4, None, "GPU", None)]),
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

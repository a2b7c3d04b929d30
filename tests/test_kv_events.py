"""KV events on the wire: vLLM's message format, the publisher and its replay service."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from test_kv_events_helpers import (
    LOOPBACK,
    Engine,
    MapAllBlocksCleared,
    MapBlockRemoved,
    MapBlockStored,
    MapKVEventBatch,
    VBlockRemoved,
    VKVEventBatch,
    recv_all,
    replay_request,
    vllm_view,
)

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.events.publisher import KVEventPublisher
from prefix_cache.events.wire import END_SEQ, BatchDecoder

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
        ["BlockStored", [11, 2**64 - 1], None, [1, 2, 3, 4], 2, None, "GPU", None],
        ["BlockRemoved", [11], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_map_layout_is_vllm_current_encoding() -> None:
    events = [BlockStored([5, 6], 4, [1, 2, 3, 4], 2), BlockRemoved([6]), AllBlocksCleared()]
    with KVEventPublisher(LOOPBACK, LOOPBACK, data_parallel_rank=1, layout="map") as pub:
        pub.publish(events)
        pub.flush()
        (_, _, payload), _ = replay_request(pub.replay_endpoint, 0)
    raw = msgspec.msgpack.decode(payload)
    assert set(raw) == {"ts", "events", "data_parallel_rank"} and raw["data_parallel_rank"] == 1
    assert raw["events"][1] == {"type": "BlockRemoved", "block_hashes": [6], "medium": "GPU"}
    batch = msgspec.msgpack.Decoder(MapKVEventBatch).decode(payload)
    assert batch.events == [
        MapBlockStored([5, 6], 4, [1, 2, 3, 4], 2, None, "GPU", None),
        MapBlockRemoved([6], "GPU"),
        MapAllBlocksCleared(),
    ]
    # Our own decoder reads both encodings to the cache's events.
    assert BatchDecoder().decode(payload)[1] == events


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

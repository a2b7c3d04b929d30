"""KV events on the wire: vLLM's message formats, the publisher and its replay service."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from test_kv_events_helpers import (
    LOOPBACK,
    ArrayKVEventBatch,
    Engine,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventBatch,
    array_view,
    recv_all,
    replay_request,
    vllm_view,
)

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.events.publisher import KVEventPublisher
from prefix_cache.events.wire import END_SEQ, BatchDecoder, to_wire

# ---------------------------------------------------------------------- the wire format


@pytest.mark.parametrize("layout", ["vllm", "array"])
def test_stream_and_replay_decode_to_the_cache_events_with_contiguous_seqs(layout: str) -> None:
    engine = Engine(seed=1)
    context = zmq.Context.instance()
    with KVEventPublisher(LOOPBACK, LOOPBACK, topic="kv-events", layout=layout) as pub:
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

    decoder = msgspec.msgpack.Decoder(VllmKVEventBatch if layout == "vllm" else ArrayKVEventBatch)
    view = vllm_view if layout == "vllm" else array_view
    expected = [[view(e) for e in batch] for batch in produced]
    # Live: topic, 8-byte big-endian sequence numbers, contiguous, one message per batch.
    assert all(topic == b"kv-events" for topic, _, _ in live)
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in live]
    assert seqs == list(range(warmups, warmups + len(produced)))
    for (_, _, payload), events in zip(live, expected, strict=True):
        batch = decoder.decode(payload)
        assert batch.events == events and batch.data_parallel_rank == 0
        assert abs(batch.ts - time.time()) < 60
    # Replay from the first batch under test: each one again, in order, then the end marker, framed
    # as that layout's vLLM releases frame them: (topic, seq, payload) in 0.33, (seq, payload) before.
    if layout == "vllm":
        assert replayed[-1] == [b"", b"", END_SEQ, b""]
        assert all(len(f) == 4 and f[:2] == [b"", b"kv-events"] for f in replayed[:-1])
    else:
        assert replayed[-1] == [b"", END_SEQ, b""]
        assert all(len(f) == 3 and f[0] == b"" for f in replayed[:-1])
    assert [int.from_bytes(f[-2], "big") for f in replayed[:-1]] == seqs
    assert [f[-1] for f in replayed[:-1]] == [payload for _, _, payload in live]


def _str(text: str) -> bytes:
    """msgpack fixstr."""
    return bytes([0xA0 | len(text)]) + text.encode()


BIG = (2**64 - 1).to_bytes(8, "big")
TOKENS = b"\x94\x01\x02\xcd\x03\xe8\xce\x00\x01\x11\x70"  # [1, 2, 1000, 70000]


def _golden(layout: str, medium: str = "GPU") -> bytes:
    """The payload of ``golden_events(medium)`` at ts 1.5, rank 1, written out from the msgpack
    spec."""
    ts = b"\xcb" + bytes.fromhex("3ff8000000000000")  # float 64, 1.5
    if layout == "vllm":
        # 8 of the 16 keys BlockStored declares: msgspec gives such a struct a map16 header.
        stored = b"\xde\x00\x08" + b"".join(
            (
                _str("type") + _str("BlockStored"),
                _str("block_hashes") + b"\x92\x05\xcf" + BIG,
                _str("parent_block_hash") + b"\xc0",
                _str("token_ids") + TOKENS,
                _str("block_size") + b"\x02",
                _str("lora_id") + b"\xc0",
                _str("medium") + _str(medium),
                _str("lora_name") + b"\xc0",
            )
        )
        removed = b"\x83" + _str("type") + _str("BlockRemoved") + _str("block_hashes") + b"\x91\x05"
        removed += _str("medium") + _str(medium)
        cleared = b"\x81" + _str("type") + _str("AllBlocksCleared")
    else:
        stored = b"\x98" + _str("BlockStored") + b"\x92\x05\xcf" + BIG + b"\xc0" + TOKENS
        stored += b"\x02\xc0" + _str(medium) + b"\xc0"
        removed = b"\x93" + _str("BlockRemoved") + b"\x91\x05" + _str(medium)
        cleared = b"\x91" + _str("AllBlocksCleared")
    return b"\x93" + ts + b"\x93" + stored + removed + cleared + b"\x01"


GOLDEN_EVENTS = [
    BlockStored([5, 2**64 - 1], None, [1, 2, 1000, 70000], 2),
    BlockRemoved([5]),
    AllBlocksCleared(),
]


def golden_events(medium: str) -> list:
    """``GOLDEN_EVENTS`` with their blocks on ``medium``."""
    return [
        BlockStored([5, 2**64 - 1], None, [1, 2, 1000, 70000], 2, medium=medium),
        BlockRemoved([5], medium=medium),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("medium", ["GPU", "CPU"])
@pytest.mark.parametrize("layout", ["vllm", "array"])
def test_payload_bytes_are_the_golden_bytes_and_the_schema_bytes(layout: str, medium: str) -> None:
    """vllm: what vLLM 0.33's encoder writes for the same events (the batch an array, the events
    maps tagged by "type", defaults left out); array: the older all-array form. GPU events are the
    default ones; host-tier events differ only in their ``medium`` string."""
    events = GOLDEN_EVENTS if medium == "GPU" else golden_events(medium)
    assert events == golden_events(medium)
    ours = msgspec.msgpack.encode(to_wire(events, 1.5, 1, layout))
    assert ours == _golden(layout, medium)
    view = vllm_view if layout == "vllm" else array_view
    schema = VllmKVEventBatch if layout == "vllm" else ArrayKVEventBatch
    assert ours == msgspec.msgpack.encode(schema(1.5, [view(e) for e in events], 1))
    assert BatchDecoder().decode(ours) == (1.5, events, 1)


def test_published_payload_is_the_encoding_of_the_batch() -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK, data_parallel_rank=3) as pub:
        pub.publish(GOLDEN_EVENTS)
        pub.flush()
        (_, _, seq, payload), end = replay_request(pub.replay_endpoint, 0)
    assert seq == (0).to_bytes(8, "big") and end == [b"", b"", END_SEQ, b""]
    ts, events, rank = msgspec.msgpack.decode(payload)  # an array of exactly three
    assert isinstance(ts, float) and rank == 3
    assert payload == msgspec.msgpack.encode(to_wire(GOLDEN_EVENTS, ts, 3))
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}


def test_extra_keys_go_out_as_vllm_per_block_tuples() -> None:
    stored = BlockStored([7, 8], 6, [1, 2, 3, 4], 2, extra_keys=[None, b"\x03\x00\x00\x00img"])
    payload = msgspec.msgpack.encode(to_wire([stored], 2.0, 0))
    (event,) = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(payload).events
    assert event.extra_keys == [None, (b"\x03\x00\x00\x00img",)]
    assert BatchDecoder().decode(payload)[1] == [stored]
    # The array layout has no room for them (msgspec writes every field of an array-like struct).
    payload = msgspec.msgpack.encode(to_wire([stored], 2.0, 0, "array"))
    assert len(msgspec.msgpack.decode(payload)[1][0]) == 8


def test_decoder_reads_what_vllm_engines_send() -> None:
    """vLLM's optional fields, its own extra_keys shapes, and block hashes as bytes (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) read as the ints vLLM would have sent."""
    digest = bytes(range(32))
    events = [
        VllmBlockStored(
            [digest, 9],
            digest,
            [1, 2, 3, 4],
            2,
            None,
            "CPU",
            "adapter",
            extra_keys=[("adapter", ("mm-hash", 0)), None],
            group_idx=1,
            kv_cache_spec_kind="full",
            locality="LOCAL",
            session_id="s",
        ),
        VllmBlockRemoved([digest], "GPU", group_idx=1),
        VllmBlockRemoved([9], "CPU"),
        VllmBlockStored([9], None, [5, 6], 2, None, None, None),  # a medium of nil: the GPU
        VllmBlockRemoved([9], None),
    ]
    payload = msgspec.msgpack.encode(VllmKVEventBatch(3.0, events, 2))
    as_int = int.from_bytes(digest[-8:], "big")
    assert BatchDecoder().decode(payload) == (
        3.0,
        [
            BlockStored([as_int, 9], as_int, [1, 2, 3, 4], 2, medium="CPU"),
            BlockRemoved([as_int]),
            BlockRemoved([9], medium="CPU"),
            BlockStored([9], None, [5, 6], 2, medium="GPU"),
            BlockRemoved([9], medium="GPU"),
        ],
        2,
    )
    with pytest.raises(msgspec.ValidationError):
        BatchDecoder().decode(msgspec.msgpack.encode({"ts": 1.0, "events": [], "data_parallel_rank": 0}))


@pytest.mark.parametrize("layout", ["vllm", "array"])
def test_decoder_reads_a_missing_or_nil_medium_as_the_gpu(layout: str) -> None:
    """An event without ``medium`` (an array cut after ``block_size``, a map without the key) or
    with nil is a GPU one; any other medium is kept as sent."""
    if layout == "vllm":
        stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None}
        stored |= {"token_ids": [1, 2], "block_size": 2}
        events = [stored, {"type": "BlockRemoved", "block_hashes": [5]}]
        events += [stored | {"medium": None}, {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU"}]
    else:
        stored = ["BlockStored", [5], None, [1, 2], 2]
        events = [stored, ["BlockRemoved", [5]], [*stored, None, None], ["BlockRemoved", [5], "CPU"]]
    payload = msgspec.msgpack.encode([1.0, events, 0])
    assert BatchDecoder().decode(payload)[1] == [
        BlockStored([5], None, [1, 2], 2),
        BlockRemoved([5]),
        BlockStored([5], None, [1, 2], 2),
        BlockRemoved([5], medium="CPU"),
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
    decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
    assert [(int.from_bytes(f[2], "big"), decoder.decode(f[3]).events) for f in middle[:-1]] == [
        (i, [VllmBlockRemoved([i], "GPU")]) for i in (7, 8, 9)
    ]
    # Only the last 4 batches are kept: the answer starts later than asked.
    assert [int.from_bytes(f[2], "big") for f in old[:-1]] == [6, 7, 8, 9]


def test_replay_buffer_and_queue_are_bounded_in_bytes() -> None:
    """A long prefill's BlockStored is tens of KB: the caps count bytes, not only batches."""
    big = BlockStored(list(range(1, 513)), None, list(range(100_000, 108_192)), 16)
    with KVEventPublisher(LOOPBACK, LOOPBACK, buffer_bytes=100_000) as pub:
        for _ in range(6):
            pub.publish([big])
        pub.flush()
        kept = replay_request(pub.replay_endpoint, 0)[:-1]
    size = len(kept[-1][3])
    assert size > 30_000 and len(kept) == 100_000 // size  # the newest that fit
    assert [int.from_bytes(f[2], "big") for f in kept] == list(range(6 - len(kept), 6))
    with KVEventPublisher(LOOPBACK, max_queue_bytes=20_000) as pub:
        assert pub.publish([big]) is False  # estimated over the cap on its own: dropped
        assert pub.publish([BlockRemoved([1])]) is True
        pub.flush()
        assert (pub.dropped, pub.published, pub.next_seq) == (1, 1, 2)


def test_a_batch_that_cannot_be_encoded_is_reported_and_the_stream_goes_on() -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK) as pub:
        assert pub.publish([BlockRemoved([2**64])])  # accepted: checking every hash would cost the engine
        assert pub.publish([BlockRemoved([1])])
        pub.flush(timeout=5)
        assert pub.failed == 1 and isinstance(pub.last_error, OverflowError)
        assert pub.published == 1 and pub.next_seq == 2
        replayed = replay_request(pub.replay_endpoint, 0)
    # The failed batch's number is spent: subscribers see the gap and resynchronise.
    assert [int.from_bytes(f[2], "big") for f in replayed[:-1]] == [1]


def test_publish_rejects_bad_input_and_never_blocks() -> None:
    with pytest.raises(ValueError, match="buffer_batches"):
        KVEventPublisher(LOOPBACK, buffer_batches=0)
    with pytest.raises(ValueError, match="buffer_bytes"):
        KVEventPublisher(LOOPBACK, buffer_bytes=0)
    for layout in ("json", "map"):
        with pytest.raises(ValueError, match="layout"):
            KVEventPublisher(LOOPBACK, layout=layout)
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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_publish_raises_once_the_sender_thread_died() -> None:
    pub = KVEventPublisher(LOOPBACK)
    pub._pub.close(linger=0)  # the socket fails under the sender thread
    assert pub.publish([BlockRemoved([1])])
    pub._thread.join(timeout=5)
    with pytest.raises(RuntimeError, match="sender thread has stopped"):
        pub.publish([BlockRemoved([2])])
    with pytest.raises(TimeoutError):
        pub.flush(timeout=1)
    pub.close()

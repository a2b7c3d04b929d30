"""``KVEventPublisher``: a cache's events over ZMQ in vLLM's format, with vLLM's replay service.

The engine hands over each step's events between steps (``publish(cache.drain_events())``); a
background thread encodes them (:mod:`prefix_cache.events.wire`), sends them on a PUB socket and keeps
the last payloads for replay (at most ``buffer_batches`` of them and ``buffer_bytes`` bytes). A
second thread serves a ROUTER socket that answers replay requests the way vLLM's does: a request
``(identity, b"", start_seq)`` (8-byte big-endian) gets one message per buffered batch with
``seq >= start_seq``, then the end marker, framed as the layout's vLLM releases frame them
(:func:`prefix_cache.events.wire.replay_frames`).

Nothing here blocks the engine: ``publish`` only appends to a bounded queue and notifies a
condition, with no system call (a system call would hand the GIL to the woken thread mid-step).
Memory is bounded whatever the subscribers do: PUB drops messages for a subscriber more than
``hwm`` behind, the replay buffer holds ``buffer_batches`` payloads, and when the queue is full
(the thread starved of CPU) ``publish`` drops the batch and counts it; its sequence number is
spent, so subscribers see the gap and resynchronise. The queue is bounded in batches and in an
estimate of their encoded bytes (``max_queue_bytes``): one long prefill's ``BlockStored`` is tens of KB.

A batch the thread cannot encode (a block hash outside ``[0, 2**64)``, say) is counted in
``failed``, its error kept in ``last_error`` and logged; its sequence number is spent like a
dropped batch's, and the thread goes on with the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefix_cache.events.wire import Layout, check_layout, end_frames, replay_frames, to_wire

_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)
_log = logging.getLogger(__name__)
#: Upper bounds of the msgpack size of a block hash, a token id and an event's fixed part, in
#: bytes: the queue's size estimate (``max_queue_bytes``) costs no encoding on the engine's thread.
_HASH_BYTES, _TOKEN_BYTES, _EVENT_BYTES = 9, 5, 128


class KVEventPublisher:
    """Publishes batches of KV events on ``endpoint`` (PUB) and replays them on ``replay_endpoint``.

    Arguments:
        endpoint: ZMQ address the PUB socket binds, e.g. ``"tcp://*:5557"``; a port of 0 (``"tcp://
            127.0.0.1:0"``) picks a free one, see ``self.endpoint``.
        replay_endpoint: address the ROUTER socket binds, or None for no replay service.
        topic: first frame of every message.
        data_parallel_rank: the rank written into every batch.
        buffer_batches: batches kept for replay (vLLM's ``buffer_steps``).
        buffer_bytes: payload bytes kept for replay: the oldest batches go first past it.
        max_queue_batches: batches waiting for the thread before ``publish`` drops them.
        max_queue_bytes: estimated encoded bytes waiting for the thread before ``publish`` drops
            a batch (a batch alone over it is dropped too).
        hwm: the PUB socket's send high-water mark, in messages per subscriber.
        layout: ``"vllm"`` (what vLLM 0.33 sends: the batch an array, each event a map) or
            ``"array"`` (events as arrays too, what older vLLM sent and llm-d's indexer decodes);
            see :mod:`prefix_cache.events.wire`.

    Counters (read any time): ``published`` batches sent, ``bytes_sent`` bytes sent (all three frames),
    ``dropped`` batches dropped because the queue was full, ``failed`` batches that could not be
    encoded (``last_error`` the latest one's exception), ``replays`` requests answered.
    Use as a context manager, or call ``close``.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_batches: int = 10_000,
        buffer_bytes: int = 256 << 20,
        max_queue_batches: int = 10_000,
        max_queue_bytes: int = 256 << 20,
        hwm: int = 100_000,
        layout: Layout = "vllm",
    ) -> None:
        for name, value in (
            ("buffer_batches", buffer_batches),
            ("buffer_bytes", buffer_bytes),
            ("max_queue_batches", max_queue_batches),
            ("max_queue_bytes", max_queue_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_layout(layout)
        if (
            not isinstance(data_parallel_rank, int)
            or isinstance(data_parallel_rank, bool)
            or data_parallel_rank < 0
        ):
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._layout: Layout = layout
        self._max_queue = max_queue_batches
        self._max_queue_bytes = max_queue_bytes
        # Estimated bytes handed to the queue and taken from it, each written by one thread only.
        self._queued_in = 0
        self._queued_out = 0
        # publish() appends (deque appends are atomic) and sets _wake; it takes no lock the threads
        # hold, so the engine never waits for a thread that lost the GIL while holding one.
        self._queue: deque[tuple[int, float, list[KVCacheEvent], int] | None] = deque()
        self._wake = threading.Event()
        # Guards the replay buffer and the counters the threads update; flush waits on it.
        self._lock = threading.Condition()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._buffer_bytes = buffer_bytes
        self._buffered = 0
        self._next_seq = 0
        self.published = 0
        self.bytes_sent = 0
        self.dropped = 0
        self.failed = 0
        self.last_error: BaseException | None = None
        self.replays = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._closed = False
        #: Set by the sender thread when it dies of an error: ``publish`` raises from then on.
        self._sender_error: BaseException | None = None
        self._thread = threading.Thread(target=self._send_loop, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._replay_thread = None
        if self._replay is not None:
            self._replay_thread = threading.Thread(
                target=self._replay_loop, name="kv-event-replay", daemon=True
            )
            self._replay_thread.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next ``publish`` will take (batches handed over so far)."""
        return self._next_seq

    def publish(self, events: list[KVCacheEvent]) -> bool:
        """Queue one batch (the events of one engine step, oldest first) and return at once.

        An empty list is not published (it would spend a sequence number on nothing). Returns False
        when the batch was dropped because the queue is full (in batches or bytes).
        """
        if self._closed:
            raise RuntimeError("the publisher is closed")
        if self._sender_error is not None:
            raise RuntimeError("the publisher's sender thread has stopped") from self._sender_error
        if not isinstance(events, list):
            raise TypeError(f"events must be a list, got {type(events).__name__}")
        size = 0
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                size += _HASH_BYTES * len(event.block_hashes) + _TOKEN_BYTES * len(event.token_ids)
            elif kind is BlockRemoved:
                size += _HASH_BYTES * len(event.block_hashes)
            elif kind is not AllBlocksCleared:
                raise TypeError(
                    f"events must hold BlockStored, BlockRemoved or AllBlocksCleared, got {kind.__name__}"
                )
        if not events:
            return True
        size += _EVENT_BYTES * len(events)
        seq = self._next_seq
        self._next_seq = seq + 1
        if (
            len(self._queue) >= self._max_queue
            or self._queued_in - self._queued_out + size > self._max_queue_bytes
        ):
            self.dropped += 1
            return False
        self._queued_in += size
        self._queue.append((seq, time.time(), events, size))
        self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every batch handed to ``publish`` so far has been sent (or dropped);
        TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._next_seq
            while self.published + self.dropped + self.failed < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    unsent = target - self.published - self.dropped - self.failed
                    raise TimeoutError(f"{unsent} batches unsent after {timeout} s")
                self._lock.wait(min(left, 0.05))

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.append(None)
        self._wake.set()
        self._thread.join()
        if self._replay_thread is not None:
            self._replay_thread.join()
        self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the threads

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _send_loop(self) -> None:
        """The sender thread: the only user of the PUB socket."""
        try:
            self._send_batches()
        except BaseException as error:
            self._sender_error = error
            raise

    def _send_batches(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            self._wake.wait()
            self._wake.clear()  # before draining: a batch queued from here on sets it again
            while self._queue:
                item = self._queue.popleft()
                if item is None:
                    return
                seq, ts, events, size = item
                self._queued_out += size
                try:
                    payload = encoder.encode(to_wire(events, ts, self._rank, self._layout))
                except Exception as error:  # one bad batch must not stop the stream
                    _log.error("KV event batch %d not published: cannot encode it: %r", seq, error)
                    with self._lock:
                        self.failed += 1
                        self.last_error = error
                        self._lock.notify_all()
                    continue
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                with self._lock:
                    if len(self._buffer) == self._buffer.maxlen:
                        self._buffered -= len(self._buffer[0][1])
                    self._buffer.append((seq, payload))
                    self._buffered += len(payload)
                    while self._buffered > self._buffer_bytes and len(self._buffer) > 1:
                        self._buffered -= len(self._buffer.popleft()[1])
                    self.published += 1
                    self.bytes_sent += len(self._topic) + 8 + len(payload)
                    self._lock.notify_all()

    def _replay_loop(self) -> None:
        """The replay thread: the only user of the ROUTER socket; checks for close every 50 ms."""
        while not self._closed:
            if self._replay.poll(50):
                self._serve_replay()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: nothing to answer
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        for seq, payload in batches:
            self._replay.send_multipart(
                (identity, b"", *replay_frames(self._layout, self._topic, seq, payload))
            )
        self._replay.send_multipart((identity, b"", *end_frames(self._layout)))
        self.replays += 1


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind ``socket``; the address actually bound (the port filled in when ``endpoint`` asked for 0)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = socket.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    socket.bind(endpoint)
    return endpoint

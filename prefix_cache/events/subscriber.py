"""``KVEventSubscriber``: feeds a :class:`BlockIndex` from the ZMQ event streams of several replicas.

One SUB socket per replica reads ``(topic, seq, payload)`` messages in either layout
(:mod:`prefix_cache.events.wire`). Sequence numbers must follow each other; on a gap the subscriber
asks the replica's replay service (vLLM's protocol: a DEALER sends ``(b"", start_seq)`` and reads
``(b"", topic, seq, payload)`` messages, or ``(b"", seq, payload)`` from older releases, up to the
``END_SEQ`` marker) for the batches it missed. When they cannot be had (no replay service,
no answer within ``replay_timeout``, or the replay buffer no longer reaches back that far) it
resynchronises: it forgets the replica's blocks and continues from the oldest batch it has (a
payload that does not decode is handled the same way). After a
resync the index under-reports that replica (blocks it held before and still holds are not known
until stored again): a missed hit, never a false one.

A subscriber starting late sees a gap from sequence number 0 and recovers the same way, so it can
join a running replica whose replay buffer still holds its whole history.

A publisher restarted on the same ports starts again at sequence number 0. Live messages of one
publisher arrive in order, so a live sequence number below the last live one seen means a new
publisher: the subscriber counts a restart, forgets the replica's blocks and follows the new stream
from its first batch (replayed when missed). A live number from the last live one to the next
expected is a batch already applied (from a replay, or sent twice), and is skipped. A restart whose
first live batch seen is numbered at or above the old stream's last one looks like a gap or a
duplicate and is not detected (vLLM's protocol carries no publisher identity).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import zmq

from prefix_cache.events.index import BlockIndex
from prefix_cache.events.wire import BatchDecoder, parse_replay


@dataclass
class StreamCounters:
    """What one replica's stream delivered: batches and bytes (all frames) applied, gaps seen,
    replay requests made, resyncs (state forgotten), payloads that did not decode (each one a
    resync), publisher restarts detected (each one a resync)."""

    batches: int = 0
    bytes: int = 0
    gaps: int = 0
    replays: int = 0
    resyncs: int = 0
    malformed: int = 0
    restarts: int = 0


class _Stream:
    __slots__ = ("counters", "expected", "last_live", "replay", "replay_endpoint", "replica", "sub")

    def __init__(self, replica: int, sub: zmq.Socket, replay_endpoint: str | None) -> None:
        self.replica = replica
        self.sub = sub
        self.replay_endpoint = replay_endpoint
        self.replay: zmq.Socket | None = None
        self.expected = 0
        self.last_live = -1  # the last sequence number received live
        self.counters = StreamCounters()


class KVEventSubscriber:
    """Reads the event streams of the replicas of ``index`` and applies them to it.

    ``connect(replica, endpoint, replay_endpoint)`` once per replica, then ``poll`` whenever the
    index should catch up. One thread uses a subscriber (ZMQ sockets are not thread-safe).
    """

    def __init__(self, index: BlockIndex, *, replay_timeout: float = 1.0) -> None:
        self.index = index
        self.replay_timeout = replay_timeout
        self._ctx = zmq.Context.instance()
        self._streams: dict[int, _Stream] = {}
        self._by_socket: dict[zmq.Socket, _Stream] = {}
        self._poller = zmq.Poller()
        self._decoder = BatchDecoder()

    def connect(
        self, replica: int, endpoint: str, replay_endpoint: str | None = None, topic: str = ""
    ) -> None:
        """Subscribe to ``replica``'s PUB ``endpoint`` (messages whose topic starts with ``topic``),
        replaying missed batches from ``replay_endpoint`` (None: resync on every gap)."""
        self.index.num_blocks(replica)  # checks the replica number
        if replica in self._streams:
            raise ValueError(f"replica {replica} is already connected")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        sub.connect(endpoint)
        stream = _Stream(replica, sub, replay_endpoint)
        self._streams[replica] = stream
        self._by_socket[sub] = stream
        self._poller.register(sub, zmq.POLLIN)

    def counters(self, replica: int) -> StreamCounters:
        """The counters of ``replica``'s stream."""
        return self._streams[replica].counters

    def next_seq(self, replica: int) -> int:
        """The sequence number of the next batch ``replica``'s stream will apply."""
        return self._streams[replica].expected

    def poll(self, timeout: float = 0.0) -> int:
        """Apply every message waiting (until none is), waiting up to ``timeout`` seconds for the
        first; returns the number of batches applied."""
        applied = 0
        wait_ms = int(timeout * 1000)
        while True:
            ready = self._poller.poll(wait_ms)
            if not ready:
                return applied
            wait_ms = 0
            for socket, _ in ready:
                stream = self._by_socket[socket]
                while True:
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += self._receive(stream, frames)

    def wait_for(self, targets: dict[int, int], timeout: float = 10.0) -> None:
        """Poll until each replica's stream has applied every batch before ``targets[replica]``
        (a publisher's ``next_seq``); TimeoutError after ``timeout`` seconds.

        A stream that stays behind with nothing arriving for 0.1 s asks its replay service for the
        missing batches (the last ones may have been lost, e.g. sent before the subscription took
        effect, and no later message would reveal the gap)."""
        deadline = time.monotonic() + timeout
        quiet_since = time.monotonic()
        while True:
            behind = [self._streams[r] for r, seq in targets.items() if self._streams[r].expected < seq]
            if not behind:
                return
            now = time.monotonic()
            if now >= deadline:
                lagging = {s.replica: targets[s.replica] - s.expected for s in behind}
                raise TimeoutError(f"batches still missing after {timeout} s, per replica: {lagging}")
            if now - quiet_since > 0.1:
                for stream in behind:
                    stream.counters.gaps += 1
                    self._recover(stream)
                quiet_since = now
            if self.poll(min(deadline - now, 0.02)):
                quiet_since = time.monotonic()

    def close(self) -> None:
        """Close the sockets."""
        for stream in self._streams.values():
            stream.sub.close(linger=0)
            if stream.replay is not None:
                stream.replay.close(linger=0)
        self._streams.clear()
        self._by_socket.clear()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one message

    def _receive(self, stream: _Stream, frames: list[bytes]) -> int:
        """Handle one PUB message; returns the batches applied."""
        if len(frames) != 3 or len(frames[1]) != 8:
            return 0  # not an event batch
        seq = int.from_bytes(frames[1], "big")
        if seq < stream.last_live:
            # The sequence went back: a new publisher. Follow it from its first batch.
            stream.counters.restarts += 1
            self._resync(stream)
            stream.expected = 0
        stream.last_live = seq
        if seq < stream.expected:
            return 0  # already applied (seen in a replay)
        applied = 0
        if seq > stream.expected:
            stream.counters.gaps += 1
            applied += self._recover(stream)
            if seq < stream.expected:
                return applied
            if seq > stream.expected:
                self._resync(stream)
        self._apply(stream, seq, frames[2], sum(len(f) for f in frames))
        return applied + 1

    def _recover(self, stream: _Stream) -> int:
        """Fetch the batches from ``stream.expected`` on from the replay service and apply them;
        resync where they start later than asked. Returns the batches applied."""
        if stream.replay_endpoint is None:
            return 0
        if stream.replay is None:
            stream.replay = self._ctx.socket(zmq.DEALER)
            stream.replay.setsockopt(zmq.LINGER, 0)
            stream.replay.connect(stream.replay_endpoint)
        stream.counters.replays += 1
        stream.replay.send_multipart((b"", stream.expected.to_bytes(8, "big")))
        timeout_ms = int(self.replay_timeout * 1000)
        applied = 0
        while True:
            if not stream.replay.poll(timeout_ms):
                # No answer: a late reply would be misread as the answer to a later request.
                stream.replay.close(linger=0)
                stream.replay = None
                return applied
            frames = stream.replay.recv_multipart()
            parsed = parse_replay(frames)
            if parsed is None or parsed[0] < 0:
                return applied
            got, payload = parsed
            if got < stream.expected:
                continue
            if got > stream.expected:
                self._resync(stream)
            self._apply(stream, got, payload, sum(len(f) for f in frames[1:]))
            applied += 1

    def _resync(self, stream: _Stream) -> None:
        stream.counters.resyncs += 1
        self.index.clear(stream.replica)

    def _apply(self, stream: _Stream, seq: int, payload: bytes, size: int) -> None:
        try:
            _, events, _ = self._decoder.decode(payload)
        except msgspec.MsgspecError:
            # The batch's events are unknown, as if it had been lost for good.
            stream.counters.malformed += 1
            self._resync(stream)
            events = []
        self.index.apply(stream.replica, events)
        stream.expected = seq + 1
        stream.counters.batches += 1
        stream.counters.bytes += size

"""Shared by the KV event tests: vLLM's event schema declared the way vLLM declares it (so the tests
check our bytes against vLLM's schema, not against the module that wrote them), a small engine
producing events, the replay protocol from the client side, and a hand-driven replica."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import msgspec
import zmq

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.cache.prefix_cache import OutOfPages, PrefixCache
from prefix_cache.events.wire import END_SEQ

LOOPBACK = "tcp://127.0.0.1:0"


# ---------------------------------------------------------------------- vLLM's schemas, declared here
# From the field lists documented in docs/routers.md (vLLM 0.33's kv_events.py: the batch an array,
# each event a map tagged by "type", defaults omitted), not from the module that writes our bytes.


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


# Older vLLM releases and llm-d's indexer: the events are tagged arrays too.
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(VllmEventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


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
        self.step_without_drain()
        return self.cache.drain_events()

    def step_without_drain(self) -> None:
        """One request, its events left in the cache's backlog."""
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
            return
        self.cache.commit(seq, prompt[seq.num_cached_tokens :] + [rng.randint(0, 50) for _ in range(3)])
        self.prompts.append(seq.tokens.tolist())
        self.cache.close(seq)
        if rng.random() < 0.03:
            self.cache.reset()

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
    """vLLM's replay protocol from the client side: every message (frames after the DEALER's empty
    delimiter included) up to and including the end marker, whose next-to-last frame is END_SEQ."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    frames = []
    while True:
        assert dealer.poll(5000), "no answer from the replay service"
        frame = dealer.recv_multipart()
        frames.append(frame)
        if frame[-2] == END_SEQ:
            dealer.close()
            return frames


def vllm_view(event: BlockStored | BlockRemoved | AllBlocksCleared) -> VllmEvent:
    """The event as a vLLM 0.33 engine would have published it (its medium, no LoRA)."""
    if isinstance(event, BlockStored):
        extras = None if event.extra_keys is None else [None if e is None else (e,) for e in event.extra_keys]
        return VllmBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            None,
            event.medium,
            None,
            extra_keys=extras,
        )
    if isinstance(event, BlockRemoved):
        return VllmBlockRemoved(event.block_hashes, event.medium)
    return VllmAllBlocksCleared()


def array_view(event: BlockStored | BlockRemoved | AllBlocksCleared) -> ArrayEvent:
    """The event as an older vLLM engine published it, all arrays."""
    if isinstance(event, BlockStored):
        return ArrayBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            None,
            event.medium,
            None,
        )
    if isinstance(event, BlockRemoved):
        return ArrayBlockRemoved(event.block_hashes, event.medium)
    return ArrayAllBlocksCleared()


class FakeReplica:
    """A replica speaking the protocol by hand: a PUB socket whose messages the test chooses (so it
    can leave one out) and a ROUTER answering replay requests from a dict (the newest ``keep``
    batches of it, all by default), in its own thread. The dict may grow while it runs."""

    def __init__(
        self,
        batches: dict[int, bytes],
        serve_replay: bool = True,
        topic: bytes = b"",
        keep: int | None = None,
    ) -> None:
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
        self.topic = topic  # a topic: vLLM 0.33's replay framing, (topic, seq, payload); None: the older one
        self.keep = keep
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
            head = (identity, b"") if self.topic is None else (identity, b"", self.topic)
            batches = self.batches.copy()  # one C call: safe against the test thread adding batches
            kept = sorted(batches)[-self.keep :] if self.keep else sorted(batches)
            for seq in kept:
                if seq >= start_seq:
                    self.router.send_multipart((*head, seq.to_bytes(8, "big"), batches[seq]))
            end = (identity, b"") if self.topic is None else (identity, b"", b"")
            self.router.send_multipart((*end, END_SEQ, b""))

    def send(self, seq: int) -> None:
        self.pub.send_multipart((self.topic or b"", seq.to_bytes(8, "big"), self.batches[seq]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close()
        self.router.close()


def vllm_payload(events: list) -> bytes:
    """A vLLM 0.33 batch of ``events`` (``Vllm*`` structs, or ``Array*`` ones for the older layout)."""
    return msgspec.msgpack.encode(VllmEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

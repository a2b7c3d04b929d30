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


# ---------------------------------------------------------------------- vLLM's schema, declared here


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
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


# vLLM's current kv_events.py: the same structs without array_like, so batches and events are maps.
class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(MapEventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


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

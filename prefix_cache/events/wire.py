"""KV events on the wire, in the formats vLLM engines publish (``vllm/distributed/kv_events.py``).

One ZMQ multipart message per batch of events: ``(topic, sequence number, payload)``.

- ``topic``: bytes, the publisher's topic (empty by default; SUB sockets filter on its prefix).
- sequence number: 8 bytes, big-endian unsigned, 0 for the first batch and +1 per batch.
- payload: msgpack of ``EventBatch``, the array ``[ts, events, data_parallel_rank]`` (``ts`` a
  float, seconds since the epoch; ``data_parallel_rank`` an int), with the events in one of two
  layouts:

  - ``layout="vllm"`` (the default): each event a map whose ``"type"`` names it, fields in
    declaration order, optional fields left out while at their defaults. This is what vLLM 0.33's
    ``ZmqEventPublisher`` sends (``EventBatch`` declared ``array_like=True``, ``KVCacheEvent``
    ``tag=True`` without it), byte for byte for the same events.
  - ``layout="array"``: each event the tagged array ``[type, field, ...]``, what older vLLM
    releases sent (their ``KVCacheEvent`` was ``array_like`` too) and what llm-d's KV-cache
    indexer decodes.

  The events, in field order:

  - ``BlockStored``: ``block_hashes`` (list of uint64), ``parent_block_hash`` (uint64 or nil for a
    prompt's first page), ``token_ids`` (``len(block_hashes) * block_size`` ints), ``block_size``,
    ``lora_id`` (nil), ``medium`` (the event's: ``"GPU"``, or ``"CPU"`` for the host tier),
    ``lora_name`` (nil); in the vllm layout also ``extra_keys`` when a page has extra keys (per
    block, nil or a 1-tuple of the page's extra identity bytes, see
    :mod:`prefix_cache.cache.hashing`).
  - ``BlockRemoved``: ``block_hashes``, ``medium`` (the event's).
  - ``AllBlocksCleared``: no fields.

The replay service answers a request with one message per buffered batch and an end marker; the
framing follows the layout (what the vLLM releases sending that layout do), after the ROUTER's
identity and the empty delimiter: ``vllm``: ``(topic, seq, payload)`` then ``(b"", END_SEQ, b"")``;
``array``: ``(seq, payload)`` then ``(END_SEQ, b"")``.

:class:`BatchDecoder` reads both layouts, from our publishers and from vLLM's: it keeps ``medium``
(nil or left out reads as ``"GPU"``) and ignores vLLM's other optional fields, and reads a block
hash sent as bytes (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) as the int vLLM would have
sent, its last 8 bytes big-endian.
"""

# No ``from __future__ import annotations``: msgspec resolves the struct annotations at runtime.
from typing import Any, Literal

import msgspec

from prefix_cache.cache import events as cache_events

#: The sequence number of the replay service's end marker: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Layout = Literal["vllm", "array"]
LAYOUTS: tuple[str, ...] = ("vllm", "array")
_U64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch, an array in both layouts."""

    ts: float
    events: list
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------- the vllm layout: map events


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


# vLLM 0.33's optional fields are declared although never set: msgspec sizes a map's header by the
# fields a struct declares (16 and more take a map16 header), so the same bytes need the same list.
class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[bytes] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# ---------------------------------------------------------------- the array layout: array events


class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ENCODE = {
    "vllm": (_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared),
    "array": (_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared),
}


def check_layout(layout: object) -> None:
    """Raise ValueError unless ``layout`` is one of ``LAYOUTS``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def to_wire(
    events: list[cache_events.KVCacheEvent], ts: float, data_parallel_rank: int, layout: Layout = "vllm"
) -> EventBatch:
    """The ``EventBatch`` struct of ``events`` (as ``PrefixCache.drain_events`` returns them)."""
    check_layout(layout)
    stored, removed, cleared = _ENCODE[layout]
    maps = layout == "vllm"
    wire = []
    for event in events:
        kind = type(event)
        if kind is cache_events.BlockStored:
            fields = (
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                None,
                event.medium,
                None,
            )
            if maps and event.extra_keys is not None:
                extras = [None if extra is None else (extra,) for extra in event.extra_keys]
                wire.append(stored(*fields, extra_keys=extras))
            else:
                wire.append(stored(*fields))
        elif kind is cache_events.BlockRemoved:
            wire.append(removed(event.block_hashes, event.medium))
        elif kind is cache_events.AllBlocksCleared:
            wire.append(cleared())
        else:
            raise TypeError(
                f"events must hold BlockStored, BlockRemoved or AllBlocksCleared, got {kind.__name__}"
            )
    return EventBatch(ts=ts, events=wire, data_parallel_rank=data_parallel_rank)


# ---------------------------------------------------------------- decoding, lenient

Hash = int | bytes


class _InMap(msgspec.Struct, gc=False, tag=True):
    pass


class _InMapBlockStored(_InMap, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    extra_keys: list[Any] | None = None


class _InMapBlockRemoved(_InMap, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class _InMapAllBlocksCleared(_InMap, tag="AllBlocksCleared"):
    pass


class _InArray(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _InArrayBlockStored(_InArray, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None  # read for its position only: ``medium`` follows it
    medium: str | None = None


class _InArrayBlockRemoved(_InArray, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class _InArrayAllBlocksCleared(_InArray, tag="AllBlocksCleared"):
    pass


class _InMapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_InMapBlockStored | _InMapBlockRemoved | _InMapAllBlocksCleared]
    data_parallel_rank: int | None = None


class _InArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_InArrayBlockStored | _InArrayBlockRemoved | _InArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(key: Hash) -> int:
    """A block hash as an int: an int as is, bytes as vLLM converts them for its events (the
    last 8 bytes, big-endian)."""
    return key if type(key) is int else int.from_bytes(key, "big") & _U64


class BatchDecoder:
    """Decodes payloads into ``(ts, events, data_parallel_rank)``, the events as this library's
    ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``namespace`` None: the wire does not
    carry it; the block hashes already depend on it) and ``medium`` as sent (``"GPU"`` when nil
    or left out).

    Accepts both layouts. ``extra_keys`` entries in this library's form (a 1-tuple of bytes) come
    back as the bytes; vLLM's other shapes (LoRA names, salts, multimodal pairs) as None: the cache's
    event type holds bytes only, and a router recomputes keys from prompts, not from them.
    """

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(_InMapBatch)
        self._array = msgspec.msgpack.Decoder(_InArrayBatch)

    def decode(self, payload: bytes) -> tuple[float, list[cache_events.KVCacheEvent], int | None]:
        """Raise ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on a malformed payload."""
        try:
            batch = self._map.decode(payload)
        except msgspec.ValidationError:
            batch = self._array.decode(payload)
        events: list[cache_events.KVCacheEvent] = []
        for event in batch.events:
            kind = type(event)
            if kind is _InMapBlockStored or kind is _InArrayBlockStored:
                parent = event.parent_block_hash
                events.append(
                    cache_events.BlockStored(
                        [external_hash(key) for key in event.block_hashes],
                        None if parent is None else external_hash(parent),
                        event.token_ids,
                        event.block_size,
                        extra_keys=_extras(getattr(event, "extra_keys", None)),
                        medium=event.medium or cache_events.MEDIUM_GPU,
                    )
                )
            elif kind is _InMapBlockRemoved or kind is _InArrayBlockRemoved:
                events.append(
                    cache_events.BlockRemoved(
                        [external_hash(key) for key in event.block_hashes],
                        medium=event.medium or cache_events.MEDIUM_GPU,
                    )
                )
            else:
                events.append(cache_events.AllBlocksCleared())
        return batch.ts, events, batch.data_parallel_rank


def _extras(extras: list[Any] | None) -> list[bytes | None] | None:
    if extras is None:
        return None
    out = [
        entry[0] if isinstance(entry, list) and len(entry) == 1 and type(entry[0]) is bytes else None
        for entry in extras
    ]
    return out if any(entry is not None for entry in out) else None


def replay_frames(layout: Layout, topic: bytes, seq: int, payload: bytes) -> tuple[bytes, ...]:
    """The frames of one replayed batch after the identity and the empty delimiter."""
    if layout == "vllm":
        return (topic, seq.to_bytes(8, "big"), payload)
    return (seq.to_bytes(8, "big"), payload)


def end_frames(layout: Layout) -> tuple[bytes, ...]:
    """The replay service's end marker after the identity and the empty delimiter."""
    return (b"", END_SEQ, b"") if layout == "vllm" else (END_SEQ, b"")


def parse_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a replayed message as a DEALER receives it (``[b"", ...]``) in either
    framing, ``(-1, b"")`` for the end marker, None for anything else."""
    if len(frames) == 4 and frames[0] == b"":
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq_frame, payload = frames[1], frames[2]
    else:
        return None
    if len(seq_frame) != 8:
        return None
    if seq_frame == END_SEQ:
        return -1, b""
    return int.from_bytes(seq_frame, "big"), payload

"""KV events on the wire, in the message format a vLLM engine publishes (``vllm/distributed/kv_events.py``).

One ZMQ multipart message per batch of events: ``(topic, sequence number, payload)``.

- ``topic``: bytes, the publisher's topic (empty by default; SUB sockets filter on its prefix).
- sequence number: 8 bytes, big-endian unsigned, 0 for the first batch and +1 per batch.
- payload: msgpack of ``EventBatch`` ``(ts, events, data_parallel_rank)`` (``ts`` a float, seconds
  since the epoch; ``data_parallel_rank`` an int), in one of vLLM's two encodings:

  - ``layout="array"`` (the default): the batch is the array ``[ts, events, data_parallel_rank]`` and
    each event the tagged array ``[type, field, ...]``, as vLLM's structs declared
    ``array_like=True`` encode them (what llm-d's KV-cache indexer decodes);
  - ``layout="map"``: the batch is the map ``{"ts", "events", "data_parallel_rank"}`` and each
    event a map with its type under ``"type"``, as vLLM's current ``kv_events.py`` (no
    ``array_like``) encodes them.

  The events, in field order:

  - ``BlockStored``: ``block_hashes`` (list of uint64), ``parent_block_hash`` (uint64 or nil for a
    prompt's first page), ``token_ids`` (``len(block_hashes) * block_size`` ints), ``block_size``,
    ``lora_id`` (nil), ``medium`` (``"GPU"``), ``lora_name`` (nil); in the map layout also
    ``extra_keys`` when a page has extra keys (per block, nil or a 1-tuple of the page's extra
    identity bytes, see :mod:`prefix_cache.cache.hashing`). vLLM's other optional fields
    (``group_idx``, ``kv_cache_spec_kind``, ...) are left out.
  - ``BlockRemoved``: ``block_hashes``, ``medium``.
  - ``AllBlocksCleared``: no fields.

The structs below are declared with the field names, order and msgspec options of vLLM's, so either
side decodes the other's messages; the encoding is msgspec's.
"""

# No ``from __future__ import annotations``: msgspec resolves the struct annotations declared inside
# _event_structs at runtime, which string annotations of local classes would defeat.
from typing import Literal

import msgspec

from prefix_cache.cache import events as cache_events

MEDIUM_GPU = "GPU"
#: The sequence number of the replay service's end marker: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Layout = Literal["map", "array"]


def _event_structs(array_like: bool) -> tuple[type, type, type, type]:
    """``(BlockStored, BlockRemoved, AllBlocksCleared, EventBatch)`` for one layout."""

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        """Base of the tagged event structs."""

    class ArrayBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    # msgspec writes every field of an array-like struct, defaults too, so the optional extra_keys
    # (vLLM's per-block extra identity) goes out only in the map layout, where a default is omitted.
    class MapBlockStored(ArrayBlockStored, tag="BlockStored"):
        extra_keys: list[tuple[bytes] | None] | None = None

    BlockStored = ArrayBlockStored if array_like else MapBlockStored

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, EventBatch


_STRUCTS: dict[str, tuple[type, type, type, type]] = {
    "array": _event_structs(array_like=True),
    "map": _event_structs(array_like=False),
}


def _check_layout(layout: str) -> tuple[type, type, type, type]:
    structs = _STRUCTS.get(layout)
    if structs is None:
        raise ValueError(f"layout must be 'map' or 'array', got {layout!r}")
    return structs


def to_wire(
    events: list[cache_events.KVCacheEvent], ts: float, data_parallel_rank: int, layout: Layout = "array"
):
    """The ``EventBatch`` struct of ``events`` (as ``PrefixCache.drain_events`` returns them)."""
    stored, removed, cleared, batch = _check_layout(layout)
    extra = _no_extras if layout == "array" else _wire_extras
    wire = []
    for event in events:
        kind = type(event)
        if kind is cache_events.BlockStored:
            wire.append(
                stored(
                    block_hashes=event.block_hashes,
                    parent_block_hash=event.parent_block_hash,
                    token_ids=event.token_ids,
                    block_size=event.block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    **extra(event.extra_keys),
                )
            )
        elif kind is cache_events.BlockRemoved:
            wire.append(removed(block_hashes=event.block_hashes, medium=MEDIUM_GPU))
        elif kind is cache_events.AllBlocksCleared:
            wire.append(cleared())
        else:
            raise TypeError(
                f"events must hold BlockStored, BlockRemoved or AllBlocksCleared, got {kind.__name__}"
            )
    return batch(ts=ts, events=wire, data_parallel_rank=data_parallel_rank)


def _wire_extras(extras: list[bytes | None] | None) -> dict[str, list[tuple[bytes] | None] | None]:
    """Per block, vLLM's ``extra_keys`` entry: a tuple holding the page's extra identity bytes."""
    if extras is None:
        return {"extra_keys": None}
    return {"extra_keys": [None if extra is None else (extra,) for extra in extras]}


def _no_extras(extras: list[bytes | None] | None) -> dict:
    return {}


class BatchDecoder:
    """Decodes payloads into ``(ts, events, data_parallel_rank)``, the events as this library's
    ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``namespace`` None: the wire does not
    carry it; the block hashes already depend on it).

    Accepts both layouts, and the optional fields vLLM adds (it ignores them).
    """

    def __init__(self) -> None:
        self._decoders = {layout: msgspec.msgpack.Decoder(structs[3]) for layout, structs in _STRUCTS.items()}

    def decode(self, payload: bytes) -> tuple[float, list[cache_events.KVCacheEvent], int | None]:
        """Raise ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on a malformed payload."""
        try:
            batch = self._decoders["array"].decode(payload)
        except msgspec.ValidationError:
            batch = self._decoders["map"].decode(payload)
        events: list[cache_events.KVCacheEvent] = []
        for event in batch.events:
            name = type(event).__struct_config__.tag
            if name == "BlockStored":
                extras = getattr(event, "extra_keys", None)
                events.append(
                    cache_events.BlockStored(
                        event.block_hashes,
                        event.parent_block_hash,
                        event.token_ids,
                        event.block_size,
                        extra_keys=None if extras is None else [None if e is None else e[0] for e in extras],
                    )
                )
            elif name == "BlockRemoved":
                events.append(cache_events.BlockRemoved(event.block_hashes))
            else:
                events.append(cache_events.AllBlocksCleared())
        return batch.ts, events, batch.data_parallel_rank

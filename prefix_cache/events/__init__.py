"""KV events for routers: the events the cache emits, their wire format, and a router's block index.

The event types are the cache's (``prefix_cache.cache.events``), re-exported here. ``BlockIndex``
keeps which replica holds which blocks, each replica hashing blocks with its engine's scheme
(``.schemes``: this library's, or a vLLM engine's). The ZMQ publisher and subscriber
(``prefix_cache.events.publisher`` / ``.subscriber``) and the msgpack wire format (``.wire``) need
the ``events`` extra (pyzmq, msgspec) and are imported from their modules. User documentation:
``docs/routers.md``.
"""

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefix_cache.events.index import BlockIndex

__all__ = ["AllBlocksCleared", "BlockIndex", "BlockRemoved", "BlockStored", "KVCacheEvent"]

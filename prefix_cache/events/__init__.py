"""KV events for routers: the events the cache emits, their wire format, and a router's block index.

The event types are the cache's (``prefix_cache.cache.events``), re-exported here. ``BlockIndex``
keeps which replica holds which blocks. The ZMQ publisher and subscriber (``prefix_cache.events
.publisher`` / ``.subscriber``) and the msgpack wire format (``.wire``) need the ``events`` extra
(pyzmq, msgspec) and are imported from their modules.
"""

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefix_cache.events.index import BlockIndex

__all__ = ["AllBlocksCleared", "BlockIndex", "BlockRemoved", "BlockStored", "KVCacheEvent"]

"""The cache: a radix tree of hashed token pages over a fixed pool of KV page ids.

``PrefixCache`` is the engine's contract (match, open, allocate, commit, close and the per-step batch
calls); the modules beside it are its parts: the block tree and its nodes, the page pool and store,
block identity (hashing, token checks), the events it emits, statistics and invariant checks.
"""

from prefix_cache.cache.errors import ConcurrentUseError, InvariantError, OutOfPages, PrefixCacheError
from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.cache.sequence import Sequence
from prefix_cache.cache.stats import CacheStats
from prefix_cache.cache.transfers import Transfers

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "ConcurrentUseError",
    "InvariantError",
    "KVCacheEvent",
    "OutOfPages",
    "PrefixCache",
    "PrefixCacheError",
    "Sequence",
    "Transfers",
]

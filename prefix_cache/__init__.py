"""prefix-cache: prefix KV-cache bookkeeping and cascade attention for LLM serving engines.

``PrefixCache`` keeps the pages of shared prompt prefixes and hands out page tables;
``CascadePlanner`` turns a batch's page tables into shared-prefix levels. The attention backends that
run such a plan live in ``prefix_cache.attention`` (``create_backend("torch" | "triton" |
"flashinfer")``); they need torch, the bookkeeping here does not import it.
"""

from prefix_cache.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheStats,
    ConcurrentUseError,
    KVCacheEvent,
    OutOfPages,
    PrefixCache,
    PrefixCacheError,
    Sequence,
    Transfers,
)
from prefix_cache.planner import CascadeLevel, CascadePlan, CascadePlanner

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "CascadeLevel",
    "CascadePlan",
    "CascadePlanner",
    "ConcurrentUseError",
    "KVCacheEvent",
    "OutOfPages",
    "PrefixCache",
    "PrefixCacheError",
    "Sequence",
    "Transfers",
]
__version__ = "0.1.0"

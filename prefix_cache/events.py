"""Cache events for an outside router: which blocks became matchable here and which went away.

The shapes follow the KV events a vLLM engine publishes (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a router that already consumes those needs only a thin adapter. Block
hashes are the 64-bit chained keys of ``prefix_cache.hashing``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_cache.hashing import Namespace


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full pages of one sequence became cached.

    block_hashes: the pages' keys, in prompt order; each page's parent is the one before it.
    parent_block_hash: key of the page before the first one, None when the first is the prompt's
        first page.
    token_ids: the pages' tokens, ``len(block_hashes) * block_size`` ids.
    block_size: tokens per page.
    namespace: the namespace the pages are cached under.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    namespace: Namespace = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached pages were evicted; a page's descendants are always removed before it."""

    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is cached any more (emitted by ``PrefixCache.reset`` when it empties the cache)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

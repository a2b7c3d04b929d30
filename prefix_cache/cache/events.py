"""Cache events for an outside router: which blocks became matchable here and which went away.

The shapes follow the KV events a vLLM engine publishes (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a router that already consumes those needs only a thin adapter. Block
hashes are the 64-bit chained keys of ``prefix_cache.cache.hashing``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_cache.cache.hashing import Namespace


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full pages of one sequence became cached.

    block_hashes: the pages' keys, in prompt order; each page's parent is the one before it.
    parent_block_hash: key of the page before the first one, None when the first is the prompt's
        first page.
    token_ids: the pages' tokens, ``len(block_hashes) * block_size`` ids.
    block_size: tokens per page.
    namespace: the namespace the pages are cached under.
    extra_keys: per page, the extra identity bytes that follow its tokens in its hash (see
        ``prefix_cache.cache.hashing``), None for a page without; None when no page has any.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    namespace: Namespace = None
    extra_keys: list[bytes | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached pages were evicted; a page's descendants are always removed before it.

    block_hashes: the pages' keys.
    namespace: the namespace they were cached under (keys are unique within a namespace only).
    """

    block_hashes: list[int]
    namespace: Namespace = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Forget every block of this cache. Emitted by ``PrefixCache.reset``, and by
    ``PrefixCache.drain_events`` after the event backlog overflowed its cap: then the events that
    follow it in the same drain are ``BlockStored`` for every block cached at that moment."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

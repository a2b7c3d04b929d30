"""Cache events for an outside router: which blocks became matchable here and which went away.

The shapes follow the KV events a vLLM engine publishes (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a router that already consumes those needs only a thin adapter. Block
hashes are the 64-bit chained keys of ``prefix_cache.cache.hashing``.

``medium`` names the tier a block is on, as vLLM's events do: ``"GPU"`` (the KV pool) or ``"CPU"``
(the host tier, pinned host memory). A block moved from the GPU to the host is a
``BlockRemoved(medium="GPU")`` followed by a ``BlockStored(medium="CPU")`` of the same keys; a load
back is the reverse. Within one medium a page's descendants are removed before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_cache.cache.hashing import Namespace

#: The ``medium`` of a block in the KV pool.
MEDIUM_GPU = "GPU"
#: The ``medium`` of a block on the host tier.
MEDIUM_CPU = "CPU"


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
    medium: the tier the pages are now on, ``"GPU"`` or ``"CPU"`` (the host tier).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    namespace: Namespace = None
    extra_keys: list[bytes | None] | None = None
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached pages left a tier (evicted, or moved to the other tier); within one medium a page's
    descendants are always removed before it.

    block_hashes: the pages' keys.
    namespace: the namespace they were cached under (keys are unique within a namespace only).
    medium: the tier they left, ``"GPU"`` or ``"CPU"`` (the host tier); a page the other tier
        holds stays cached there.
    """

    block_hashes: list[int]
    namespace: Namespace = None
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Forget every block of this cache. Emitted by ``PrefixCache.reset``, and by
    ``PrefixCache.drain_events`` after the event backlog overflowed its cap: then the events that
    follow it in the same drain are ``BlockStored`` for every block cached at that moment."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

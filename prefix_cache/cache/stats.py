"""A snapshot of a cache's counters and occupancy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since the cache was built, and page occupancy at the time of the snapshot.

    Token counters count prompt tokens passed to ``PrefixCache.open`` (``match`` is not counted);
    page counters count pages.

    query_tokens: prompt tokens of all opened sequences.
    hit_tokens: of those, tokens served from the cache (``Sequence.num_cached_tokens``).
    hit_rate: ``hit_tokens / query_tokens``, 0.0 before the first query.
    opened_sequences, closed_sequences: sequences opened and closed.
    stored_pages: full pages that became cached.
    duplicate_pages: full pages whose block was already cached (computed concurrently by another
        sequence); the sequence holds the cached page and keeps its own copy private until close.
    collision_pages: full pages left uncached because a different block had the same hash: that
        page and every later full page of its sequence (none can be cached under an uncached one).
    evicted_pages: cached pages dropped by eviction or ``reset``.
    num_pages, free_pages, cached_pages, evictable_pages: occupancy now; ``cached_pages`` counts the
        pages in the block tree, ``evictable_pages`` those of them no live sequence holds.
    live_sequences: sequences opened and not yet closed.
    host_hit_tokens: of ``hit_tokens``, tokens found on the host tier (loaded, not recomputed).
    host_pages, free_host_pages, host_cached_pages: the host tier's pages, those holding
        nothing, and those holding runs evicted from the GPU now (all 0 without a tier).
    saved_pages, loaded_pages, host_evicted_pages: pages copied to the host (in batches taken),
        pages loaded back (batches done), host pages dropped by the host's own eviction or
        ``reset``.
    """

    query_tokens: int
    hit_tokens: int
    hit_rate: float
    opened_sequences: int
    closed_sequences: int
    stored_pages: int
    duplicate_pages: int
    collision_pages: int
    evicted_pages: int
    num_pages: int
    free_pages: int
    cached_pages: int
    evictable_pages: int
    live_sequences: int
    host_hit_tokens: int = 0
    host_pages: int = 0
    free_host_pages: int = 0
    host_cached_pages: int = 0
    saved_pages: int = 0
    loaded_pages: int = 0
    host_evicted_pages: int = 0

"""``PrefixCache``'s read-only counts: the pool's and the tree's occupancy, the live sequences and the
``stats`` snapshot. ``PrefixCache`` inherits them; they read its store, tree, tier and counters."""

from __future__ import annotations

from prefix_cache.cache.stats import CacheStats


class CacheCounts:
    """The counts of ``PrefixCache`` (a base class: it has no state of its own)."""

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages holding nothing."""
        return len(self._pool.free)

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no live sequence holds; ``evict`` can free all of them."""
        return self._tree.num_unreferenced

    @property
    def num_cached_pages(self) -> int:
        """Pages in the block tree (matchable), held or not."""
        if self._store.pending:
            self._locked_flush()
        return self._tree.num_pages

    @property
    def num_live_sequences(self) -> int:
        return len(self._live)

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters and the occupancy now."""
        store = self._store
        if store.pending:
            self._locked_flush()
        tier = self._tier
        host = {}
        if tier is not None:
            host = {
                "host_pages": tier.num_pages,
                "free_host_pages": len(tier.pool.free),
                "host_cached_pages": tier.num_cached,
                "saved_pages": tier.saved_pages,
                "loaded_pages": tier.loaded_pages,
                "host_evicted_pages": tier.evicted_pages,
            }
        return CacheStats(
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            hit_rate=self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            opened_sequences=self._opened,
            closed_sequences=self._closed,
            stored_pages=store.stored_pages,
            duplicate_pages=store.duplicate_pages,
            collision_pages=store.collision_pages,
            evicted_pages=store.evicted_pages,
            num_pages=self._num_pages,
            free_pages=len(self._pool.free),
            cached_pages=self._tree.num_pages,
            evictable_pages=self._tree.num_unreferenced,
            live_sequences=len(self._live),
            host_hit_tokens=self._host_hit_tokens,
            **host,
        )

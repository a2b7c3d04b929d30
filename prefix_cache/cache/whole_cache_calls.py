"""``PrefixCache``'s calls on the whole cache rather than one sequence: ``evict``, ``reset``,
``drain_events`` and ``check_invariants``. ``PrefixCache`` inherits them; they use its lock, store,
tree and event log."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefix_cache.cache.arguments import check_int
from prefix_cache.cache.errors import PrefixCacheError
from prefix_cache.cache.invariants import InvariantChecker

if TYPE_CHECKING:
    from prefix_cache.cache.events import KVCacheEvent


class WholeCacheCalls:
    """The whole-cache calls of ``PrefixCache`` (a base class: it has no state of its own)."""

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` cached pages no live sequence holds, least recently used
        first (a page's descendants before it). Returns the number of pages freed."""
        num_pages = check_int("num_pages", num_pages, 0)
        self._enter()
        try:
            if self._store.pending:
                self._store.flush()
            return self._store.evict(num_pages, exact=True)
        finally:
            self._baton.append(None)

    def reset(self) -> None:
        """Invalidate the cache (after a weight update, say): drop every cached page, so nothing
        computed before the reset can match after it, and emit ``AllBlocksCleared``.

        Raises ``PrefixCacheError``, changing nothing, while sequences are open: their KV was
        computed before the reset too, and their pages would be cached when they commit. Close
        (or preempt) them first.
        """
        self._enter()
        try:
            if self._live:
                raise PrefixCacheError(
                    f"reset with {len(self._live)} sequences open: close them first (their KV was "
                    "computed before the reset and would be cached when they commit)"
                )
            if self._tier is not None:
                self._clear_tiers()
            else:
                self._store.evict_pages(self._tree.num_unreferenced)
            # Only stale entries can be left; drop them rather than skip them later.
            self._tree.older.clear()
            self._last_match = None
            if self._events is not None:
                self._events.clear()
        finally:
            self._baton.append(None)

    def drain_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first. After an overflow of ``max_events`` or
        ``max_event_bytes``: ``AllBlocksCleared``, then ``BlockStored`` for every block cached now
        (parents first), then nothing else."""
        self._enter()
        try:
            if self._store.pending:
                self._store.flush()
            return [] if self._events is None else self._events.drain(self._tree)
        finally:
            self._baton.append(None)

    def check_invariants(self) -> None:
        """Verify the whole bookkeeping; raise ``InvariantError`` naming the first inconsistency.

        Checks that every page is exactly one of free, private to one live sequence, or in the
        tree; that each node's key, parent link and reference count are right (refs equal the
        live sequences through it); that the LRU candidates are exactly the unreferenced leaves;
        and that each live sequence's counters, tokens and block table agree. O(pool + tokens).
        """
        if self._store.pending:
            self._locked_flush()
        InvariantChecker(self).run()

"""The cache's hot path: pages move between the free pool, sequences and the block tree.

``PageStore`` allocates pages to sequences (evicting cached ones when the pool is empty), caches the
full pages sequences commit, and evicts; it counts those pages and records their events.
``PrefixCache`` checks the arguments, holds the lock and calls it.
"""

from __future__ import annotations

from array import array

from prefix_cache.cache.block_tree import BlockTree, check_key
from prefix_cache.cache.errors import OutOfPages
from prefix_cache.cache.event_log import EventLog
from prefix_cache.cache.host_tier import HostTier
from prefix_cache.cache.page_pool import PagePool, int_pages
from prefix_cache.cache.sequence import Sequence
from prefix_cache.cache.tree_nodes import NO_WALK, Node, Root, Walk


class PageStore:
    """The free pool and the block tree of one cache, and the counters of pages moved between them.

    Arguments:
        pool: the free pages.
        tree: the cached pages.
        events: where ``BlockStored`` / ``BlockRemoved`` events go, None to record none.
    """

    __slots__ = (
        "collision_pages",
        "duplicate_pages",
        "events",
        "evicted_pages",
        "page_size",
        "pending",
        "pool",
        "stored_pages",
        "tier",
        "tree",
    )

    def __init__(
        self, pool: PagePool, tree: BlockTree, events: EventLog | None, tier: HostTier | None = None
    ) -> None:
        self.pool = pool
        self.tree = tree
        self.events = events
        #: The host tier, None without one: eviction then moves runs there.
        self.tier = tier
        self.page_size = tree.page_size
        #: Pages cached, pages whose block another sequence had cached first (kept private),
        #: pages left private after a hash collision, pages evicted.
        self.stored_pages = 0
        self.duplicate_pages = 0
        self.collision_pages = 0
        self.evicted_pages = 0
        #: Sequences whose newly full pages wait to be cached (see ``defer_page``), by the leaf
        #: run their pages extend, in the order of their first such page.
        self.pending: dict[Node, Sequence] = {}

    def allocate(self, seq: Sequence, end: int) -> None:
        """New pages so ``seq`` can hold ``end`` tokens (``PrefixCache.allocate`` past the last
        page), evicting what the pool lacks; all or nothing: ``OutOfPages`` changes nothing."""
        page_size = self.page_size
        free = self.pool.free
        count = seq._num_pages
        num_pages = -(-end // page_size)
        needed = num_pages - count
        short = needed - len(free)
        if short > 0 and short > self.tree.num_unreferenced:
            raise OutOfPages(needed, len(free) + self.tree.num_unreferenced)
        if num_pages > len(seq._pages):
            # Before any page is taken: a MemoryError here changes nothing.
            seq._grow(num_pages, page_size)
        if short > 0:
            self.evict(short)
        seq._add_pages(self.pool.take(needed), page_size)
        seq._num_allocated = end

    def defer_page(self, seq: Sequence, end: int, token: int) -> None:
        """``token``, at ``end - 1``, filled a page of ``seq`` (the decode path, ``seq`` not
        waiting). In the decode loop's case (the page goes at the end of the sequence's own leaf
        run, keys from the default hash) the page waits in ``pending``, with every page the
        sequence fills after it, to be cached in one batch (one hash pass, one extension of the
        run and one event) when something could see it: a walk that ends in that run
        (``flush_walk_end``: a match, an admission, another sequence's commit), the sequence's
        own ``close`` or commit of several tokens, and ``flush`` before counts, events and
        eviction. Anything else is cached now.

        So every match, event and count sees what caching each page at once gives; a waiting run
        is a leaf only its sequence holds, which nothing else changes. (A waiting page's key is
        claimed when it is cached, which differs from claiming it at once only where two 64-bit
        keys of different blocks collide.)"""
        leaf = seq._node
        if (
            leaf.ref == 1
            and leaf.child is None
            and leaf.children is None
            and leaf is not seq._root
            and not seq._broken
            and not seq._extras
            and not self.tree.check_keys
            and not seq._loading
        ):
            seq._dirty = True
            self.pending[leaf] = seq
            return
        self.store_page(seq, end, token)

    def flush(self) -> None:
        """Cache the waiting pages of every sequence in ``pending``, in the order they waited."""
        pending = self.pending
        self.pending = {}
        for seq in pending.values():
            seq._dirty = False
            self.store_full_pages(seq, seq._num_tokens)

    def flush_seq(self, seq: Sequence) -> None:
        """Cache the waiting pages of ``seq`` (which waits)."""
        del self.pending[seq._node]
        seq._dirty = False
        self.store_full_pages(seq, seq._num_tokens)

    def flush_walk_end(self, walk: Walk) -> bool:
        """When ``walk`` ends in the run of a waiting sequence, cache that sequence's waiting pages
        (the walk must then be taken again) and return True; else False, nothing changed."""
        seq = self.pending.get(walk.nodes[-1]) if walk.nodes else None
        if seq is None:
            return False
        self.flush_seq(seq)
        return True

    def store_page(self, seq: Sequence, end: int, token: int) -> None:
        """``store_full_pages`` for the one page that ``token``, at ``end - 1``, filled (the
        decode path), in its common case written out: the page goes at the end of the sequence's
        own leaf run, which only it holds (``BlockTree.append_page``). Anything else takes
        ``store_full_pages``."""
        leaf = seq._node
        if (
            leaf.ref != 1
            or leaf.child is not None
            or leaf.children is not None
            or leaf is seq._root
            or seq._broken
            or seq._extras
            or seq._loading
        ):
            self.store_full_pages(seq, end)
            return
        page_size = self.page_size
        # At page size 1 the page is the token: its int32 bytes without a numpy round trip.
        data = token.to_bytes(4, "little") if page_size == 1 else seq._tokens[end - page_size : end].tobytes()
        tree = self.tree
        parent_key = leaf.keys[-1]
        key = tree.hash_fn(data, parent_key)
        if tree.check_keys:
            check_key(key)
        full = end // page_size
        seq._num_full_pages = full
        # Without extra keys the sequence holds only nodes without extra bytes (a walk without
        # them matches no page that has some), as ``append_page`` requires.
        if not tree.append_page(leaf, data, seq._pages_int[full - 1], key):
            # A hash collision: the page and all later ones stay private.
            seq._broken = True
            self.collision_pages += 1
            return
        seq._num_held = full
        self.stored_pages += 1
        tier = self.tier
        if tier is not None and tier.write_through:
            tier.write_through_pages(leaf, 1)
        events = self.events
        if events is not None:
            events.emit(([key], parent_key, data, seq._namespace, None))

    def store_full_pages(self, seq: Sequence, end: int) -> None:
        """Offer the pages of ``seq`` that ``end`` committed tokens fill (written to ``seq._tokens``,
        ``seq._num_tokens`` not yet advanced) to the tree: hold the cached twins of the first
        ones while there are some (the sequence's own copies stay private), then cache the rest,
        appended to the sequence's own leaf run when only it holds that leaf, else as a new run;
        after a hash collision the page and all later ones stay private.

        Everything that can fail (the caller's hash function) runs before the first change.
        While ``seq`` loads from the host tier nothing is offered: its pages wait for the loads."""
        if seq._loading:
            return
        page_size = self.page_size
        first = seq._num_full_pages
        full = end // page_size
        if seq._broken:
            seq._num_full_pages = full
            self.collision_pages += full - first
            return
        tree = self.tree
        root = seq._root
        parent = seq._node
        data = seq._tokens[first * page_size : full * page_size].tobytes()
        seq_extras = seq._extras
        count = full - first
        page_bytes = tree.page_bytes
        # Extra identity bytes of each page (prompt pages only), None when no page has any.
        extras = None
        if seq_extras and any(first + i in seq_extras for i in range(count)):
            extras = [seq_extras.get(first + i, b"") for i in range(count)]
        # Cached twins, computed concurrently by other sequences (none after a leaf).
        if parent.child is None and parent.children is None:
            walk = NO_WALK
        else:
            walk = tree.walk(parent, data, count, extras)
            if self.pending and self.flush_walk_end(walk):
                walk = tree.walk(parent, data, count, extras)
        twins = walk.pages
        after = walk.last(parent)
        # The key of the last twin (which may end inside its run), or of the sequence's last page.
        parent_key = after.keys[walk.partial - 1] if walk.partial else after.last_key()
        # Runs on the host only that continue the pages take the sequence's pages as their GPU
        # copy below (nothing to load: the sequence computed them).
        upgrades = NO_WALK
        if (
            self.tier is not None
            and tree.num_host_nodes
            and twins < count
            and not walk.partial
            and (after.child is not None or after.children is not None)
        ):
            upgrades = self.tier.walk(after, data, twins, count, extras)
            if upgrades.pages:
                last = upgrades.nodes[-1]
                parent_key = last.keys[upgrades.partial - 1] if upgrades.partial else last.last_key()
        covered = twins + upgrades.pages
        new = data[covered * page_bytes :]
        new_extras = extras[covered:] if extras is not None else None
        # A caller's hash function may fail: keys are computed before anything changes.
        keys = tree.page_keys(parent_key, new, new_extras) if covered < count else []
        # From here on nothing can fail.
        seq._num_full_pages = full
        if twins:
            seq._node = after = self._hold_twins(seq, walk, first)
            seq._num_held = first + twins
            self.duplicate_pages += twins
        if upgrades.pages:
            seq._node = after = self.tier.upgrade(upgrades, seq, first + twins)
            twins = covered
            seq._num_held = first + twins
        if twins == count:
            return
        tree.claim_keys(root, keys)
        stored = len(keys)
        if stored:
            start = first + twins
            pages = array("i")
            pages.frombytes(seq._pages[start : start + stored].tobytes())
            stored_data = new[: stored * page_bytes]
            stored_extras = new_extras[:stored] if new_extras is not None else None
            if after is not root and after.ref == 1 and after.child is None and after.children is None:
                tree.extend(after, stored_data, pages, keys, stored_extras)
            else:
                seq._node = tree.add(after, stored_data, pages, keys, stored_extras)
            seq._num_held = start + stored
            self.stored_pages += stored
            tier = self.tier
            if tier is not None and tier.write_through:
                tier.write_through_pages(seq._node, stored)
            events = self.events
            if events is not None:
                # Turned into a BlockStored by drain_events, off the per-step path.
                events.emit(
                    (
                        keys,
                        None if after is root else parent_key,
                        stored_data,
                        seq._namespace,
                        [extra or None for extra in stored_extras]
                        if stored_extras is not None and any(stored_extras)
                        else None,
                    )
                )
        if twins + stored < count:
            # A different block holds the key of the next page: it and all after it stay
            # private (a page can only be cached under a cached parent).
            seq._broken = True
            self.collision_pages += count - twins - stored

    def _hold_twins(self, seq: Sequence, walk: Walk, first: int) -> Node:
        """Hold the runs of ``walk`` (below ``seq._node``), the cached twins of the pages of
        ``seq`` from page ``first`` on; returns the deepest. The block table keeps the sequence's
        own copies (it is append-only): private until close, the sequence listed in each run's
        ``copies``. A run that nobody held (evictable) takes the sequence's copy instead, so that
        its pages are in a live block table, and its own pages go back to the pool."""
        parent = seq._node
        last = self.tree.hold(walk, None)
        nodes = []
        node = last
        while node is not parent:
            nodes.append(node)
            node = node.parent
        start = first
        dups = list(seq._dups)
        for node in reversed(nodes):
            size = len(node.pages)
            if node.ref == 1:
                self.pool.free += node.pages
                node.pages = int_pages(seq._pages[start : start + size])
            else:
                if node.copies is None:
                    node.copies = {}
                node.copies[seq] = start
                dups += seq._pages[start : start + size].tolist()
            start += size
        seq._dups = dups
        return last

    def forget_copies(self, seq: Sequence) -> None:
        """``seq``, about to release its path, no longer holds its own copies of those runs."""
        node = seq._node
        root = seq._root
        while node is not root:
            copies = node.copies
            if copies is not None and seq in copies:
                if len(copies) == 1:
                    node.copies = None
                else:
                    del copies[seq]
            node = node.parent

    def adopt(self, nodes: list[Node]) -> None:
        """Each of ``nodes`` (from ``BlockTree.release``) is held only by sequences with their own
        copies of its run: one of them becomes the run's pages (no longer private to it) and the
        run's pages, in no live block table now, go back to the pool."""
        for node in nodes:
            copies = node.copies
            seq, start = next(iter(copies.items()))
            if len(copies) == 1:
                node.copies = None
            else:
                del copies[seq]
            pages = int_pages(seq._pages[start : start + len(node.pages)])
            self.pool.free += node.pages
            node.pages = pages
            adopted = set(pages)
            seq._dups = [page for page in seq._dups if page not in adopted]

    def evict(self, num_pages: int, exact: bool = False) -> int:
        """Evict up to ``num_pages`` pages in LRU order, with ``BlockRemoved`` events (one per run
        of pages of one namespace; with a host tier, runs move there, see ``HostTier.evict_gpu``,
        a few more pages than asked unless ``exact``); returns the number evicted."""
        if self.tier is not None:
            count = self.tier.evict_gpu(num_pages, exact)
            self.evicted_pages += count
            return count
        evicted, count = self.evict_pages(num_pages)
        events = self.events
        if evicted and events is not None:
            root, _, keys = evicted[0]
            keys = list(keys)
            # One event per run of one namespace, so the events keep the eviction order.
            for other, _, more in evicted[1:]:
                if other is not root:
                    events.emit((keys, root.namespace))
                    root, keys = other, []
                keys += more
            events.emit((keys, root.namespace))
        return count

    def evict_pages(self, num_pages: int) -> tuple[list[tuple[Root, array, list[int]]], int]:
        """Evict up to ``num_pages`` pages in LRU order (no event); returns them as the tree's
        ``evict`` does, and their number."""
        evicted = self.tree.evict(num_pages)
        free = self.pool.free
        count = 0
        for _, pages, _ in evicted:
            free += pages
            count += len(pages)
        self.evicted_pages += count
        return evicted, count

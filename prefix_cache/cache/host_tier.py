"""The host tier: cached runs evicted from the GPU wait in host memory and come back by copy.

One tree holds both tiers (``prefix_cache.cache.block_tree``). A node whose run is on the host
only has ``pages is None`` and its host page ids in ``host``; it is held by no sequence, and every
node below it is host-only too, so the runs on the GPU form the top of the tree and a walk from a
root meets them first. Keys stay in their namespace's index while a run is on either tier, so a
block key names one block in events whatever its tier.

- **GPU eviction moves instead of dropping** (write-back): the least recently released run with
  no child on the GPU gets host pages (the host's least recently used leaves make room) and a save
  per page is queued; its GPU pages are free at once, since the saves run before any kernel that
  can write them (see ``Transfers``). A run the host cannot take is dropped with the host runs
  below it.
- **A prompt matches across tiers**: after its GPU prefix, ``walk`` continues through host-only
  runs. ``PrefixCache.open`` gives the sequence GPU pages for that part and queues a load per page;
  the tokens count as computed once ``done`` says the loads are made, and only then are the pages
  offered to the tree (where they take the host runs' place, whose host pages are freed).
- **Pins**: a host page a queued or running load reads is pinned until the load is done or its
  sequence closes; a pinned page whose run leaves the tree waits, ownerless, until it is unpinned,
  so no save overwrites a page a load still reads.
- A failed batch (``done(batch, ok=False)``): its loads' sequences fall back to their GPU prefix
  and compute the rest; the runs its saves were writing leave the tree.

With write-through (``prefix_cache.cache.write_through``) runs get their host copy when cached, so
a run can be on both tiers; GPU eviction of such a run copies nothing. Matching and loading live
in ``prefix_cache.cache.host_loads``.
"""

from __future__ import annotations

import heapq
from array import array
from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.block_tree import BlockTree, has_gpu_child
from prefix_cache.cache.event_log import EventLog
from prefix_cache.cache.events import MEDIUM_CPU
from prefix_cache.cache.host_loads import HostLoads, event_extras
from prefix_cache.cache.page_pool import PagePool
from prefix_cache.cache.transfers import Transfers
from prefix_cache.cache.tree_nodes import Node, remove_child
from prefix_cache.cache.write_through import Copy, WriteThrough, has_host_child

if TYPE_CHECKING:
    from prefix_cache.cache.sequence import Sequence


_NO_PAIRS = np.empty((0, 2), dtype=np.int32)
# Stale host LRU entries tolerated beyond twice the host-only runs.
_HEAP_SLACK = 1024
#: Runs up to this many tokens move to the host whole when the pool needs part of one: a cut costs
#: more than moving the rest of a short run, which is as old. In tokens, not pages, so that small
#: pages (whose runs are many pages long) are not cut at every decode step's eviction.
SPLIT_TOKENS = 1024


class HostTier(HostLoads, WriteThrough):
    """The host pages of one cache, the host runs' LRU, pins, and the copies waiting to be taken.

    Arguments:
        tree: the cache's block tree (both tiers).
        gpu_pool: the cache's free GPU pages.
        num_pages: host pages, ``>= 1``.
        events: where events go, None for none.
        write_through: copy runs to the host when they are cached (see
            ``prefix_cache.cache.write_through``), not only when the GPU evicts them.
    """

    __slots__ = (
        "copy_id",
        "copy_serial",
        "events",
        "evicted_pages",
        "gpu_pool",
        "heap",
        "held",
        "in_flight",
        "loaded_pages",
        "loading",
        "loads",
        "num_cached",
        "num_pages",
        "orphan",
        "orphaned",
        "pinned",
        "pins",
        "pool",
        "published",
        "ready",
        "save_gpu",
        "save_host",
        "saved_pages",
        "ticket",
        "tree",
        "write_through",
        "writer",
        "wt_copies",
    )

    def __init__(
        self,
        tree: BlockTree,
        gpu_pool: PagePool,
        num_pages: int,
        events: EventLog | None,
        write_through: bool = False,
    ) -> None:
        self.tree = tree
        self.write_through = write_through
        self.gpu_pool = gpu_pool
        self.num_pages = num_pages
        self.events = events
        #: Host pages holding nothing.
        self.pool = PagePool(num_pages)
        #: Host pages of runs on the host.
        self.num_cached = 0
        #: The host's eviction candidates, runs with a host copy and no child with one (without
        #: write-through: host-only leaves): ``(tick, serial, node)``, an entry live while
        #: ``node.host_serial == serial`` (serials come from the tree's counter).
        self.heap: list[tuple[int, int, Node]] = []
        #: Per host page, the loads reading it (queued or running), and their sum; pages left by
        #: their run while pinned are marked in ``orphan`` until their last pin goes.
        self.pins = np.zeros(num_pages, dtype=np.int32)
        self.pinned = 0
        self.orphan = np.zeros(num_pages, dtype=bool)
        self.orphaned = 0
        #: Per host page, the batch whose save writes its present run's bytes (0 while the save is
        #: not taken yet), and whether that save is done: only ready pages are matched, so a load
        #: never reads a page whose save may still fail.
        self.writer = np.zeros(num_pages, dtype=np.int64)
        self.ready = np.zeros(num_pages, dtype=bool)
        #: Write-through only: per host page, the copy (``wt_copies``) that wrote it, 0 for none,
        #: and whether its ``BlockStored`` medium CPU was emitted; the copies whose events wait for
        #: their batch (moved to ``in_flight`` when it is taken).
        self.copy_id = np.zeros(num_pages if write_through else 0, dtype=np.int64)
        self.copy_serial = 0
        self.published = np.zeros(num_pages if write_through else 0, dtype=bool)
        self.wt_copies: list[Copy] = []
        if write_through and events is not None:
            events.host_published = self.published
        #: Copies queued since the last ``take``: the saves' GPU and host pages, each pair at the
        #: same index; pairs of page id arrays (host, gpu) for loads, one per loading sequence.
        self.save_gpu = array("i")
        self.save_host = array("i")
        self.loads: list[tuple[array, array]] = []
        #: Sequences whose loads are queued since the last ``take``.
        self.loading: list[Sequence] = []
        #: Ticket -> the batch, the sequences whose loads it makes, its write-through copies.
        self.in_flight: dict[int, tuple[Transfers, list[Sequence], list[Copy]]] = {}
        #: Ticket -> the host pages saved by a batch with write-through copies, done while an
        #: earlier batch is not, and those copies: they become matchable and are announced once
        #: every earlier batch is done, so both follow the order batches were taken (a run's parent
        #: is announced and matchable before it, as routers expect). Runs moved by write-back are
        #: announced when they move, and matchable once their own batch is done.
        self.held: dict[int, tuple[np.ndarray, list[Copy]]] = {}
        self.ticket = 0
        self.saved_pages = 0
        self.loaded_pages = 0
        self.evicted_pages = 0

    # ------------------------------------------------------------------ GPU eviction

    def evict_gpu(self, count: int, exact: bool) -> int:
        """Free ``count`` GPU pages (fewer when there are not as many evictable; with ``exact``
        False, more where that moves a whole run of at most ``SPLIT_TOKENS`` tokens, which the
        host can take, rather than cutting it): the least recently released runs with no child on
        the GPU move to the host (a run's end first, as ``BlockTree.evict`` takes it), or leave
        the tree when the host cannot take them. Returns the GPU pages freed."""
        tree = self.tree
        free = self.gpu_pool.free
        host_free = self.pool.free
        events = self.events
        write_through = self.write_through
        recent = tree.recent
        older = tree.older
        # The next run when it is already known: a parent that just lost its last child on the GPU
        # and is older than every candidate (``BlockTree.evict`` does the same).
        known: Node | None = None
        # Host pages taken here: their ``ready`` and ``writer`` are reset once, at the end (nothing
        # reads them in between, and a page taken twice here gets the same values).
        taken = array("i")
        split_pages = max(1, SPLIT_TOKENS // tree.page_size)
        freed = 0
        while freed < count:
            if known is not None:
                node = known
                known = None
                listed = False
            else:
                node = tree.oldest()
                if node is None:
                    break
                listed = True
            size = len(node.pages)
            want = count - freed
            if want < size and (
                exact
                or size > split_pages
                or (node.host is None and len(host_free) < size and not self.make_room(size, node.tick))
            ):
                # The run's end goes: the head stays on the GPU, with the node's age. (Also for a
                # short run the host cannot take whole: the end it needs may still fit.)
                tree.split(node, size - want).tick = node.tick
                size = want
            if listed:
                # ``tree.unlist(node)``
                if node.lru_serial == 0:
                    del recent[node]
                node.lru_serial = -1
                tree.num_lru -= 1
            pages = node.pages
            parent = node.parent
            root = node.root
            if events is not None:
                events.emit((list(node.keys), root.namespace))
            if node.host is not None:
                # Write-through: the host copy is there (its save, if not done, runs before any
                # kernel that can write the pages freed here).
                free += pages
                node.pages = None
                tree.num_host_nodes += 1
            elif len(host_free) >= size or self.make_room(size, node.tick):
                host = self.pool.take(size)
                # Copied into the queue: a split of the run before the batch is taken cuts
                # ``node.host`` in place.
                self.save_gpu += pages
                self.save_host += host
                taken += host
                free += pages
                # The run's page array holds its host pages now: a long-lived array kept rather
                # than a new one (fewer objects for the garbage collector to promote).
                pages[:] = host
                node.host = pages
                node.pages = None
                tree.num_host_nodes += 1
                self.num_cached += size
                if node.child is None and node.children is None:
                    self.push(node)
                if write_through:
                    self.published[np.frombuffer(host, np.int32)] = events is not None
                if events is not None:
                    parent_key = None if parent is root else parent.keys[-1]
                    events.emit(
                        (
                            list(node.keys),
                            parent_key,
                            bytes(node.tokens),
                            root.namespace,
                            event_extras(node),
                            MEDIUM_CPU,
                        )
                    )
            else:
                self.drop(node)
                free += pages
            tree.num_pages -= size
            tree.num_unreferenced -= size
            freed += size
            if parent is not root and not parent.ref and parent.lru_serial < 0 and not has_gpu_child(parent):
                if (
                    freed < count
                    and (not recent or parent.tick < next(iter(recent)).tick)
                    and (not older or parent.tick < older[0][0])
                ):
                    # Taken next anyway: ties go to ``recent`` and to older heap entries. (A stale
                    # heap head is no newer than the live one, so the test is never too lax.)
                    known = parent
                else:
                    tree.push_older(parent)
        if known is not None:
            tree.push_older(known)
        if taken:
            ids = np.frombuffer(taken, np.int32)
            self.ready.put(ids, False)
            self.writer.put(ids, 0)
        if freed:
            tree.version += 1
        return freed

    def make_room(self, count: int, tick: int | None = None) -> bool:
        """Free host pages until ``count`` are free, evicting host-only leaves least recently
        released first; False (having evicted what it could) when that is not enough. With
        write-through, host copies of runs on both tiers are candidates too, and ``tick`` (the
        release of a run moving in) keeps runs released after it: a run moved by write-back does
        not push out newer copies."""
        if count > self.num_pages:
            return False
        free = self.pool.free
        while len(free) < count:
            heap = self.heap  # ``push`` may rebuild it
            while heap and heap[0][2].host_serial != heap[0][1]:
                heapq.heappop(heap)
            if not heap:
                return False
            oldest, _, node = heap[0]
            if self.write_through:
                if has_host_child(node):
                    # A child got a copy since: a candidate again once no child has one.
                    heapq.heappop(heap)
                    node.host_serial = -1
                    continue
                if (self.tree.tick + 1 if node.ref else node.tick) > oldest:
                    # Released since, or held (in use: newer than any release).
                    heapq.heappop(heap)
                    self.push(node)
                    continue
                if tick is not None and oldest > tick:
                    return False
                if node.pages is not None:
                    heapq.heappop(heap)
                    self.drop_copy(node)
                    continue
            heapq.heappop(heap)
            self.drop(node)
        return True

    def push(self, node: Node) -> None:
        """``node`` became a host eviction candidate (host-only, a leaf; with write-through, any
        run with a host copy and no child with one): it waits with its own tick, or, held by a
        sequence, as if released now (after the latest release)."""
        tree = self.tree
        tree._serial += 1
        node.host_serial = tree._serial
        heap = self.heap
        heapq.heappush(heap, (tree.tick + 1 if node.ref else node.tick, tree._serial, node))
        # Runs on both tiers are candidates too: bound stale entries by the host pages then.
        live = self.num_cached if self.write_through else tree.num_host_nodes
        if len(heap) > 2 * live + _HEAP_SLACK:
            # Entries of runs loaded back or dropped outnumber the live ones: drop them.
            self.heap = [entry for entry in heap if entry[2].host_serial == entry[1]]
            heapq.heapify(self.heap)

    def drop(self, node: Node) -> None:
        """Remove ``node`` and the host-only runs below it from the tree, deepest first, freeing
        their host pages (``node``'s GPU pages, if any, are the caller's)."""
        tree = self.tree
        root = node.root
        events = self.events
        if node.child is None and node.children is None:
            order = (node,)  # a leaf, the common case
        else:
            order = [node]
            for run in order:
                if run.children is not None:
                    order.extend(run.children.values())
                elif run.child is not None:
                    order.append(run.child)
            order.reverse()
        for run in order:
            root.index.difference_update(run.keys)
            run.lru_serial = -1
            run.host_serial = -1
            host = run.host
            if host is not None:
                run.host = None
                if self.write_through:
                    self.remove_published(run, host)
                elif run.pages is None and events is not None:
                    events.emit((list(run.keys), root.namespace, MEDIUM_CPU))
                self.release_pages(host)
                self.num_cached -= len(host)
                self.evicted_pages += len(host)
                if run.pages is None:
                    tree.num_host_nodes -= 1
        parent = node.parent
        if parent.child is node:
            parent.child = None
        else:
            remove_child(parent, node, tree.page_bytes)
        if parent is root:
            if not root.ref and parent.child is None and parent.children is None:
                del tree.roots[root.namespace]
        elif parent.host is not None and parent.host_serial < 0 and not has_host_child(parent):
            # Its last child with a host copy went (without write-through: a host-only leaf).
            self.push(parent)
        tree.version += 1

    def release_pages(self, pages: array) -> None:
        """Host pages whose run let go of them: free, or orphaned while a load reads them."""
        if self.write_through:
            # Not this copy's any more: its pending event is dropped, a published one was removed.
            ids = np.frombuffer(pages, np.int32)
            self.copy_id.put(ids, 0)
            self.published.put(ids, False)
        if self.pinned:
            ids = np.frombuffer(pages, np.int32)
            pins = self.pins.take(ids)
            if np.count_nonzero(pins):
                pinned = pins > 0
                orphans = ids[pinned]
                self.orphan[orphans] = True
                self.orphaned += len(orphans)
                self.pool.free.frombytes(ids[~pinned].tobytes())
                return
        self.pool.free += pages

    # ------------------------------------------------------------------ batches

    def take_batch(self) -> Transfers | None:
        """The copies queued since the last call, as one batch, or None when there are none."""
        if not self.save_host and not self.loads:
            return None
        self.ticket += 1
        saves = rows(self.save_gpu, self.save_host)
        if len(saves):
            # A host page saved twice in the batch (its first run left the host before the batch
            # was taken, and another took the page): only the last save is its run's.
            pages = np.sort(saves[:, 1])
            if np.count_nonzero(pages[1:] == pages[:-1]):
                last = len(saves) - 1 - np.unique(saves[::-1, 1], return_index=True)[1]
                saves = saves[np.sort(last)]
            self.writer.put(saves[:, 1], self.ticket)
        batch = Transfers(saves, pairs(self.loads), self.ticket)
        self.saved_pages += len(batch.saves)
        for seq in self.loading:
            seq._load_ticket = self.ticket
        self.in_flight[self.ticket] = (batch, self.loading, self.wt_copies)
        self.save_gpu = array("i")
        self.save_host = array("i")
        self.loads = []
        self.loading = []
        self.wt_copies = []
        return batch

    def in_flight_batch(self, batch: object) -> bool:
        """Whether ``batch`` is one of this tier's batches taken and not yet done."""
        entry = self.in_flight.get(getattr(batch, "ticket", None))
        return entry is not None and entry[0] is batch

    def finish(self, batch: Transfers, ok: bool) -> list[Sequence]:
        """Forget ``batch``: its saves' pages are ready, or (failed) their runs leave the tree;
        returns the sequences still waiting on its loads (their pins go, their loads are over)."""
        _, seqs, copies = self.in_flight.pop(batch.ticket)
        ticket = batch.ticket
        if len(batch.saves):
            # Pages written by a later batch since, or freed, are not this batch's any more.
            written = batch.saves[:, 1][self.writer[batch.saves[:, 1]] == ticket]
            if ok and copies:
                self.held[ticket] = (written, copies)
            elif ok:
                self.ready[written] = True
            elif len(written):
                self.forget(set(written.tolist()))
        if self.held:
            oldest = min(self.in_flight, default=None)
            for done in sorted(self.held):
                if oldest is not None and done > oldest:
                    break
                written, copies = self.held.pop(done)
                self.ready[written[self.writer[written] == done]] = True
                if copies:
                    self.publish(copies)
        waiting = [seq for seq in seqs if seq._owner is not None and seq._load_ticket == ticket]
        for seq in waiting:
            self.unpin(seq._load_host)
            seq._load_host = None
        return waiting

    def forget(self, written: set[int]) -> None:
        """Saves into host pages ``written`` failed: the runs on the host only in them leave the
        tree (with the host runs below them); runs on both tiers lose their host copy only. None
        is loading: only ready pages are matched."""
        stale = [
            node for node in self.tree.nodes() if node.host is not None and not written.isdisjoint(node.host)
        ]
        for node in stale:
            if node.host is None:  # dropped with a stale parent
                continue
            if node.pages is None:
                self.drop(node)
            else:
                self.drop_copy(node)

    def clear(self) -> None:
        """Free every host page (``PrefixCache.reset``; no sequence is open, so none is pinned) and
        forget the copies not yet taken."""
        self.pool = PagePool(self.num_pages)
        self.num_cached = 0
        self.heap = []
        self.pins[:] = 0
        self.pinned = 0
        self.orphan[:] = False
        self.orphaned = 0
        self.writer[:] = 0
        self.ready[:] = False
        self.copy_id[:] = 0
        self.published[:] = False
        self.held = {}
        self.save_gpu = array("i")
        self.save_host = array("i")
        self.loads = []
        self.loading = []
        self.wt_copies = []


def pairs(parts: list[tuple[array, array]]) -> np.ndarray:
    """Rows ``(a, b)`` of int32 from pairs of equally long ``array('i')`` of page ids."""
    if not parts:
        return _NO_PAIRS
    first = array("i")
    second = array("i")
    for a, b in parts:
        first += a
        second += b
    return rows(first, second)


def rows(first: array, second: array) -> np.ndarray:
    """Rows ``(a, b)`` of int32 from two equally long ``array('i')`` of page ids."""
    if not first:
        return _NO_PAIRS
    out = np.empty((len(first), 2), dtype=np.int32)
    out[:, 0] = np.frombuffer(first, dtype=np.int32)
    out[:, 1] = np.frombuffer(second, dtype=np.int32)
    return out

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
"""

from __future__ import annotations

import heapq
from array import array
from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.block_tree import BlockTree, has_gpu_child
from prefix_cache.cache.event_log import EventLog
from prefix_cache.cache.events import MEDIUM_CPU
from prefix_cache.cache.page_pool import PagePool, int_pages
from prefix_cache.cache.transfers import Transfers
from prefix_cache.cache.tree_nodes import Node, Walk, remove_child

if TYPE_CHECKING:
    from prefix_cache.cache.sequence import Sequence


_NO_PAIRS = np.empty((0, 2), dtype=np.int32)
# Stale host LRU entries tolerated beyond twice the host-only runs.
_HEAP_SLACK = 1024
#: Runs up to this many pages move to the host whole when the pool needs part of one: a cut costs
#: more than moving the rest of a short run, which is as old.
SPLIT_PAGES = 64


class HostTier:
    """The host pages of one cache, the host runs' LRU, pins, and the copies waiting to be taken.

    Arguments:
        tree: the cache's block tree (both tiers).
        gpu_pool: the cache's free GPU pages.
        num_pages: host pages, ``>= 1``.
        events: where events go, None for none.
    """

    __slots__ = (
        "events",
        "evicted_pages",
        "gpu_pool",
        "heap",
        "in_flight",
        "loaded_pages",
        "loading",
        "loads",
        "num_cached",
        "num_pages",
        "orphan",
        "pinned",
        "pins",
        "pool",
        "ready",
        "saved_pages",
        "saves",
        "ticket",
        "tree",
        "writer",
    )

    def __init__(self, tree: BlockTree, gpu_pool: PagePool, num_pages: int, events: EventLog | None) -> None:
        self.tree = tree
        self.gpu_pool = gpu_pool
        self.num_pages = num_pages
        self.events = events
        #: Host pages holding nothing.
        self.pool = PagePool(num_pages)
        #: Host pages of runs on the host.
        self.num_cached = 0
        #: Host-only leaves, the host's eviction candidates: ``(tick, serial, node)``, an entry
        #: live while ``node.lru_serial == serial`` (serials come from the tree's counter).
        self.heap: list[tuple[int, int, Node]] = []
        #: Per host page, the loads reading it (queued or running), and their sum; pages left by
        #: their run while pinned are marked in ``orphan`` until their last pin goes.
        self.pins = np.zeros(num_pages, dtype=np.int32)
        self.pinned = 0
        self.orphan = np.zeros(num_pages, dtype=bool)
        #: Per host page, the batch whose save writes its present run's bytes (0 while the save is
        #: not taken yet), and whether that save is done: only ready pages are matched, so a load
        #: never reads a page whose save may still fail.
        self.writer = np.zeros(num_pages, dtype=np.int64)
        self.ready = np.zeros(num_pages, dtype=bool)
        #: Copies queued since the last ``take``: pairs of page id arrays (gpu, host) for saves,
        #: (host, gpu) for loads.
        self.saves: list[tuple[array, array]] = []
        self.loads: list[tuple[array, array]] = []
        #: Sequences whose loads are queued since the last ``take``.
        self.loading: list[Sequence] = []
        #: Ticket -> the sequences whose loads that batch makes.
        self.in_flight: dict[int, list[Sequence]] = {}
        self.ticket = 0
        self.saved_pages = 0
        self.loaded_pages = 0
        self.evicted_pages = 0

    # ------------------------------------------------------------------ GPU eviction

    def evict_gpu(self, count: int, exact: bool) -> int:
        """Free ``count`` GPU pages (fewer when there are not as many evictable; with ``exact``
        False, more where that moves a whole run of at most ``SPLIT_PAGES`` pages rather than
        cutting it): the least recently released runs with no child on the GPU move to the host
        (a run's end first, as ``BlockTree.evict`` takes it), or leave the tree when the host
        cannot take them. Returns the GPU pages freed."""
        tree = self.tree
        free = self.gpu_pool.free
        events = self.events
        freed = 0
        while freed < count:
            node = tree.oldest()
            if node is None:
                break
            size = len(node.pages)
            want = count - freed
            if want < size and (exact or size > SPLIT_PAGES):
                # The run's end goes: the head stays on the GPU, with the node's age.
                tree.split(node, size - want).tick = node.tick
                size = want
            tree.unlist(node)
            pages = node.pages
            parent = node.parent
            root = node.root
            if events is not None:
                events.emit((list(node.keys), root.namespace))
            if self.make_room(size):
                host = self.pool.take(size)
                node.host = host
                node.pages = None
                tree.num_host_nodes += 1
                self.num_cached += size
                # A copy: a split of the run before the batch is taken cuts ``node.host`` in place.
                self.saves.append((pages, array("i", host)))
                ids = np.frombuffer(host, dtype=np.int32)
                self.ready[ids] = False
                self.writer[ids] = 0
                if node.child is None and node.children is None:
                    self.push(node)
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
                tree.push_older(parent)
        if freed:
            tree.version += 1
        return freed

    def make_room(self, count: int) -> bool:
        """Free host pages until ``count`` are free, evicting host-only leaves least recently
        released first; False (having evicted what it could) when that is not enough."""
        if count > self.num_pages:
            return False
        free = self.pool.free
        heap = self.heap
        while len(free) < count:
            while heap and heap[0][2].lru_serial != heap[0][1]:
                heapq.heappop(heap)
            if not heap:
                return False
            self.drop(heapq.heappop(heap)[2])
        return True

    def push(self, node: Node) -> None:
        """``node``, host-only, became a leaf: it is an eviction candidate with its own tick."""
        tree = self.tree
        tree._serial += 1
        node.lru_serial = tree._serial
        heap = self.heap
        heapq.heappush(heap, (node.tick, tree._serial, node))
        if len(heap) > 2 * tree.num_host_nodes + _HEAP_SLACK:
            # Entries of runs loaded back or dropped outnumber the live ones: drop them.
            self.heap = [entry for entry in heap if entry[2].lru_serial == entry[1]]
            heapq.heapify(self.heap)

    def drop(self, node: Node) -> None:
        """Remove ``node`` and the host-only runs below it from the tree, deepest first, freeing
        their host pages (``node``'s GPU pages, if any, are the caller's)."""
        tree = self.tree
        root = node.root
        events = self.events
        order = [node]
        for run in order:
            kids = run.children.values() if run.children is not None else (run.child,)
            order.extend(kid for kid in kids if kid is not None)
        for run in reversed(order):
            root.index.difference_update(run.keys)
            run.lru_serial = -1
            host = run.host
            if host is not None:
                run.host = None
                self.release_pages(host)
                self.num_cached -= len(host)
                self.evicted_pages += len(host)
                if run.pages is None:
                    tree.num_host_nodes -= 1
                    if events is not None:
                        events.emit((list(run.keys), root.namespace, MEDIUM_CPU))
        parent = node.parent
        if parent.child is node:
            parent.child = None
        else:
            remove_child(parent, node, tree.page_bytes)
        if parent.child is None and parent.children is None:
            if parent is root:
                if not root.ref:
                    del tree.roots[root.namespace]
            elif parent.pages is None:
                self.push(parent)
        tree.version += 1

    def release_pages(self, pages: array) -> None:
        """Host pages whose run let go of them: free, or orphaned while a load reads them."""
        if not self.pinned:
            self.pool.free += pages
            return
        ids = np.frombuffer(pages, dtype=np.int32)
        pinned = self.pins[ids] > 0
        self.orphan[ids[pinned]] = True
        self.pool.free.frombytes(ids[~pinned].tobytes())

    # ------------------------------------------------------------------ matching and loading

    def walk(self, start: Node, data: bytes, pos: int, num_pages: int, extras: list[bytes] | None) -> Walk:
        """The host-only runs below ``start`` (a node on the GPU or a root) that continue the
        pages of ``data`` from page ``pos`` on (at most ``num_pages`` in all, with per page extra
        identity bytes ``extras`` or None): a ``Walk`` whose ``pages`` counts the pages found on
        the host only. Changes nothing."""
        tree = self.tree
        nodes: list[Node] = []
        node = start
        found = 0
        while pos < num_pages:
            child = node.child
            if child is None:
                child = tree.child_among(node, data, pos, extras)
                if child is None:
                    break
            if child.pages is not None:
                break
            same = tree._common_pages(child, data, pos, num_pages, extras)
            ready = self.ready[np.frombuffer(child.host, dtype=np.int32, count=same)]
            if not ready.all():
                same = int(ready.argmin())  # its save is not done yet: matched from then on
            if not same:
                break
            nodes.append(child)
            found += same
            if same < len(child.keys):
                return Walk(nodes, found, same)
            pos += same
            node = child
        return Walk(nodes, found, 0)

    def pin(self, walk: Walk, count: int) -> array:
        """Pin the first ``count`` host pages of ``walk`` (from ``walk``): their ids, in prompt
        order."""
        pages = array("i")
        for node in walk.nodes:
            pages += node.host[: count - len(pages)]
            if len(pages) == count:
                break
        # Distinct pages (one prompt's runs), so one fancy-indexed add counts each once.
        self.pins[np.frombuffer(pages, dtype=np.int32)] += 1
        self.pinned += len(pages)
        return pages

    def unpin(self, pages: array) -> None:
        """Drop one pin of each of ``pages``; orphans whose last pin goes are free."""
        ids = np.frombuffer(pages, dtype=np.int32)
        pins = self.pins
        pins[ids] -= 1
        self.pinned -= len(pages)
        freed = ids[(pins[ids] == 0) & self.orphan[ids]]
        if len(freed):
            self.orphan[freed] = False
            self.pool.free.frombytes(freed.tobytes())

    def queue_load(self, seq: Sequence, host: array, gpu: np.ndarray) -> None:
        """Queue the loads of ``seq``'s host pages ``host`` (pinned) into its GPU pages ``gpu``."""
        self.loads.append((host, int_pages(gpu)))
        self.loading.append(seq)
        seq._load_host = host

    def cancel(self, seq: Sequence) -> None:
        """``seq``, loading, closes: its pins go, and its loads if not yet taken."""
        if seq in self.loading:
            i = self.loading.index(seq)
            del self.loading[i]
            del self.loads[i]
        if seq._load_host is not None:
            self.unpin(seq._load_host)
        seq._load_host = None
        seq._loading = 0

    def upgrade(self, walk: Walk, seq: Sequence, start: int) -> Node:
        """The host runs of ``walk`` (below ``seq._node``, which ``seq`` holds) take ``seq``'s
        pages from block table index ``start`` on as their GPU pages, held by ``seq``; their host
        pages are freed. Returns the deepest."""
        tree = self.tree
        nodes = walk.nodes
        if walk.partial:
            nodes = [*nodes[:-1], tree.split(nodes[-1], walk.partial)]
        events = self.events
        root = seq._root
        table = seq._pages
        for node in nodes:
            size = len(node.keys)
            pages = int_pages(table[start : start + size])
            start += size
            host = node.host
            node.host = None
            node.pages = pages
            node.ref = 1
            node.lru_serial = -1
            self.release_pages(host)
            self.num_cached -= size
            tree.num_host_nodes -= 1
            tree.num_pages += size
            if events is not None:
                parent = node.parent
                events.emit((list(node.keys), root.namespace, MEDIUM_CPU))
                events.emit(
                    (
                        list(node.keys),
                        None if parent is root else parent.keys[-1],
                        bytes(node.tokens),
                        root.namespace,
                        event_extras(node),
                    )
                )
        tree.version += 1
        return nodes[-1]

    # ------------------------------------------------------------------ batches

    def take_batch(self) -> Transfers | None:
        """The copies queued since the last call, as one batch, or None when there are none."""
        if not self.saves and not self.loads:
            return None
        self.ticket += 1
        saves = pairs(self.saves)
        if len(saves):
            # A host page saved twice in the batch (its first run left the host before the batch
            # was taken, and another took the page): only the last save is its run's.
            last = len(saves) - 1 - np.unique(saves[::-1, 1], return_index=True)[1]
            if len(last) < len(saves):
                saves = saves[np.sort(last)]
            self.writer[saves[:, 1]] = self.ticket
        batch = Transfers(saves, pairs(self.loads), self.ticket)
        self.saved_pages += len(batch.saves)
        for seq in self.loading:
            seq._load_ticket = self.ticket
        self.in_flight[self.ticket] = (batch, self.loading)
        self.saves = []
        self.loads = []
        self.loading = []
        return batch

    def in_flight_batch(self, batch: object) -> bool:
        """Whether ``batch`` is one of this tier's batches taken and not yet done."""
        entry = self.in_flight.get(getattr(batch, "ticket", None))
        return entry is not None and entry[0] is batch

    def finish(self, batch: Transfers, ok: bool) -> list[Sequence]:
        """Forget ``batch``: its saves' pages are ready, or (failed) their runs leave the tree;
        returns the sequences still waiting on its loads (their pins go, their loads are over)."""
        _, seqs = self.in_flight.pop(batch.ticket)
        ticket = batch.ticket
        if len(batch.saves):
            # Pages written by a later batch since, or freed, are not this batch's any more.
            written = batch.saves[:, 1][self.writer[batch.saves[:, 1]] == ticket]
            if ok:
                self.ready[written] = True
            elif len(written):
                self.forget(set(written.tolist()))
        waiting = [seq for seq in seqs if seq._owner is not None and seq._load_ticket == ticket]
        for seq in waiting:
            self.unpin(seq._load_host)
            seq._load_host = None
        return waiting

    def forget(self, written: set[int]) -> None:
        """Saves into host pages ``written`` failed: the runs on the host in them leave the tree
        (with the host runs below them). None is loading: only ready pages are matched."""
        stale = [
            node
            for node in self.tree.nodes()
            if node.pages is None and node.host is not None and not written.isdisjoint(node.host)
        ]
        for node in stale:
            if node.host is not None:  # not dropped with a stale parent
                self.drop(node)

    def clear(self) -> None:
        """Free every host page (``PrefixCache.reset``; no sequence is open, so none is pinned) and
        forget the copies not yet taken."""
        self.pool = PagePool(self.num_pages)
        self.num_cached = 0
        self.heap = []
        self.pins[:] = 0
        self.pinned = 0
        self.orphan[:] = False
        self.writer[:] = 0
        self.ready[:] = False
        self.saves = []
        self.loads = []
        self.loading = []


def event_extras(node: Node) -> list[bytes | None] | None:
    """A run's extra identity bytes as events carry them: per page, None for a page without."""
    return None if node.extras is None else [extra or None for extra in node.extras]


def pairs(parts: list[tuple[array, array]]) -> np.ndarray:
    """Rows ``(a, b)`` of int32 from pairs of equally long ``array('i')`` of page ids."""
    if not parts:
        return _NO_PAIRS
    first = array("i")
    second = array("i")
    for a, b in parts:
        first += a
        second += b
    rows = np.empty((len(first), 2), dtype=np.int32)
    rows[:, 0] = np.frombuffer(first, dtype=np.int32)
    rows[:, 1] = np.frombuffer(second, dtype=np.int32)
    return rows

"""``PrefixCache.check_invariants``: the whole bookkeeping checked against itself, kept apart from
the cache's hot path. It reads the cache's private state; nothing here changes it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.block_tree import has_gpu_child
from prefix_cache.cache.errors import InvariantError
from prefix_cache.cache.hashing import namespace_seed
from prefix_cache.cache.tree_nodes import Node, Root
from prefix_cache.cache.write_through import has_host_child

if TYPE_CHECKING:
    from prefix_cache.cache.prefix_cache import PrefixCache


class InvariantChecker:
    """The work of ``PrefixCache.check_invariants``: one pass over a cache's private state."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.tree = cache._tree
        # page id -> what owns it, to catch a page booked twice; the same for host pages.
        self.owner: dict[int, str] = {}
        self.host_owner: dict[int, str] = {}
        # The nodes reachable from the roots.
        self.reachable: set[Node] = set()
        # Per node id, the live sequences that hold it through their own copies, and where.
        self.copies: dict[int, dict[object, int]] = {}

    def fail(self, message: str) -> None:
        raise InvariantError(message)

    def book_host(self, page: int, what: str) -> None:
        tier = self.cache._tier
        if tier is None:
            self.fail(f"{what}: host page {page} without a host tier")
        if not 0 <= page < tier.num_pages:
            self.fail(f"{what}: host page id {page} outside [0, {tier.num_pages})")
        if page in self.host_owner:
            self.fail(f"host page {page} is both {self.host_owner[page]} and {what}")
        self.host_owner[page] = what

    def book(self, page: int, what: str) -> None:
        if not 0 <= page < self.cache._num_pages:
            self.fail(f"{what}: page id {page} outside [0, {self.cache._num_pages})")
        if page in self.owner:
            self.fail(f"page {page} is both {self.owner[page]} and {what}")
        self.owner[page] = what

    def run(self) -> None:
        cache, tree = self.cache, self.tree
        for page in cache._pool.free:
            self.book(page, "free")
        nodes = self.check_tree()
        self.reachable = set(nodes)
        expected_ref = self.check_sequences()
        for node in nodes:
            holders = expected_ref.get(id(node), 0)
            if node.ref != holders:
                self.fail(f"{self.name(node)}: ref {node.ref}, but {holders} live sequences hold it")
            copies = self.copies.get(id(node), {})
            if (node.copies or {}) != copies or (node.copies is not None and not node.copies):
                self.fail(f"{self.name(node)}: its list of holders with their own copies is wrong")
            if node.ref and len(copies) == node.ref:
                self.fail(f"{self.name(node)}: held, but in no live block table")
        for root in tree.roots.values():
            holders = sum(1 for seq in cache._live if seq._root is root)
            if root.ref != holders:
                self.fail(f"root of {root.namespace!r}: ref {root.ref}, but {holders} live sequences")
        if len(self.owner) != cache._num_pages:
            self.fail(f"{cache._num_pages - len(self.owner)} pages are neither free, held nor cached")
        # What the engine can see: every page is free, evictable, or in a live block table.
        tables = {page for seq in cache._live for page in seq._pages[: seq._num_pages].tolist()}
        if len(cache._pool.free) + tree.num_unreferenced + len(tables) != cache._num_pages:
            self.fail(
                f"free {len(cache._pool.free)} + evictable {tree.num_unreferenced} + in live block "
                f"tables {len(tables)} != {cache._num_pages} pages"
            )
        self.check_lru(nodes)
        if cache._tier is not None:
            self.check_host(nodes)
        elif tree.num_host_nodes or any(node.pages is None or node.host is not None for node in nodes):
            self.fail("runs on a host tier that does not exist")

    def check_host(self, nodes: list[Node]) -> None:
        """The host tier: every host page free, cached by one run (on the host only, or, with
        write-through, on both tiers), or left by its run while loads still read it (pinned);
        pins are the loads of live sequences; the host LRU holds exactly the host-only leaves
        (with write-through: at least every run with a host copy and no child with one)."""
        cache, tier = self.cache, self.cache._tier
        host_only = [node for node in nodes if node.pages is None]
        if len(host_only) != self.tree.num_host_nodes:
            self.fail(f"{len(host_only)} runs on the host only, counter says {self.tree.num_host_nodes}")
        cached = sum(len(node.host) for node in nodes if node.host is not None)
        if cached != tier.num_cached:
            self.fail(f"{cached} host pages cached, counter says {tier.num_cached}")
        for page in tier.pool.free:
            self.book_host(page, "free on the host")
            if tier.pins[page]:
                self.fail(f"host page {page} is free while a load reads it")
        for page in np.flatnonzero(tier.orphan).tolist():
            if not tier.pins[page]:
                self.fail(f"host page {page} waits for a load that does not exist")
            self.book_host(page, "left by its run, pinned")
        orphaned = np.count_nonzero(tier.orphan)
        if tier.orphaned != orphaned:
            self.fail(f"{orphaned} host pages wait for loads, counter says {tier.orphaned}")
        if len(self.host_owner) != tier.num_pages:
            self.fail(
                f"{tier.num_pages - len(self.host_owner)} host pages are neither free, cached nor pinned"
            )
        pins = np.zeros(tier.num_pages, dtype=np.int32)
        for seq in cache._live:
            for page in seq._load_host or ():
                pins[page] += 1
        if not np.array_equal(pins, tier.pins) or tier.pinned != pins.sum():
            self.fail("host pins are not the pages live sequences load")
        queued = [seq for seq in tier.loading if seq._owner is not cache or not seq._loading]
        if queued or len(tier.loading) != len(tier.loads):
            self.fail("a queued load belongs to no loading sequence")
        if tier.write_through:
            self.check_write_through(nodes)
            return
        live = {
            id(node) for tick, serial, node in tier.heap if node.host_serial == serial and tick == node.tick
        }
        leaves = {id(node) for node in host_only if node.is_leaf}
        if live != leaves:
            self.fail(f"host LRU holds {len(live)} runs, {len(leaves)} host-only leaves exist")

    def check_write_through(self, nodes: list[Node]) -> None:
        """The host LRU of a write-through tier: one live entry per run with a host copy and no
        child with one (entries of others are dropped when popped), none newer than its run;
        published pages are pages of runs' host copies; no copy waits for a batch that is done."""
        tier = self.cache._tier
        live: dict[int, int] = {}
        for tick, serial, node in tier.heap:
            if node.host_serial == serial:
                if id(node) in live or node.host is None or node not in self.reachable:
                    self.fail(f"{self.name(node)}: a host LRU entry for no host copy, or two")
                if tick > (self.tree.tick + 1 if node.ref else node.tick):
                    self.fail(f"{self.name(node)}: host LRU entry newer than the run")
                live[id(node)] = serial
        for node in nodes:
            if node.host_serial >= 0 and live.get(id(node)) != node.host_serial:
                self.fail(f"{self.name(node)}: claims a host LRU entry that does not exist")
            if node.host is not None and not has_host_child(node) and id(node) not in live:
                self.fail(f"{self.name(node)}: a host eviction candidate missing from the host LRU")
        owned = np.zeros(tier.num_pages, dtype=bool)
        for node in nodes:
            if node.host is not None:
                owned[np.frombuffer(node.host, dtype=np.int32)] = True
        if (tier.published & ~owned).any() or (tier.copy_id.astype(bool) & ~owned).any():
            self.fail("a host page no run holds is published or waits for its copy's event")

    def check_tree(self) -> list[Node]:
        tree = self.tree
        page_bytes = 4 * self.cache._page_size
        nodes = []
        pages = 0
        for namespace, root in tree.roots.items():
            if not isinstance(root, Root) or root.namespace != namespace or root.parent is not None:
                self.fail(f"bad root for namespace {namespace!r}")
            if root.seed != namespace_seed(namespace):
                self.fail(f"root of {namespace!r} has the wrong seed")
            if root.ref == 0 and root.is_leaf:
                self.fail(f"empty unused root of {namespace!r} was not dropped")
            if len(root.pages) or len(root.keys) or root.tokens or root.extras is not None:
                self.fail(f"root of {namespace!r} holds pages")
            keys: set[int] = set()
            stack: list[Node] = [root]
            while stack:
                parent = stack.pop()
                if parent.children is not None and (parent.child is not None or len(parent.children) < 2):
                    # The hot paths rely on it: one child in ``child``, two or more in ``children``.
                    self.fail(f"{self.name(parent)}: children kept in the wrong slot")
                if parent.children is None:
                    kids = [parent.child] if parent.child is not None else []
                else:
                    kids = list(parent.children.values())
                    for ident, kid in parent.children.items():
                        if kid.first_identity(page_bytes) != ident:
                            self.fail(f"{self.name(kid)}: not its parent's child under its first page")
                for kid in kids:
                    if kid.parent is not parent or kid.root is not root or isinstance(kid, Root):
                        self.fail(f"{self.name(kid)}: wrong parent or namespace")
                    if kid.pages is not None and parent.pages is None:
                        self.fail(f"{self.name(kid)}: on the GPU below a run on the host only")
                    self.check_run(kid, parent, keys)
                    if kid.pages is not None:
                        pages += len(kid.pages)
                    nodes.append(kid)
                    stack.append(kid)
            if keys != root.index:
                self.fail(f"namespace {namespace!r}: its key index is not the keys of its pages")
        if pages != tree.num_pages:
            self.fail(f"tree holds {pages} pages, counter says {tree.num_pages}")
        unreferenced = sum(len(node.pages) for node in nodes if node.ref == 0 and node.pages is not None)
        if unreferenced != tree.num_unreferenced:
            self.fail(f"{unreferenced} unreferenced pages, counter says {tree.num_unreferenced}")
        return nodes

    @staticmethod
    def name(node: Node) -> str:
        pages, where = (node.pages, "") if node.pages is not None else (node.host, "host ")
        if pages is None:
            return f"run of keys {node.keys[:2]} without pages"
        return f"run of {where}pages {pages.tolist()[:4]}{'...' if len(pages) > 4 else ''}"

    def check_run(self, node: Node, parent: Node, keys: set[int]) -> None:
        """One node: its run's shapes, keys (chained, unique in the namespace), reference count
        and pages."""
        page_bytes = 4 * self.cache._page_size
        name = self.name(node)
        size = len(node.keys)
        tiers = [pages for pages in (node.pages, node.host) if pages is not None]
        tier = self.cache._tier
        both = tier is not None and tier.write_through
        if not tiers or len(tiers) > (2 if both else 1):
            # Both only with write-through: then a run's host copy is the whole run.
            self.fail(f"{name}: on {len(tiers)} tiers")
        for pages in tiers:
            if size == 0 or len(pages) != size or len(node.tokens) != size * page_bytes:
                self.fail(f"{name}: {len(pages)} pages, {size} keys, {len(node.tokens)} token bytes")
        if node.pages is None and node.ref:
            self.fail(f"{name}: on the host only, but held by {node.ref} sequences")
        if node.extras is not None and (len(node.extras) != size or not any(node.extras)):
            self.fail(f"{name}: extra bytes for {len(node.extras)} pages, or none at all")
        key = parent.last_key()
        for index in range(size):
            key = self.tree.hash_fn(node.identity(index, page_bytes), key)
            if node.keys[index] != key:
                self.fail(f"{name}: key of page {index} is not the hash of its tokens")
            if key in keys:
                self.fail(f"{name}: key of page {index} is taken twice in its namespace")
            keys.add(key)
            if node.pages is not None:
                self.book(node.pages[index], "cached")
            if node.host is not None:
                self.book_host(node.host[index], f"cached on the host ({name})")
        if node.ref < 0 or (node.ref > parent.ref and not isinstance(parent, Root)):
            self.fail(f"{name}: ref {node.ref} exceeds its parent's {parent.ref}")

    def check_sequences(self) -> dict[int, int]:
        """Check each live sequence; return the expected ref count per node id."""
        cache = self.cache
        page_size = cache._page_size
        page_bytes = 4 * page_size
        expected_ref: dict[int, int] = {}
        for seq in cache._live:
            name = f"sequence {seq._id}"
            if seq._owner is not cache or seq._cache is not cache:
                self.fail(f"{name} is live but not owned by this cache")
            if cache._tree.roots.get(seq._namespace) is not seq._root:
                self.fail(f"{name}: its root is not its namespace's root")
            if not 0 <= seq._num_tokens <= seq._num_allocated <= seq._capacity:
                self.fail(
                    f"{name}: tokens {seq._num_tokens}, allocated {seq._num_allocated}, "
                    f"capacity {seq._capacity} out of order"
                )
            pages_needed = -(-seq._num_allocated // page_size)
            if seq._num_pages != pages_needed or seq._capacity != seq._num_pages * page_size:
                self.fail(f"{name}: {seq._num_pages} pages for {seq._num_allocated} allocated tokens")
            if len(seq._tokens) < seq._capacity or len(seq._pages) < seq._num_pages:
                self.fail(f"{name}: buffers smaller than its pages")
            full = seq._num_tokens // page_size
            if seq._loading:
                # Nothing after the GPU prefix is offered before its loads are done.
                loading = seq._loading // page_size
                if seq._num_full_pages + loading > full or seq._loading % page_size:
                    self.fail(f"{name}: loads {seq._loading} tokens after {seq._num_full_pages} pages")
                if seq._load_host is None or len(seq._load_host) != loading:
                    self.fail(f"{name}: loads {loading} pages, pins {seq._load_host}")
                full = seq._num_full_pages
            elif seq._load_host is not None:
                self.fail(f"{name}: pins host pages without loading")
            if seq._num_full_pages != full:
                self.fail(f"{name}: {full} full pages, {seq._num_full_pages} offered to the tree")
            held = seq._num_held
            if held > full or (not seq._broken and held != full):
                self.fail(f"{name}: holds {held} cached pages of {full} full ones")
            # Its path: the node it holds deepest and every node above it, root first.
            path: list[Node] = []
            node = seq._node
            while node is not None and node is not seq._root:
                path.append(node)
                node = node.parent
            if node is not seq._root:
                self.fail(f"{name}: its deepest node is not in its namespace's tree")
            path.reverse()
            if sum(len(node.pages) for node in path) != held:
                self.fail(f"{name}: its path holds {sum(len(n.pages) for n in path)} pages, it counts {held}")
            dups = list(seq._dups)
            index = 0
            for node in path:
                if node not in self.reachable:
                    self.fail(f"{name}: holds a node that is not in the tree")
                if node.pages is None:
                    self.fail(f"{name}: holds a run that is on the host only")
                start = index
                copy = seq._pages[index : index + len(node.pages)].tolist() != node.pages.tolist()
                if copy:
                    self.copies.setdefault(id(node), {})[seq] = start
                for i, cached in enumerate(node.pages):
                    page = int(seq._pages[index])
                    if copy == (page == cached):
                        self.fail(f"{name}: block table entry {index} mixes cached pages and copies in a run")
                    if page != cached:
                        # Its own copy of a block another sequence cached first: private to it.
                        if page not in dups:
                            self.fail(
                                f"{name}: block table entry {index} is neither a cached page nor a copy"
                            )
                        dups.remove(page)
                        self.book(page, f"private copy of {name}")
                    tokens = seq._tokens[index * page_size : (index + 1) * page_size].tobytes()
                    if seq._extras:
                        tokens += seq._extras.get(index, b"")
                    if tokens != node.identity(i, page_bytes):
                        self.fail(f"{name}: page {index} tokens differ from the cached page's")
                    index += 1
                expected_ref[id(node)] = expected_ref.get(id(node), 0) + 1
            if dups:
                self.fail(f"{name}: private copies {dups} are not in its block table")
            for index in range(held, seq._num_pages):
                self.book(int(seq._pages[index]), f"private to {name}")
        return expected_ref

    def check_lru(self, nodes: list[Node]) -> None:
        tree = self.tree
        live: dict[int, Node] = {}
        last_tick = -1
        for node in tree.recent:
            if node.lru_serial != 0:
                self.fail(f"{self.name(node)} is in the recent LRU but marked {node.lru_serial}")
            if node.tick < last_tick:
                self.fail(f"{self.name(node)}: recent LRU out of tick order")
            last_tick = node.tick
            live[id(node)] = node
        for tick, serial, node in tree.older:
            if node.lru_serial == serial:
                if id(node) in live:
                    self.fail(f"{self.name(node)} has two live LRU entries")
                if tick != node.tick:
                    self.fail(f"{self.name(node)}: LRU entry tick {tick}, node tick {node.tick}")
                live[id(node)] = node
        candidates = {
            id(node) for node in nodes if node.pages is not None and node.ref == 0 and not has_gpu_child(node)
        }
        if set(live) != candidates:
            self.fail(f"LRU holds {len(live)} runs, {len(candidates)} unreferenced leaves exist")
        if len(live) != tree.num_lru:
            self.fail(f"LRU counter {tree.num_lru}, {len(live)} live entries")
        if any(node.lru_serial >= 0 and id(node) not in live for node in nodes if node.pages is not None):
            self.fail("a node claims an LRU entry that does not exist")
        heap = tree.older
        for index in range(1, len(heap)):
            if heap[(index - 1) // 2][:2] > heap[index][:2]:
                self.fail("LRU heap order is broken")

"""``PrefixCache.check_invariants``: the whole bookkeeping checked against itself, kept apart from
the cache's hot path. It reads the cache's private state; nothing here changes it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefix_cache.block_tree import Node, Root
from prefix_cache.errors import InvariantError
from prefix_cache.hashing import namespace_seed

if TYPE_CHECKING:
    from prefix_cache.cache import PrefixCache


class InvariantChecker:
    """The work of ``PrefixCache.check_invariants``: one pass over a cache's private state."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.tree = cache._tree
        # page id -> what owns it, to catch a page booked twice.
        self.owner: dict[int, str] = {}

    def fail(self, message: str) -> None:
        raise InvariantError(message)

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
        expected_ref = self.check_sequences()
        for node in nodes:
            holders = expected_ref.get(id(node), 0)
            if node.ref != holders:
                self.fail(f"page {node.page}: ref {node.ref}, but {holders} live sequences hold it")
        for root in tree.roots.values():
            holders = sum(1 for seq in cache._live if seq._root is root)
            if root.ref != holders:
                self.fail(f"root of {root.namespace!r}: ref {root.ref}, but {holders} live sequences")
        if len(self.owner) != cache._num_pages:
            self.fail(f"{cache._num_pages - len(self.owner)} pages are neither free, held nor cached")
        self.check_lru(nodes)

    def check_tree(self) -> list[Node]:
        tree = self.tree
        for namespace, root in tree.roots.items():
            if not isinstance(root, Root) or root.namespace != namespace or root.parent is not None:
                self.fail(f"bad root for namespace {namespace!r}")
            if root.key != namespace_seed(namespace):
                self.fail(f"root of {namespace!r} has the wrong seed")
            if root.ref == 0 and root.is_leaf:
                self.fail(f"empty unused root of {namespace!r} was not dropped")
        children: dict[int, int] = {}
        nodes = []
        for root in tree.roots.values():
            for key, node in root.index.items():
                nodes.append(node)
                parent = node.parent
                if node.key != key or isinstance(node, Root) or parent is None or node.root is not root:
                    self.fail(f"page {node.page}: indexed under the wrong key or namespace")
                if parent is not root and root.index.get(parent.key) is not parent:
                    self.fail(f"page {node.page}: its parent is not in its namespace's tree")
                if len(node.tokens) < 4 * self.cache._page_size:
                    self.fail(f"page {node.page}: stores {len(node.tokens)} bytes of tokens")
                if tree.hash_fn(node.tokens, parent.key) != key:
                    self.fail(f"page {node.page}: key is not the hash of its tokens")
                if node.ref < 0 or (node.ref > parent.ref and not isinstance(parent, Root)):
                    self.fail(f"page {node.page}: ref {node.ref} exceeds its parent's {parent.ref}")
                if parent.child_with(node.tokens) is not node:
                    self.fail(f"page {node.page}: not its parent's child under its tokens")
                children[id(parent)] = children.get(id(parent), 0) + 1
                self.book(node.page, "cached")
        for node in [*tree.roots.values(), *nodes]:
            if node.children is not None and (node.child is not None or len(node.children) < 2):
                # The hot paths rely on it: one child in ``child``, two or more in ``children``.
                self.fail(f"page {node.page}: children kept in the wrong slot")
            listed = len(node.children) if node.children is not None else int(node.child is not None)
            if listed != children.get(id(node), 0):
                self.fail(
                    f"page {node.page}: {listed} children listed, {children.get(id(node), 0)} in the tree"
                )
        if len(nodes) != tree.num_nodes:
            self.fail(f"tree holds {len(nodes)} nodes, counter says {tree.num_nodes}")
        unreferenced = sum(1 for node in nodes if node.ref == 0)
        if unreferenced != tree.num_unreferenced:
            self.fail(f"{unreferenced} unreferenced nodes, counter says {tree.num_unreferenced}")
        return nodes

    def check_sequences(self) -> dict[int, int]:
        """Check each live sequence; return the expected ref count per node id."""
        cache = self.cache
        page_size = cache._page_size
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
            if seq._num_full_pages != full:
                self.fail(f"{name}: {full} full pages, {seq._num_full_pages} offered to the tree")
            if len(seq._nodes) > full or (not seq._broken and len(seq._nodes) != full):
                self.fail(f"{name}: holds {len(seq._nodes)} cached pages of {full} full ones")
            parent: Node = seq._root
            dups = list(seq._dups)
            for index, node in enumerate(seq._nodes):
                if node.parent is not parent or seq._root.index.get(node.key) is not node:
                    self.fail(f"{name}: page {index} is not in the tree under the page before it")
                page = int(seq._pages[index])
                if page != node.page:
                    # Its own copy of a block another sequence cached first: private to it.
                    if page not in dups:
                        self.fail(f"{name}: block table entry {index} is neither a cached page nor a copy")
                    dups.remove(page)
                    self.book(page, f"private copy of {name}")
                tokens = seq._tokens[index * page_size : (index + 1) * page_size].tobytes()
                if seq._extras:
                    tokens += seq._extras.get(index, b"")
                if tokens != node.tokens:
                    self.fail(f"{name}: page {index} tokens differ from the cached page's")
                expected_ref[id(node)] = expected_ref.get(id(node), 0) + 1
                parent = node
            if dups:
                self.fail(f"{name}: private copies {dups} are not in its block table")
            for index in range(len(seq._nodes), seq._num_pages):
                self.book(int(seq._pages[index]), f"private to {name}")
        return expected_ref

    def check_lru(self, nodes: list[Node]) -> None:
        tree = self.tree
        live: dict[int, Node] = {}
        last_tick = -1
        for node in tree.recent:
            if node.lru_serial != 0:
                self.fail(f"page {node.page} is in the recent LRU but marked {node.lru_serial}")
            if node.tick < last_tick:
                self.fail(f"page {node.page}: recent LRU out of tick order")
            last_tick = node.tick
            live[id(node)] = node
        for tick, serial, node in tree.older:
            if node.lru_serial == serial:
                if id(node) in live:
                    self.fail(f"page {node.page} has two live LRU entries")
                if tick != node.tick:
                    self.fail(f"page {node.page}: LRU entry tick {tick}, node tick {node.tick}")
                live[id(node)] = node
        candidates = {id(node) for node in nodes if node.ref == 0 and node.is_leaf}
        if set(live) != candidates:
            self.fail(f"LRU holds {len(live)} pages, {len(candidates)} unreferenced leaves exist")
        if len(live) != tree.num_lru:
            self.fail(f"LRU counter {tree.num_lru}, {len(live)} live entries")
        if any(node.lru_serial >= 0 and id(node) not in live for node in nodes):
            self.fail("a node claims an LRU entry that does not exist")
        heap = tree.older
        for index in range(1, len(heap)):
            if heap[(index - 1) // 2][:2] > heap[index][:2]:
                self.fail("LRU heap order is broken")

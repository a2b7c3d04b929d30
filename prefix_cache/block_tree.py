"""The block tree: cached full pages keyed by chained hash, reference counts and LRU eviction.

Each namespace has a root; a node is one cached full page whose parent is the page before it in
the prompt. Since a key already chains in its parent's key, one dict maps every key of every
namespace to its node; a lookup counts as a hit only if the node's parent is the expected one
(which keeps namespaces apart) and its stored tokens equal the page's. A second block with a taken
key is simply not cached.

A live sequence holds one reference on every node of its cached path, so a node's ``ref`` is the
number of live sequences through it, and a node with ``ref == 0`` has only ``ref == 0``
descendants: all unreferenced nodes can be evicted, deepest first.

Eviction order is least recently released first, among unreferenced leaves. The candidates sit in
a heap keyed by ``(tick, serial)``; ``tick`` is the time the node was last released, so when
evicting a leaf turns its parent into a leaf, the parent enters the heap at the position of its own
last use (never earlier than its child's), not at either end. Entries of nodes that were acquired
again are left in the heap and skipped when popped (``Node.lru_serial`` says which entry is live);
the heap is rebuilt when stale entries outnumber live ones, so every operation is O(log n)
amortised and nothing ever scans the pool.
"""

from __future__ import annotations

import heapq

from prefix_cache.hashing import HashFn, Namespace, namespace_seed

# Rebuild the heap when it holds more than this many entries beyond twice the live ones.
_HEAP_SLACK = 1024


class Node:
    """One cached full page (or, as ``Root``, a namespace's root).

    key: chained hash of the page (the namespace seed for a root).
    parent: the node of the previous page, None for a root.
    num_children: cached nodes whose parent this is.
    page: page id in the KV pool, -1 for a root.
    tokens: the page's tokens as int32 bytes, compared on every hit.
    ref: live sequences holding this node (for a root: live sequences in its namespace).
    tick: when the node was last released, for LRU order.
    lru_serial: serial of its live heap entry, -1 when it is not an eviction candidate.
    """

    __slots__ = ("key", "lru_serial", "num_children", "page", "parent", "ref", "tick", "tokens")

    def __init__(self, key: int, parent: Node | None, page: int, tokens: bytes) -> None:
        self.key = key
        self.parent = parent
        self.num_children = 0
        self.page = page
        self.tokens = tokens
        self.ref = 0
        self.tick = 0
        self.lru_serial = -1


class Root(Node):
    """The root of one namespace: no page, and it remembers the namespace it belongs to."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: Namespace) -> None:
        super().__init__(namespace_seed(namespace), None, -1, b"")
        self.namespace = namespace


class BlockTree:
    """Cached pages of all namespaces, with reference counts and the LRU of evictable leaves.

    The tree never allocates or frees pages itself: ``add_child`` takes a page the caller owns and
    ``pop_lru`` hands the evicted node (and its page) back to the caller.
    """

    def __init__(self, hash_fn: HashFn) -> None:
        self.hash_fn = hash_fn
        self.roots: dict[Namespace, Root] = {}
        #: Every cached node by key.
        self.index: dict[int, Node] = {}
        #: Bumped whenever a node is added or removed, so a match result can be reused while the
        #: tree is unchanged.
        self.version = 0
        #: Nodes (= cached pages) in the tree, roots excluded.
        self.num_nodes = 0
        #: Nodes with ``ref == 0``: all of them can be evicted, leaves first.
        self.num_unreferenced = 0
        self.tick = 0
        # Heap of (tick, serial, node); serials are unique, so nodes are never compared.
        self.lru: list[tuple[int, int, Node]] = []
        self.num_lru = 0
        self._serial = 0

    def root(self, namespace: Namespace) -> Root:
        """The root of ``namespace``, created when missing. ``namespace`` must be valid."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Root(namespace)
        return root

    def match(self, root: Root, data: bytes, num_pages: int, page_bytes: int) -> list[Node]:
        """The nodes of the longest cached prefix of ``data``, at most ``num_pages`` pages.

        data: the prompt's int32 token bytes, at least ``num_pages * page_bytes`` long.
        A hash hit counts only if the node's stored tokens equal the page's tokens.
        """
        nodes: list[Node] = []
        node: Node = root
        get = self.index.get
        hash_fn = self.hash_fn
        start = 0
        for _ in range(num_pages):
            if not node.num_children:
                break
            chunk = data[start : start + page_bytes]
            child = get(hash_fn(chunk, node.key))
            if child is None or child.parent is not node:
                break
            nodes.append(child)
            node = child
            start += page_bytes
        return nodes

    def acquire(self, nodes: list[Node]) -> None:
        """Take one reference on each of ``nodes`` for a live sequence."""
        for node in nodes:
            if node.ref == 0:
                self.num_unreferenced -= 1
                if node.lru_serial >= 0:
                    # Its heap entry goes stale and is skipped when popped.
                    node.lru_serial = -1
                    self.num_lru -= 1
            node.ref += 1

    def release(self, nodes: list[Node]) -> None:
        """Drop one reference on each of ``nodes`` (a sequence's path), stamping them as used now."""
        self.tick += 1
        tick = self.tick
        for node in nodes:
            node.tick = tick
            node.ref -= 1
            if node.ref == 0:
                self.num_unreferenced += 1
                if not node.num_children:
                    self._push(node)

    def extend(self, parent: Node, key: int, data: bytes, page_bytes: int, pages: list[int]) -> list[Node]:
        """Cache ``pages`` as a chain of new nodes below ``parent``, each held once by the caller.
        Returns the new nodes: all pages, or fewer if a later page's key is already taken.

        key: the first page's key, which must not be in the tree; ``parent`` is held or a root.
        data: the pages' int32 token bytes, ``len(pages) * page_bytes`` long.
        A later page cannot have a cached twin (its parent is new), so only its key is checked.
        """
        hash_fn = self.hash_fn
        index = self.index
        nodes: list[Node] = []
        start = 0
        for page in pages:
            chunk = data[start : start + page_bytes]
            if start:
                key = hash_fn(chunk, parent.key)
                if key in index:
                    # Taken by another block (a collision, or a constant test hash): stop here.
                    break
            start += page_bytes
            node = Node(key, parent, page, chunk)
            node.ref = 1
            parent.num_children += 1
            index[key] = node
            nodes.append(node)
            parent = node
        self.num_nodes += len(nodes)
        self.version += 1
        return nodes

    def pop_lru(self) -> Node | None:
        """Remove the least recently released unreferenced leaf from the tree and return it, or
        None when nothing is evictable. Its parent may become the next candidate."""
        lru = self.lru
        while lru:
            _, serial, node = heapq.heappop(lru)
            if node.lru_serial != serial:
                continue
            node.lru_serial = -1
            self.num_lru -= 1
            parent = node.parent
            assert parent is not None
            del self.index[node.key]
            parent.num_children -= 1
            self.num_nodes -= 1
            self.num_unreferenced -= 1
            self.version += 1
            if parent.ref == 0 and not parent.num_children:
                if isinstance(parent, Root):
                    del self.roots[parent.namespace]
                else:
                    self._push(parent)
            return node
        return None

    def release_root(self, root: Root) -> None:
        """A sequence of ``root``'s namespace closed; forget the root once it is unused and empty,
        so per-request namespaces (cache salts) do not pile up."""
        root.ref -= 1
        if root.ref == 0 and not root.num_children:
            del self.roots[root.namespace]

    def _push(self, node: Node) -> None:
        """Make ``node`` (unreferenced, a leaf) an eviction candidate."""
        self._serial += 1
        node.lru_serial = self._serial
        self.num_lru += 1
        heapq.heappush(self.lru, (node.tick, self._serial, node))
        if len(self.lru) > 2 * self.num_lru + _HEAP_SLACK:
            self.lru = [entry for entry in self.lru if entry[2].lru_serial == entry[1]]
            heapq.heapify(self.lru)

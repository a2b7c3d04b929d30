"""The block tree: cached full pages keyed by chained hash, reference counts and LRU eviction.

Each namespace has a root; a node is one cached full page whose parent is the page before it in
the prompt. Since a key already chains in its parent's key, one dict maps every key of every
namespace to its node; a lookup counts as a hit only if the node's parent is the expected one
(which keeps namespaces apart) and its stored tokens equal the page's. A second block with a taken
key is simply not cached.

A live sequence holds one reference on every node of its cached path, so a node's ``ref`` is the
number of live sequences through it, and a node with ``ref == 0`` has only ``ref == 0``
descendants: all unreferenced nodes can be evicted, deepest first.

Eviction order is least recently released first (by ``Node.tick``, stamped at release), among
unreferenced leaves. A leaf that becomes a candidate when a sequence releases it has the newest
tick, so those leaves sit in an ordered dict in tick order: O(1) to add, remove or pop the oldest.
A parent that becomes a leaf because its last child was evicted keeps its own, older tick, so it
goes into a small heap keyed by ``(tick, serial)`` rather than at either end of the dict; the
next victim is the older of the two heads. Heap entries of parents that were acquired again are
skipped when popped (``Node.lru_serial`` names the live entry) and dropped when they outnumber
the live ones. Every operation is O(1) or O(log n) amortised; nothing ever scans the pool.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

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
    lru_serial: where it waits as an eviction candidate: 0 in ``BlockTree.recent``, > 0 the serial
        of its entry in ``BlockTree.older``, -1 not a candidate.
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

    The tree never allocates or frees pages itself: ``extend`` takes pages the caller owns and
    ``evict`` hands the evicted nodes (and their pages) back to the caller.
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
        #: Candidates released by sequences, oldest tick first.
        self.recent: OrderedDict[Node, None] = OrderedDict()
        #: Heap of (tick, serial, node): parents that became leaves by eviction. Serials are
        #: unique, so nodes are never compared.
        self.older: list[tuple[int, int, Node]] = []
        #: Eviction candidates: ``len(recent)`` plus the live entries of ``older``.
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
        append = nodes.append
        get = self.index.get
        hash_fn = self.hash_fn
        node: Node = root
        key = root.key
        for start in range(0, num_pages * page_bytes, page_bytes):
            chunk = data[start : start + page_bytes]
            key = hash_fn(chunk, key)
            child = get(key)
            if child is None or child.parent is not node or child.tokens != chunk:
                break
            append(child)
            node = child
        return nodes

    def acquire(self, nodes: list[Node]) -> None:
        """Take one reference on each of ``nodes`` for a live sequence."""
        for node in nodes:
            if node.ref == 0:
                self.num_unreferenced -= 1
                if node.lru_serial >= 0:
                    if node.lru_serial == 0:
                        del self.recent[node]
                    # else its heap entry goes stale and is skipped when popped.
                    node.lru_serial = -1
                    self.num_lru -= 1
            node.ref += 1

    def release(self, nodes: list[Node]) -> None:
        """Drop one reference on each of ``nodes`` (a sequence's path), stamping them as used now."""
        self.tick += 1
        tick = self.tick
        recent = self.recent
        for node in nodes:
            node.tick = tick
            node.ref -= 1
            if node.ref == 0:
                self.num_unreferenced += 1
                if not node.num_children:
                    # The newest tick: its place is the young end of ``recent``.
                    recent[node] = None
                    node.lru_serial = 0
                    self.num_lru += 1
        older = self.older
        if len(older) > 2 * (self.num_lru - len(recent)) + _HEAP_SLACK:
            # Stale entries (of parents acquired again) outnumber live ones: drop them.
            self.older = [entry for entry in older if entry[2].lru_serial == entry[1]]
            heapq.heapify(self.older)

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

    def evict(self, count: int) -> list[Node]:
        """Remove up to ``count`` nodes from the tree, least recently released unreferenced leaf
        first, and return them (their pages are the caller's again). Evicting a leaf can make its
        parent a candidate, so a whole unreferenced path can go in one call."""
        recent = self.recent
        older = self.older
        index = self.index
        roots = self.roots
        heappop = heapq.heappop
        evicted: list[Node] = []
        while len(evicted) < count:
            while older and older[0][2].lru_serial != older[0][1]:
                heappop(older)  # stale: the parent was acquired again after it was pushed
            if recent:
                node = next(iter(recent))
                if older and older[0][0] < node.tick:
                    node = heappop(older)[2]
                else:
                    del recent[node]
            elif older:
                node = heappop(older)[2]
            else:
                break
            node.lru_serial = -1
            self.num_lru -= 1
            del index[node.key]
            evicted.append(node)
            parent = node.parent
            parent.num_children -= 1
            if parent.ref == 0 and not parent.num_children:
                if isinstance(parent, Root):
                    del roots[parent.namespace]
                else:
                    self._serial += 1
                    parent.lru_serial = self._serial
                    self.num_lru += 1
                    heapq.heappush(older, (parent.tick, self._serial, parent))
        removed = len(evicted)
        self.num_nodes -= removed
        self.num_unreferenced -= removed
        if removed:
            self.version += 1
        return evicted

    def release_root(self, root: Root) -> None:
        """A sequence of ``root``'s namespace closed; forget the root once it is unused and empty,
        so per-request namespaces (cache salts) do not pile up."""
        root.ref -= 1
        if root.ref == 0 and not root.num_children:
            del self.roots[root.namespace]

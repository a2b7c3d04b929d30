"""The block tree: cached full pages, reference counts and LRU eviction.

Each namespace has a root; a node is one cached full page whose parent is the page before it in
the prompt. A prompt is matched by walking down from its namespace's root, comparing each page's
token bytes with the stored ones: a hit is always the exact tokens after the exact parent, and a
namespace only ever reaches its own root's pages. No block hash is computed on the walk. Most
nodes have one child (a conversation grows page by page), so that child is kept in ``Node.child``
and costs one bytes comparison; a node with several children keeps them in a dict keyed by their
token bytes (the dict's hash finds the candidate, its equality test confirms it). Either way a
page costs about two memory accesses (the node and its tokens), which is what the walk is bound by.

Every node also has a key, the chained block hash of ``prefix_cache.hashing``: the identity that
events publish. Each root's ``index`` maps the keys of its namespace's nodes to the nodes, so keys
stay unique within a namespace; a second block whose key is taken there (a hash collision) is
simply not cached. The index is per namespace because namespace seeds are public: a tenant who
crafts colliding blocks can only stop its own blocks from being cached, never another tenant's.

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
Only leaves are candidates, so on a cached path only the last node can be one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from prefix_cache.hashing import HashFn, Namespace, default_hash_fn, namespace_seed

_KEY_LIMIT = 2**64
# Rebuild the heap when it holds more than this many entries beyond twice the live ones.
_HEAP_SLACK = 1024


class Node:
    """One cached full page (or, as ``Root``, a namespace's root).

    key: chained hash of the page (the namespace seed for a root).
    parent: the node of the previous page, None for a root.
    child: the only cached node whose parent this is, when there is exactly one; else None.
    children: when there are two or more such nodes, they by their ``tokens``; else None.
    page: page id in the KV pool, -1 for a root.
    root: the root of the node's namespace (a root's is itself).
    tokens: the page's identity bytes: its tokens as int32 bytes, then its extra keys if any.
    ref: live sequences holding this node (for a root: live sequences in its namespace).
    tick: when the node was last released, for LRU order.
    lru_serial: where it waits as an eviction candidate: 0 in ``BlockTree.recent``, > 0 the serial
        of its entry in ``BlockTree.older``, -1 not a candidate.
    """

    __slots__ = ("child", "children", "key", "lru_serial", "page", "parent", "ref", "root", "tick", "tokens")

    def __init__(self, key: int, parent: Node | None, page: int, tokens: bytes, root: Root | None) -> None:
        self.key = key
        self.parent = parent
        self.root = root
        self.child: Node | None = None
        self.children: dict[bytes, Node] | None = None
        self.page = page
        self.tokens = tokens
        # A page is cached by the sequence that computed it, which holds it.
        self.ref = 1
        self.tick = 0
        self.lru_serial = -1

    @property
    def is_leaf(self) -> bool:
        """No cached node has this one as its parent (hot paths test the two slots inline)."""
        return self.child is None and self.children is None

    def child_with(self, tokens: bytes) -> Node | None:
        """The child whose page holds ``tokens``, if cached."""
        child = self.child
        if child is not None:
            return child if child.tokens == tokens else None
        return None if self.children is None else self.children.get(tokens)


class Root(Node):
    """The root of one namespace: no page; it knows its namespace and indexes its nodes by key."""

    __slots__ = ("index", "namespace")

    def __init__(self, namespace: Namespace) -> None:
        super().__init__(namespace_seed(namespace), None, -1, b"", None)
        self.root = self
        self.ref = 0
        self.namespace = namespace
        #: Every cached node of this namespace by key.
        self.index: dict[int, Node] = {}


class BlockTree:
    """Cached pages of all namespaces, with reference counts and the LRU of evictable leaves.

    The tree never allocates or frees pages itself: ``extend`` takes pages the caller owns and
    ``evict`` hands the evicted nodes (and their pages) back to the caller.
    """

    def __init__(self, hash_fn: HashFn) -> None:
        self.hash_fn = hash_fn
        #: Keys from a caller's hash function are checked; the default's need not be.
        self.check_keys = hash_fn is not default_hash_fn
        self.roots: dict[Namespace, Root] = {}
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

    def nodes(self) -> list[Node]:
        """Every cached node of every namespace (for checks and snapshots, not the hot path)."""
        return [node for root in self.roots.values() for node in root.index.values()]

    def root(self, namespace: Namespace) -> Root:
        """The root of ``namespace``, created when missing. ``namespace`` must be valid."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Root(namespace)
        return root

    def match(self, root: Root, data: bytes, num_pages: int, page_bytes: int) -> list[Node]:
        """The nodes of the longest cached prefix of ``data``, at most ``num_pages`` pages.

        data: the prompt's int32 token bytes, at least ``num_pages * page_bytes`` long.
        """
        nodes: list[Node] = []
        append = nodes.append
        node: Node = root
        for start in range(0, num_pages * page_bytes, page_bytes):
            chunk = data[start : start + page_bytes]
            child = node.child
            if child is None:
                if node.children is None:
                    break
                child = node.children.get(chunk)
                if child is None:
                    break
            elif child.tokens != chunk:
                break
            append(child)
            node = child
        return nodes

    def lock(self, root: Root, data: bytes, num_pages: int, page_bytes: int, table: memoryview) -> list[Node]:
        """``match`` and ``acquire`` in one pass: the nodes of the longest cached prefix of
        ``data`` (at most ``num_pages`` pages), each with one more reference; their page ids are
        written to ``table[0 : len(nodes)]`` (a sequence's block table)."""
        nodes: list[Node] = []
        append = nodes.append
        node: Node = root
        newly_referenced = 0
        # The walk of ``match``, with the reference counting of ``acquire`` and the block table
        # done while each node is in cache: the walk is bound by memory accesses, not by work.
        for i, start in enumerate(range(0, num_pages * page_bytes, page_bytes)):
            chunk = data[start : start + page_bytes]
            child = node.child
            if child is None:
                if node.children is None:
                    break
                child = node.children.get(chunk)
                if child is None:
                    break
            elif child.tokens != chunk:
                break
            ref = child.ref
            if not ref:
                newly_referenced += 1
            child.ref = ref + 1
            table[i] = child.page
            append(child)
            node = child
        if newly_referenced:
            self.num_unreferenced -= newly_referenced
            # Every other node of the path has a child, so only the last can be a candidate.
            last = nodes[-1]
            if last.lru_serial >= 0:
                self._unlist(last)
        return nodes

    def acquire(self, nodes: list[Node]) -> None:
        """Take one reference on each of ``nodes`` for a live sequence."""
        for node in nodes:
            if node.ref == 0:
                self.num_unreferenced -= 1
                if node.lru_serial >= 0:
                    self._unlist(node)
            node.ref += 1

    def _unlist(self, node: Node) -> None:
        """``node``, an eviction candidate, is acquired: it is not a candidate any more."""
        if node.lru_serial == 0:
            del self.recent[node]
        # else its heap entry goes stale and is skipped when popped.
        node.lru_serial = -1
        self.num_lru -= 1

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
                if node.child is None and node.children is None:
                    # The newest tick: its place is the young end of ``recent``.
                    recent[node] = None
                    node.lru_serial = 0
                    self.num_lru += 1
        older = self.older
        if len(older) > 2 * (self.num_lru - len(recent)) + _HEAP_SLACK:
            # Stale entries (of parents acquired again) outnumber live ones: drop them.
            self.older = [entry for entry in older if entry[2].lru_serial == entry[1]]
            heapq.heapify(self.older)

    def new_keys(self, parent: Node, chunks: list[bytes]) -> list[int]:
        """The keys of new pages (``chunks``: their identity bytes) to cache as a chain below
        ``parent``, stopping before the first whose key is already taken in the namespace (a
        hash collision: keys name blocks in events, so they stay unique). Changes nothing, so a
        hash function that raises or returns a bad key leaves the tree as it was.

        Raises TypeError or ValueError when the hash function returns something other than an
        int in ``[0, 2**64)``; whatever the hash function itself raises propagates.
        """
        hash_fn = self.hash_fn
        index = parent.root.index
        check = self.check_keys
        keys: list[int] = []
        append = keys.append
        key = parent.key
        for chunk in chunks:
            key = hash_fn(chunk, key)
            if check:
                check_key(key)
            if key in index:
                break
            append(key)
        return keys

    def extend(
        self, parent: Node, chunks: list[bytes], pages: list[int], keys: list[int] | None
    ) -> list[Node]:
        """Cache ``pages`` (identity bytes ``chunks``) as a chain of new nodes below ``parent``,
        each held once by the caller, under ``keys`` (from ``new_keys``, one per page) or, when
        None, keys computed here with the hash function (which must not fail: the default).
        Returns the new nodes: all pages, or fewer when a key is taken (a collision) or repeats
        within the chain.

        parent: held or a root, without a child holding the first page's identity (so a later
            page cannot have a cached twin either: its parent is new).
        """
        root = parent.root
        index = root.index
        hash_fn = self.hash_fn
        nodes: list[Node] = []
        append = nodes.append
        key = parent.key
        for i, page in enumerate(pages):
            chunk = chunks[i]
            key = hash_fn(chunk, key) if keys is None else keys[i]
            if key in index:
                break
            node = Node(key, parent, page, chunk, root)
            if i:
                parent.child = node  # a new node has no other child
            elif parent.child is None and parent.children is None:
                parent.child = node
            else:
                _add_child(parent, node)
            index[key] = node
            append(node)
            parent = node
        if nodes:
            self.num_nodes += len(nodes)
            self.version += 1
        return nodes

    def match_chunks(self, root: Root, chunks: list[bytes]) -> list[Node]:
        """The nodes of the longest cached prefix whose pages have identity bytes ``chunks`` (a
        prompt with extra keys)."""
        nodes: list[Node] = []
        node: Node = root
        for chunk in chunks:
            child = node.child_with(chunk)
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def add(self, parent: Node, key: int, page: int, tokens: bytes) -> Node:
        """``extend`` for one page whose ``key`` is not taken (the decode path)."""
        root = parent.root
        node = Node(key, parent, page, tokens, root)
        if parent.child is None and parent.children is None:
            parent.child = node
        else:
            _add_child(parent, node)
        root.index[key] = node
        self.num_nodes += 1
        self.version += 1
        return node

    def evict(self, count: int) -> list[Node]:
        """Remove up to ``count`` nodes from the tree, least recently released unreferenced leaf
        first, and return them (their pages are the caller's again). Evicting a leaf can make its
        parent a candidate, so a whole unreferenced path can go in one call."""
        recent = self.recent
        older = self.older
        heappop = heapq.heappop
        evicted: list[Node] = []
        append = evicted.append
        # The next victim when it is already known: a parent just orphaned by eviction that is
        # older than every candidate. A cold path then goes leaf to root without heap traffic.
        known: Node | None = None
        for _ in range(count):
            if known is not None:
                node = known
                known = None
            else:
                while older and older[0][2].lru_serial != older[0][1]:
                    heappop(older)  # stale: the parent was acquired again after it was pushed
                if recent:
                    if older and older[0][0] < next(iter(recent)).tick:
                        node = heappop(older)[2]
                    else:
                        node = recent.popitem(last=False)[0]
                elif older:
                    node = heappop(older)[2]
                else:
                    break
                node.lru_serial = -1
                self.num_lru -= 1
            del node.root.index[node.key]
            append(node)
            parent = node.parent
            if parent.child is not node:
                _remove_child(parent, node)
                continue
            parent.child = None
            if parent.ref:
                continue
            if type(parent) is Root:
                del self.roots[parent.namespace]
            elif (
                len(evicted) < count
                and (not recent or parent.tick < next(iter(recent)).tick)
                and (not older or parent.tick < older[0][0])
            ):
                # Popped next anyway: ties go to ``recent`` and to older heap entries. (A stale
                # heap head is no newer than the live one, so the test is never too lax.)
                known = parent
            else:
                self._push_older(parent)
        if known is not None:
            self._push_older(known)
        removed = len(evicted)
        self.num_nodes -= removed
        self.num_unreferenced -= removed
        if removed:
            self.version += 1
        return evicted

    def _push_older(self, parent: Node) -> None:
        """``parent``, unreferenced, became a leaf by eviction: it waits in the heap with its own
        (older) tick."""
        self._serial += 1
        parent.lru_serial = self._serial
        self.num_lru += 1
        heapq.heappush(self.older, (parent.tick, self._serial, parent))

    def release_root(self, root: Root) -> None:
        """A sequence of ``root``'s namespace closed; forget the root once it is unused and empty,
        so per-request namespaces (cache salts) do not pile up."""
        root.ref -= 1
        if root.ref == 0 and root.is_leaf:
            del self.roots[root.namespace]


def _add_child(parent: Node, node: Node) -> None:
    """Make ``node`` a child of ``parent``, which already has one or more (``child`` becomes
    ``children`` at the second)."""
    if parent.children is None:
        only = parent.child
        parent.children = {only.tokens: only, node.tokens: node}
        parent.child = None
    else:
        parent.children[node.tokens] = node


def _remove_child(parent: Node, node: Node) -> None:
    """Remove ``node`` from the two or more children of ``parent`` (back to ``child`` when one
    is left)."""
    children = parent.children
    del children[node.tokens]
    if len(children) == 1:
        (parent.child,) = children.values()
        parent.children = None


def check_key(key: object) -> None:
    """Raise unless ``key``, returned by a caller's hash function, is an int in ``[0, 2**64)``."""
    if type(key) is not int:
        raise TypeError(f"hash_fn must return an int, got {type(key).__name__}")
    if not 0 <= key < _KEY_LIMIT:
        raise ValueError(f"hash_fn must return a key in [0, 2**64), got {key}")

"""The nodes of the block tree (``prefix_cache.cache.block_tree``, whose docstring explains the design):
a node holds a run of cached pages as plain data, a root stands for a namespace, and a walk says
where a prompt's cached prefix ends."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from prefix_cache.cache.hashing import Namespace, namespace_seed

if TYPE_CHECKING:
    from prefix_cache.cache.sequence import Sequence


class Node:
    """A run of cached full pages (or, as ``Root``, a namespace's root, with no pages).

    parent: the node holding the pages before the run, None for a root.
    child: the only node whose parent this is, when there is exactly one; else None.
    children: when there are two or more such nodes, they by their first page's identity bytes
        (``first_identity``); else None.
    root: the root of the node's namespace (a root's is itself).
    pages: page ids of the run in the KV pool, ``array('i')``, at least one; None when the run is
        on the host tier only (see ``prefix_cache.cache.host_tier``: such a node is held by no
        sequence and every node below it is host-only too).
    host: page ids of the run in the host tier's pool, ``array('i')``, or None when the run has no
        host copy (always None without a host tier).
    keys: the pages' chained block keys, one per page: a list of the int objects that the
        namespace's ``index`` holds too, so removing them from it needs no second lookup.
    tokens: the run's token ids, int32 bytes, ``4 * page_size`` per page.
    extras: per page its extra identity bytes (``b""`` for none), or None when no page has any.
    ref: live sequences holding the node (for a root: live sequences in its namespace).
    tick: when the node was last released, for LRU order.
    lru_serial: where it waits as an eviction candidate: 0 in ``BlockTree.recent``, > 0 the serial
        of its entry in ``BlockTree.older``, -1 not a candidate.
    host_serial: the serial of its live entry in the host tier's LRU (``HostTier.heap``), -1 for
        none.
    copies: the holders whose block tables have their own copies of the run (they computed it
        while another sequence cached it first), each with the index of the run's first page in
        its block table; None when there are none. Every other holder's block table has the
        run's pages, and a node with holders always has one such holder (``PageStore`` hands the
        run to a copy when the last one goes), so a cached page is in a live block table or
        evictable.
    """

    __slots__ = (
        "child",
        "children",
        "copies",
        "extras",
        "host",
        "host_serial",
        "keys",
        "lru_serial",
        "pages",
        "parent",
        "ref",
        "root",
        "tick",
        "tokens",
    )

    def __init__(
        self,
        parent: Node | None,
        root: Root | None,
        tokens: bytearray,
        pages: array,
        keys: list[int],
        extras: list[bytes] | None,
    ) -> None:
        self.parent = parent
        self.root = root
        self.child: Node | None = None
        self.children: dict[bytes, Node] | None = None
        self.tokens = tokens
        self.pages: array | None = pages
        self.host: array | None = None
        self.keys = keys
        self.extras = extras
        # A run is cached by the sequence that computed it, which holds it.
        self.ref = 1
        self.tick = 0
        self.lru_serial = -1
        self.host_serial = -1
        self.copies: dict[Sequence, int] | None = None

    @property
    def is_leaf(self) -> bool:
        """No node has this one as its parent (hot paths test the two slots inline)."""
        return self.child is None and self.children is None

    def last_key(self) -> int:
        """The key of the run's last page: the parent key of a page cached after it."""
        return self.keys[-1]

    def identity(self, index: int, page_bytes: int) -> bytes:
        """The identity bytes of page ``index`` of the run: its tokens, then its extra bytes."""
        data = bytes(self.tokens[index * page_bytes : (index + 1) * page_bytes])
        return data + self.extras[index] if self.extras is not None else data

    def first_identity(self, page_bytes: int) -> bytes:
        """The identity bytes of the run's first page: its key among its parent's children."""
        return self.identity(0, page_bytes)


class Root(Node):
    """The root of one namespace: no pages; it knows its namespace and the keys cached in it."""

    __slots__ = ("index", "namespace", "seed")

    def __init__(self, namespace: Namespace) -> None:
        super().__init__(None, None, bytearray(), array("i"), [], None)
        self.root = self
        self.ref = 0
        self.namespace = namespace
        #: The parent key of the namespace's first pages.
        self.seed = namespace_seed(namespace)
        #: Every cached key of this namespace.
        self.index: set[int] = set()

    def last_key(self) -> int:
        return self.seed


class Walk:
    """Where a prompt's longest cached prefix ends: the nodes it passes through (``nodes``, root
    excluded), ``pages`` matched in all, of which ``partial`` in the last node when the prefix
    ends inside its run (0 when it covers the whole run)."""

    __slots__ = ("nodes", "pages", "partial")

    def __init__(self, nodes: list[Node], pages: int, partial: int) -> None:
        self.nodes = nodes
        self.pages = pages
        self.partial = partial

    def last(self, start: Node) -> Node:
        """The deepest node of the prefix, or ``start`` when it is empty."""
        return self.nodes[-1] if self.nodes else start


#: The walk that matches nothing.
NO_WALK = Walk([], 0, 0)


def add_child(parent: Node, node: Node, page_bytes: int) -> None:
    """Make ``node`` a child of ``parent``, which already has one or more (``child`` becomes
    ``children`` at the second)."""
    if parent.children is None:
        only = parent.child
        parent.children = {only.first_identity(page_bytes): only, node.first_identity(page_bytes): node}
        parent.child = None
    else:
        parent.children[node.first_identity(page_bytes)] = node


def remove_child(parent: Node, node: Node, page_bytes: int) -> None:
    """Remove ``node`` from the two or more children of ``parent`` (back to ``child`` when one
    is left)."""
    children = parent.children
    del children[node.first_identity(page_bytes)]
    if len(children) == 1:
        (parent.child,) = children.values()
        parent.children = None

"""The backlog of cache events waiting for ``PrefixCache.drain_events``, capped in events and bytes."""

from __future__ import annotations

import numpy as np

from prefix_cache.cache.block_tree import BlockTree
from prefix_cache.cache.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from prefix_cache.cache.hashing import Namespace
from prefix_cache.cache.tree_nodes import Node

#: ``BlockStored`` and ``BlockRemoved`` events as recorded on the hot path, plain tuples since
#: building the frozen dataclasses costs several times more (once per cached or evicted page in
#: the decode loop at page size 1); ``drain`` builds the events. Stored: ``(block_hashes,
#: parent_block_hash, token_bytes, namespace, extra_keys)``, tokens still as int32 bytes;
#: removed: ``(block_hashes, namespace)``; both on the GPU. The same with the medium last
#: (``"CPU"`` for the host tier): ``(block_hashes, parent_block_hash, token_bytes, namespace,
#: extra_keys, medium)`` and ``(block_hashes, namespace, medium)``. The log keeps ``block_hashes``
#: as a tuple: a backlog of lists would be traversed by every pass of the cyclic garbage collector
#: (inside whichever cache call set it off), while a tuple of ints, bytes and such tuples drops out
#: of its sight at its first pass.
PendingStored = tuple[tuple[int, ...], int | None, bytes, Namespace, list[bytes | None] | None]
PendingStoredOn = tuple[tuple[int, ...], int | None, bytes, Namespace, list[bytes | None] | None, str]
PendingRemoved = tuple[tuple[int, ...], Namespace]
PendingRemovedOn = tuple[tuple[int, ...], Namespace, str]
Pending = KVCacheEvent | PendingStored | PendingStoredOn | PendingRemoved | PendingRemovedOn


class EventLog:
    """Events kept for ``drain_events``, oldest first: at most ``max_events`` of them, holding at
    most ``max_bytes`` of token ids and block hashes (4 bytes a token, 8 a hash: one event of a long
    prefill holds its whole prompt, so a count alone would not bound memory).

    When one more would exceed either cap, the backlog is dropped and nothing is kept until the
    next drain, which describes the cached blocks instead (``AllBlocksCleared``, then
    ``BlockStored`` for every block cached at that moment), so a consumer that applies events in
    order ends up right.
    """

    __slots__ = ("host_published", "max_bytes", "max_events", "num_bytes", "overflowed", "pending")

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.pending: list[Pending] = []
        self.num_bytes = 0  # token and hash bytes held by ``pending``
        #: Set when the backlog overflowed a cap: the next drain resynchronises.
        self.overflowed = False
        #: With a write-through host tier: per host page, whether its copy was published (see
        #: ``prefix_cache.cache.write_through``); None otherwise.
        self.host_published: np.ndarray | None = None

    def emit(self, event: Pending) -> None:
        """Keep ``event``, or note the overflow of a cap."""
        if self.overflowed:
            return
        size = 0
        if type(event) is tuple:  # a stored tuple (5 or 6 long) holds token bytes too
            size = 8 * len(event[0]) + (len(event[2]) if len(event) > 4 else 0)
        pending = self.pending
        if len(pending) < self.max_events and self.num_bytes + size <= self.max_bytes:
            if type(event) is tuple:
                event = (tuple(event[0]), *event[1:])
            pending.append(event)
            self.num_bytes += size
            return
        # Drop the backlog: the next drain describes the cached blocks instead.
        pending.clear()
        self.num_bytes = 0
        self.overflowed = True

    def clear(self) -> None:
        """Drop everything kept and keep ``AllBlocksCleared`` (the cache was reset)."""
        self.pending = [AllBlocksCleared()]
        self.num_bytes = 0
        self.overflowed = False

    def drain(self, tree: BlockTree) -> list[KVCacheEvent]:
        """The events kept since the last drain, oldest first, and forget them. After an overflow:
        ``AllBlocksCleared``, then ``BlockStored`` for every block in ``tree`` now."""
        self.num_bytes = 0
        if self.overflowed:
            self.overflowed = False
            self.pending = []
            return [AllBlocksCleared(), *cached_blocks(tree, self.host_published)]
        events = self.pending
        self.pending = []
        page_size = tree.page_size
        return [
            event
            if type(event) is not tuple
            else BlockRemoved(
                block_hashes=list(event[0]),
                namespace=event[1],
                medium=event[2] if len(event) == 3 else MEDIUM_GPU,
            )
            if len(event) < 5
            else BlockStored(
                block_hashes=list(event[0]),
                parent_block_hash=event[1],
                token_ids=np.frombuffer(event[2], dtype=np.int32).tolist(),
                block_size=page_size,
                namespace=event[3],
                extra_keys=event[4],
                medium=event[5] if len(event) == 6 else MEDIUM_GPU,
            )
            for event in events
        ]


def cached_blocks(tree: BlockTree, published: np.ndarray | None = None) -> list[BlockStored]:
    """``BlockStored`` events for every block in ``tree``, each after its parent's: one per chain of
    runs with single children on one tier. A run held on the host only (``pages`` None; every run
    below it is too) is stored with medium ``"CPU"``, so a chain is cut where it leaves the GPU.

    published: with a write-through host tier, per host page whether its copy is published: the
    host copies (of runs on the host only or on both tiers) are then stored per run, their
    published pages only, after the GPU's blocks."""
    page_size = tree.page_size
    events = []
    for root in tree.roots.values():
        stack: list[Node] = [root]
        while stack:
            node = stack.pop()
            for head in node.children.values() if node.children is not None else [node.child]:
                if head is None:
                    continue
                on_host = head.pages is None
                chain = [head]
                while head.child is not None and (head.child.pages is None) == on_host:
                    head = head.child
                    chain.append(head)
                extras = [
                    (run.extras[i] if run.extras is not None else b"") or None
                    for run in chain
                    for i in range(len(run.keys))
                ]
                tokens = b"".join(bytes(run.tokens) for run in chain)
                if published is None or not on_host:
                    events.append(
                        BlockStored(
                            block_hashes=[key for run in chain for key in run.keys],
                            parent_block_hash=None if node is root else node.keys[-1],
                            token_ids=np.frombuffer(tokens, np.int32).tolist(),
                            block_size=page_size,
                            namespace=root.namespace,
                            extra_keys=extras if any(extras) else None,
                            medium=MEDIUM_CPU if on_host else MEDIUM_GPU,
                        )
                    )
                if head.children is not None or head.child is not None:
                    stack.append(head)
    if published is not None:
        events += host_copies(tree, published)
    return events


def host_copies(tree: BlockTree, published: np.ndarray) -> list[BlockStored]:
    """``BlockStored`` medium ``"CPU"`` for the published host pages of every run, parents first:
    one event per unbroken stretch of them."""
    page_size = tree.page_size
    page_bytes = tree.page_bytes
    events = []
    for node in tree.nodes():
        if node.host is None:
            continue
        shown = published[np.frombuffer(node.host, dtype=np.int32)]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], shown.astype(np.int8), [0])))).tolist()
        for start, end in zip(edges[::2], edges[1::2], strict=True):
            extras = [(node.extras[i] if node.extras is not None else b"") or None for i in range(start, end)]
            parent = node.parent
            first_parent = None if parent is node.root else parent.keys[-1]
            events.append(
                BlockStored(
                    block_hashes=node.keys[start:end],
                    parent_block_hash=node.keys[start - 1] if start else first_parent,
                    token_ids=np.frombuffer(
                        bytes(node.tokens[start * page_bytes : end * page_bytes]), np.int32
                    ).tolist(),
                    block_size=page_size,
                    namespace=node.root.namespace,
                    extra_keys=extras if any(extras) else None,
                    medium=MEDIUM_CPU,
                )
            )
    return events

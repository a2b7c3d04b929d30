"""The host tier's matching and loading (``HostTier`` inherits it): a prompt's runs on the host
after its GPU prefix, the pins of the host pages its loads read, and the runs that take a
sequence's GPU pages once it has them (loaded or computed)."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.events import MEDIUM_CPU
from prefix_cache.cache.page_pool import int_pages
from prefix_cache.cache.tree_nodes import Node, Walk

if TYPE_CHECKING:
    from prefix_cache.cache.sequence import Sequence


class HostLoads:
    """Matching and loading from the host tier: a base of ``HostTier``, whose state it uses."""

    __slots__ = ()

    def walk(self, start: Node, data: bytes, pos: int, num_pages: int, extras: list[bytes] | None) -> Walk:
        """The host-only runs below ``start`` (a node on the GPU or a root) that continue the
        pages of ``data`` from page ``pos`` on (at most ``num_pages`` in all, with per page extra
        identity bytes ``extras`` or None): a ``Walk`` whose ``pages`` counts the pages found on
        the host only. Changes nothing."""
        tree = self.tree
        ready = self.ready
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
            # The first page whose save is not done yet, if any: matched up to there.
            waiting = ready.take(np.frombuffer(child.host, np.int32, same)).tobytes().find(0)
            if waiting >= 0:
                same = waiting
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
        # Distinct pages (one prompt's runs), so one gather and one scatter count each once.
        ids = np.frombuffer(pages, np.int32)
        pins = self.pins
        pins.put(ids, pins.take(ids) + 1)
        self.pinned += len(pages)
        return pages

    def unpin(self, pages: array) -> None:
        """Drop one pin of each of ``pages``; orphans whose last pin goes are free."""
        ids = np.frombuffer(pages, np.int32)
        pins = self.pins
        left = pins.take(ids) - 1
        pins.put(ids, left)
        self.pinned -= len(pages)
        if not self.orphaned:
            return
        freed = ids[(left == 0) & self.orphan.take(ids)]
        if len(freed):
            self.orphan[freed] = False
            self.orphaned -= len(freed)
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
        pages are freed, or, with write-through, kept as the runs' host copies (ready: only ready
        pages are matched). Returns the deepest."""
        tree = self.tree
        nodes = walk.nodes
        if walk.partial:
            nodes = [*nodes[:-1], tree.split(nodes[-1], walk.partial)]
        events = self.events
        keep = self.write_through
        root = seq._root
        table = seq._pages
        # Without write-through, the runs' host pages, released together once they have left.
        released = array("i")
        for node in nodes:
            size = len(node.keys)
            if keep:
                node.pages = int_pages(table[start : start + size])
            else:
                # The run's host page array holds its GPU pages now (one long-lived array kept).
                host = node.host
                released += host
                memoryview(host)[:] = table[start : start + size]
                node.pages = host
                node.host = None
                node.host_serial = -1
                self.num_cached -= size
            start += size
            node.ref = 1
            node.lru_serial = -1
            tree.num_host_nodes -= 1
            tree.num_pages += size
            if events is not None:
                parent = node.parent
                if not keep:
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
        if released:
            self.release_pages(released)
        tree.version += 1
        return nodes[-1]


def event_extras(node: Node) -> list[bytes | None] | None:
    """A run's extra identity bytes as events carry them: per page, None for a page without."""
    return None if node.extras is None else [extra or None for extra in node.extras]

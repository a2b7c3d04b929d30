"""Write-through for the host tier (``PrefixCache(..., write_through=True)``; ``HostTier`` inherits
it): pages get their host copy when they are cached on the GPU, not when the GPU needs them back.

- **Copy on caching**: the pages a commit caches get host pages (the host tier makes room as for
  an eviction) and a save each, queued in the next batch at once. The run is then on both tiers:
  its GPU pages and its ``host`` ids, both of the same length. A run extended in place (the decode
  loop) gets host pages for the new pages too; when the tier cannot give them, or could not give a
  run its copy when it was cached, the run is on the GPU only, as without write-through, and is
  saved if the GPU evicts it (write-back).
- **Free GPU eviction**: evicting a run that has a host copy frees its GPU pages and copies
  nothing; the run is then on the host only. Its save may still be in flight: it was queued (or
  taken) before the pages were freed, so it is in a batch ordered before any kernel that could
  write them (see ``Transfers``), and the copy is matched only once that batch is done (``ready``).
- **Host eviction**: the host tier's LRU holds every run with a host copy and no child with one;
  for a run on both tiers it only drops the host copy (``drop_copy``). Its order is the runs' last
  release, a held run counting as released now (it is in use); an entry older
  than that is pushed again when it comes first. A run moved by write-back makes room only from
  copies released before it.
- **Failures**: a failed batch's saves drop the host copies they were writing; the GPU copies stay.
- **Events**: a write-through copy is published (``BlockStored`` medium ``"CPU"``) when its save's
  batch is done, and ``BlockRemoved`` medium ``"CPU"`` follows only for published pages, so a copy
  that failed or left before it was ready is never announced. ``published`` marks those pages
  (and those of runs moved by write-back, published at the move as without write-through).
"""

from __future__ import annotations

from array import array

import numpy as np

from prefix_cache.cache.events import MEDIUM_CPU
from prefix_cache.cache.host_loads import event_extras
from prefix_cache.cache.tree_nodes import Node

#: A write-through copy waiting for its batch: ``(copy id, host pages, keys, parent key, token
#: bytes, namespace, extras)``, what its ``BlockStored`` needs once the save is done.
Copy = tuple[int, array, list[int], "int | None", bytes, object, "list[bytes | None] | None"]


class WriteThrough:
    """Write-through copies: a base of ``HostTier``, whose state it uses."""

    __slots__ = ()

    def write_through_pages(self, node: Node, count: int) -> None:
        """The last ``count`` pages of ``node``'s run (held by the sequence that cached them)
        were just cached on the GPU: give them host pages and queue their saves. A new run gets a
        copy if the tier can make room; a run extended in place keeps its copy only if the new
        pages get one too (else it drops it), and one without a copy stays without."""
        host = node.host
        size = len(node.pages)
        tree = self.tree
        if host is None:
            if count < size or (len(self.pool.free) < size and not self.make_room(size)):
                return
            new = self.pool.take(size)
            node.host = new
        else:
            # Not a candidate while room is made: its own copy stays.
            node.host_serial = -1
            if len(self.pool.free) < count and not self.make_room(count):
                self.drop_copy(node)
                return
            new = self.pool.take(count)
            host += new
        self.num_cached += count
        ids = np.frombuffer(new, np.int32)
        self.ready.put(ids, False)
        self.writer.put(ids, 0)
        self.save_gpu += node.pages[size - count :]
        self.save_host += new
        self.push(node)
        if self.events is not None:
            self.copy_serial += 1
            self.copy_id[ids] = self.copy_serial
            parent = node.parent
            first = size - count
            root = node.root
            parent_key = node.keys[first - 1] if first else (None if parent is root else parent.keys[-1])
            extras = event_extras(node)
            self.wt_copies.append(
                (
                    self.copy_serial,
                    array("i", new),
                    node.keys[first:],
                    parent_key,
                    bytes(node.tokens[first * tree.page_bytes :]),
                    root.namespace,
                    extras[first:] if extras is not None and any(extras[first:]) else None,
                )
            )

    def drop_copy(self, node: Node) -> None:
        """``node``, on both tiers, loses its host copy (host eviction, or a failed save); it stays
        on the GPU. Its parent may become a host eviction candidate."""
        host = node.host
        node.host = None
        node.host_serial = -1
        self.remove_published(node, host)
        self.release_pages(host)
        self.num_cached -= len(host)
        self.evicted_pages += len(host)
        parent = node.parent
        if parent.host is not None and parent.host_serial < 0 and not has_host_child(parent):
            self.push(parent)
        self.tree.version += 1

    def remove_published(self, node: Node, host: array) -> None:
        """``BlockRemoved`` medium ``"CPU"`` for the pages of ``node`` whose host copies (``host``,
        about to go: those of the run's first ``len(host)`` pages, as a run extended in place has
        its new pages at its end) were published."""
        events = self.events
        if events is None:
            return
        shown = self.published[np.frombuffer(host, dtype=np.int32)]
        copied = node.keys[: len(host)]
        if shown.all():
            events.emit((list(copied), node.root.namespace, MEDIUM_CPU))
        elif shown.any():
            keys = [key for key, on in zip(copied, shown.tolist(), strict=True) if on]
            events.emit((keys, node.root.namespace, MEDIUM_CPU))

    def publish(self, copies: list[Copy]) -> None:
        """The saves of ``copies`` are done: ``BlockStored`` medium ``"CPU"`` for the pages whose
        copy is still theirs (not dropped, not reused since), one event per unbroken stretch."""
        events = self.events
        copy_id = self.copy_id
        page_bytes = self.tree.page_bytes
        for serial, host, keys, parent_key, tokens, namespace, extras in copies:
            ids = np.frombuffer(host, dtype=np.int32)
            mine = copy_id[ids] == serial
            if not mine.any():
                continue
            self.published[ids[mine]] = True
            for start, end in stretches(mine):
                events.emit(
                    (
                        keys[start:end],
                        parent_key if start == 0 else keys[start - 1],
                        tokens[start * page_bytes : end * page_bytes],
                        namespace,
                        extras[start:end] if extras is not None and any(extras[start:end]) else None,
                        MEDIUM_CPU,
                    )
                )


def stretches(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each run of True in ``mask``."""
    if mask.all():
        return [(0, len(mask))]
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def has_host_child(node: Node) -> bool:
    """Whether a node below ``node`` has a host copy (is on the host tier, only or too)."""
    child = node.child
    if child is not None:
        return child.host is not None
    children = node.children
    return children is not None and any(kid.host is not None for kid in children.values())

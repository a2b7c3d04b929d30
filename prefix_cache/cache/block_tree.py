"""The block tree: cached full pages in runs, reference counts and LRU eviction.

Each namespace has a root. The tree is path-compressed (a radix tree over pages): a node holds a
run of one or more cached full pages that follow each other in a prompt, and its parent holds the
pages before them. A node keeps its run as plain data: the page ids (``array('i')``), the chained
block keys, the run's token ids as one ``bytearray`` of int32, and the pages'
extra identity bytes when a prompt carried extra keys. A prompt is matched by walking down from
its namespace's root: a child is found by its first page's identity bytes (``Node.child`` when
there is one child, a dict keyed by those bytes when there are several), and the whole run is
then confirmed with one bytes comparison, so a walk costs per node, not per page. A hit is always
the exact tokens after the exact parent, and a namespace only ever reaches its own root's pages;
no block hash is computed on the walk.

Runs split where prompts diverge, always at a page boundary: when a match (or a sequence's own
pages, computed at the same time as another's) ends inside a run, the run is cut there. The node
object keeps the tail (with its children, its LRU entry and its tick) and a new node takes the
head in its place under the parent, so nothing that points at the node (sequences, the LRU, the
parent's child slot) has to change. Every live sequence therefore holds whole nodes: the pages
of a node always have the same holders, reference counts are per node, and locking, releasing
and stamping a path cost per node. A sequence remembers only the deepest node it holds; its path
is the parent chain above it. A sequence that fills a page at the end of a leaf only it holds
(``ref == 1``, the decode loop) appends the page to that run in place instead of making a node.

Every page also has a key, the chained block hash of ``prefix_cache.cache.hashing``: the identity that
events publish. Each root's ``index`` is the set of its namespace's keys, so keys stay unique
within a namespace; a block whose key is taken there (a hash collision) is simply not cached. The
index is per namespace because namespace seeds are public: a tenant who crafts colliding blocks
can only stop its own blocks from being cached, never another tenant's.

A node's ``ref`` is the number of live sequences holding it, and a node with ``ref == 0`` has
only ``ref == 0`` descendants: all unreferenced pages can be evicted, deepest first.

Eviction order is least recently released first (by ``Node.tick``, stamped at release), among
unreferenced leaves, and it takes pages from the end of a leaf's run: a leaf whose run is only
partly evicted keeps its place (its remaining pages are as old), one whose run is gone leaves the
tree. A leaf that becomes a candidate when a sequence releases it has the newest tick, so those
leaves sit in an ordered dict in tick order: O(1) to add, remove or pop the oldest. A parent that
becomes a leaf because its last child was evicted keeps its own, older tick, so it goes into a
small heap keyed by ``(tick, serial)`` rather than at either end of the dict; the next victim is
the older of the two heads. Heap entries of parents that were acquired again are skipped when
popped (``Node.lru_serial`` names the live entry) and dropped when they outnumber the live ones.
Every operation is O(1) or O(log n) amortised per node or per evicted page; nothing ever scans
the pool. Only leaves are candidates, so on a cached path only the last node can be one.
"""

from __future__ import annotations

import heapq
import struct
from array import array
from collections import OrderedDict

import numpy as np

from prefix_cache.cache.hashing import HashFn, Namespace, default_hash_fn
from prefix_cache.cache.tree_nodes import Node, Root, Walk, add_child, remove_child

_KEY_LIMIT = 2**64
# Pages per chunk that ``page_keys`` splits a long chain into.
_CHUNK_PAGES = 64
# Rebuild the heap when it holds more than this many entries beyond twice the live ones.
_HEAP_SLACK = 1024


class BlockTree:
    """Cached pages of all namespaces, with reference counts and the LRU of evictable leaves.

    The tree never allocates or frees pages itself: ``add``, ``extend`` and ``append_page`` take
    pages the caller owns and ``evict`` hands the evicted pages back to the caller. Its counters
    (``num_pages``, ``num_unreferenced``, ``version``) change only in its own methods.
    """

    def __init__(self, hash_fn: HashFn, page_size: int) -> None:
        self.hash_fn = hash_fn
        #: Keys from a caller's hash function are checked; the default's need not be.
        self.check_keys = hash_fn is not default_hash_fn
        self.page_size = page_size
        self.page_bytes = 4 * page_size
        # Splits token bytes into pages in C: cheaper per page than slicing in a Python loop; a
        # chunk of pages at once saves a 1-tuple per page (2 of 10 µs for 136 one-token pages).
        self._page_struct = struct.Struct(f"{self.page_bytes}s")
        self._chunk_struct = struct.Struct(f"{self.page_bytes}s" * _CHUNK_PAGES)
        self._chunk_bytes = self.page_bytes * _CHUNK_PAGES
        self.roots: dict[Namespace, Root] = {}
        #: Bumped whenever a node is added, removed, split or extended, so a walk can be reused
        #: while the tree is unchanged.
        self.version = 0
        #: Cached pages in the tree.
        self.num_pages = 0
        #: Cached pages in nodes with ``ref == 0``: all of them can be evicted, deepest first.
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
        #: Nodes on the host tier only (``pages is None``): 0 without a host tier, which keeps
        #: the tier's checks off the paths of a cache without one.
        self.num_host_nodes = 0

    def nodes(self) -> list[Node]:
        """Every node of every namespace, parents first (for checks and snapshots, not the hot
        path)."""
        found: list[Node] = []
        for root in self.roots.values():
            stack: list[Node] = [root]
            while stack:
                node = stack.pop()
                kids = list(node.children.values()) if node.children is not None else [node.child]
                for kid in kids:
                    if kid is not None:
                        found.append(kid)
                        stack.append(kid)
        return found

    def root(self, namespace: Namespace) -> Root:
        """The root of ``namespace``, created when missing. ``namespace`` must be valid."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Root(namespace)
        return root

    # ------------------------------------------------------------------ matching

    def walk(self, start: Node, data: bytes, num_pages: int, extras: list[bytes] | None) -> Walk:
        """The longest cached prefix, below ``start``, of the pages in ``data``: at most
        ``num_pages`` pages of ``4 * page_size`` token bytes, with per page extra identity bytes
        ``extras`` (None when no page has any). Changes nothing."""
        pb = self.page_bytes
        nodes: list[Node] = []
        node = start
        pos = 0
        while pos < num_pages:
            child = node.child
            if child is None:
                child = self.child_among(node, data, pos, extras)
                if child is None:
                    break
            pages = child.pages
            if pages is None:
                # A run on the host tier only: the GPU prefix ends here.
                break
            end = pos + len(pages)
            # The common case: the whole run in one comparison.
            if (
                end <= num_pages
                and extras is None
                and child.extras is None
                and child.tokens == data[pos * pb : end * pb]
            ):
                nodes.append(child)
                pos = end
                node = child
                continue
            same = self._common_pages(child, data, pos, num_pages, extras)
            if same:
                nodes.append(child)
                if same < len(child.pages):
                    return Walk(nodes, pos + same, same)
                pos += same
                node = child
                continue
            break
        return Walk(nodes, pos, 0)

    def child_among(self, node: Node, data: bytes, pos: int, extras: list[bytes] | None) -> Node | None:
        """The child of ``node`` (which has none in ``child``) whose run starts with page ``pos`` of
        ``data`` (with its extra identity bytes), None when there is none."""
        children = node.children
        if children is None:
            return None
        pb = self.page_bytes
        ident = data[pos * pb : (pos + 1) * pb]
        if extras is not None:
            ident += extras[pos]
        return children.get(ident)

    def _common_pages(
        self, node: Node, data: bytes, pos: int, num_pages: int, extras: list[bytes] | None
    ) -> int:
        """How many leading pages of ``node``'s run equal pages ``pos, pos + 1, ...`` of ``data``
        (at most ``num_pages - pos``)."""
        pb = self.page_bytes
        count = min(len(node.keys), num_pages - pos)
        tokens = node.tokens
        if extras is None and node.extras is None:
            if tokens.startswith(data[pos * pb : (pos + count) * pb]):
                return count
            # The first differing token, found in C.
            ps = self.page_size
            stored = np.frombuffer(tokens, np.int32, count * ps)
            given = np.frombuffer(data, np.int32, count * ps, pos * pb)
            return int(np.flatnonzero(stored != given)[0]) // ps
        node_extras = node.extras
        for i in range(count):
            if tokens[i * pb : (i + 1) * pb] != data[(pos + i) * pb : (pos + i + 1) * pb]:
                return i
            if (node_extras[i] if node_extras is not None else b"") != (
                extras[pos + i] if extras is not None else b""
            ):
                return i
        return count

    def hold(self, walk: Walk, table: memoryview | None) -> Node:
        """Take one reference on each node of ``walk`` (not empty) for a live sequence,
        splitting the last one first when the prefix ends inside its run, and write their page
        ids to ``table[: walk.pages]`` (a block table as C ints, see ``Sequence._pages_int``)
        unless ``table`` is None. Returns the deepest node held."""
        nodes = walk.nodes
        if walk.partial:
            nodes = [*nodes[:-1], self.split(nodes[-1], walk.partial)]
        newly = 0
        pos = 0
        for node in nodes:
            ref = node.ref
            pages = node.pages
            if not ref:
                newly += len(pages)
            node.ref = ref + 1
            if table is not None:
                end = pos + len(pages)
                table[pos:end] = pages
                pos = end
        last = nodes[-1]
        if newly:
            self.num_unreferenced -= newly
            # Every other node of the path has a child, so only the last can be a candidate.
            if last.lru_serial >= 0:
                self.unlist(last)
        return last

    def split(self, node: Node, count: int) -> Node:
        """Cut ``node``'s run after its first ``count`` pages (``0 < count < len(node.pages)``):
        a new node takes them, in ``node``'s place under its parent, and ``node`` keeps the rest,
        its children, tick and LRU entry, as the new node's only child. Returns the new node."""
        cut = count * self.page_bytes
        tokens = node.tokens
        pages = node.pages
        head = Node(
            node.parent,
            node.root,
            tokens[:cut],
            None if pages is None else pages[:count],
            node.keys[:count],
            None,
        )
        del tokens[:cut]
        if pages is not None:
            del pages[:count]
        else:
            self.num_host_nodes += 1
        host = node.host
        if host is not None:
            head.host = host[:count]
            del host[:count]
        del node.keys[:count]
        extras = node.extras
        if extras is not None:
            head.extras = extras[:count] if any(extras[:count]) else None
            node.extras = extras[count:] if any(extras[count:]) else None
        # The head is acquired next (its tick is stamped when released).
        head.ref = node.ref
        copies = node.copies
        if copies is not None:
            # The same holders keep their own copies of both parts.
            head.copies = dict(copies)
            node.copies = {seq: start + count for seq, start in copies.items()}
        head.child = node
        parent = node.parent
        if parent.child is node:
            parent.child = head
        else:
            # Same first page, same key in the parent's children.
            parent.children[head.first_identity(self.page_bytes)] = head
        node.parent = head
        self.version += 1
        return head

    # ------------------------------------------------------------------ references

    def unlist(self, node: Node) -> None:
        """``node``, an eviction candidate, is acquired: it is not a candidate any more."""
        if node.lru_serial == 0:
            del self.recent[node]
        # else its heap entry goes stale and is skipped when popped.
        node.lru_serial = -1
        self.num_lru -= 1

    def release(self, node: Node, root: Root) -> list[Node] | None:
        """Drop one reference on ``node`` and every node above it up to ``root`` (a sequence's
        path), stamping them as used now. Returns the nodes left held only by sequences with
        their own copies (see ``Node.copies``; the releasing sequence must be in none of them),
        or None when there are none."""
        self.tick += 1
        tick = self.tick
        freed = 0
        orphans = None
        while node is not root:
            node.tick = tick
            ref = node.ref - 1
            node.ref = ref
            if ref:
                copies = node.copies
                if copies is not None and ref == len(copies):
                    if orphans is None:
                        orphans = [node]
                    else:
                        orphans.append(node)
            else:
                freed += len(node.pages)
                if (node.child is None and node.children is None) or (
                    self.num_host_nodes and not has_gpu_child(node)
                ):
                    # The newest tick: its place is the young end of ``recent``.
                    self.recent[node] = None
                    node.lru_serial = 0
                    self.num_lru += 1
            node = node.parent
        self.num_unreferenced += freed
        older = self.older
        if len(older) > 2 * (self.num_lru - len(self.recent)) + _HEAP_SLACK:
            # Stale entries (of parents acquired again) outnumber live ones: drop them.
            self.older = [entry for entry in older if entry[2].lru_serial == entry[1]]
            heapq.heapify(self.older)
        return orphans

    # ------------------------------------------------------------------ caching pages

    def page_keys(self, key: int, data: bytes, extras: list[bytes] | None) -> list[int]:
        """The chained keys of pages (``data``: their token bytes, ``extras``: their extra identity
        bytes or None) after the page with key ``key`` (the namespace seed for a prompt's first
        page). Changes nothing, so a hash function that raises or returns a bad key leaves the
        tree as it was.

        Raises TypeError or ValueError when the hash function returns something other than an
        int in ``[0, 2**64)``; whatever the hash function itself raises propagates.
        """
        hash_fn = self.hash_fn
        if extras is None and not self.check_keys:
            # The common case, one page per iteration and nothing else: each key seeds the next.
            # Whole chunks of pages come out of one unpack as a flat tuple, the rest one by one.
            size = len(data)
            if size < self._chunk_bytes:
                return [key := hash_fn(page, key) for (page,) in self._page_struct.iter_unpack(data)]
            split = size - size % self._chunk_bytes
            keys = [
                key := hash_fn(page, key)
                for chunk in self._chunk_struct.iter_unpack(data[:split])
                for page in chunk
            ]
            if split < size:
                keys += [key := hash_fn(page, key) for (page,) in self._page_struct.iter_unpack(data[split:])]
            return keys
        pb = self.page_bytes
        keys: list[int] = []
        for i, start in enumerate(range(0, len(data), pb)):
            chunk = data[start : start + pb]
            if extras is not None:
                chunk += extras[i]
            key = hash_fn(chunk, key)
            if self.check_keys:
                check_key(key)
            keys.append(key)
        return keys

    def claim_keys(self, root: Root, keys: list[int]) -> None:
        """Enter ``keys`` (from ``page_keys``, of pages about to be cached as a chain by ``add`` or
        ``extend``) in ``root``'s key index, first cutting ``keys`` in place before the first one
        already taken in the namespace or repeated in the chain (a hash collision: keys name
        blocks in events, so they stay unique)."""
        index = root.index
        if not index.isdisjoint(keys):
            # A key is taken in the namespace: stop before it.
            del keys[next(i for i, key in enumerate(keys) if key in index) :]
        size = len(index)
        index.update(keys)
        if len(index) - size < len(keys):
            # A key repeats within the chain (a weak hash function): stop before its second use.
            # None was in the index before, so removing them all restores it.
            index.difference_update(keys)
            seen: set[int] = set()
            for i, key in enumerate(keys):
                if key in seen:
                    del keys[i:]
                    break
                seen.add(key)
            index.update(keys)

    def add(
        self, parent: Node, data: bytes, pages: array, keys: list[int], extras: list[bytes] | None
    ) -> Node:
        """Cache ``pages`` (token bytes ``data``, extra bytes ``extras`` or None, keys ``keys``
        claimed by ``claim_keys``) as a new leaf run below ``parent``, held once by the caller.

        parent: held or a root, without a child whose run starts with the first page (so no
            later page can have a cached twin either: its parent is new).
        """
        root = parent.root
        # The node's own list: it grows when the run is extended.
        extras = list(extras) if extras is not None and any(extras) else None
        # Its own list of keys too: the caller's goes into an event.
        node = Node(parent, root, bytearray(data), pages, list(keys), extras)
        if parent.child is None and parent.children is None:
            parent.child = node
        else:
            add_child(parent, node, self.page_bytes)
        self.num_pages += len(keys)
        self.version += 1
        return node

    def extend(
        self, leaf: Node, data: bytes, pages: array, keys: list[int], extras: list[bytes] | None
    ) -> None:
        """Append ``pages`` to ``leaf``'s run in place (same arguments as ``add``).

        leaf: a leaf that only the caller's sequence holds (``ref == 1``), not a root.
        """
        leaf.tokens += data
        leaf.pages += pages
        leaf.keys.extend(keys)
        if leaf.extras is not None:
            leaf.extras += extras if extras is not None else [b""] * len(keys)
        elif extras is not None and any(extras):
            leaf.extras = [b""] * (len(leaf.pages) - len(keys)) + extras
        self.num_pages += len(keys)
        self.version += 1

    def append_page(self, leaf: Node, data: bytes, page: int, key: int) -> bool:
        """``claim_keys`` and ``extend`` for one page (token bytes ``data``, page id ``page``, key
        ``key`` from ``page_keys``): the decode loop's case. Returns False, changing nothing, when
        ``key`` is already taken in the namespace (a hash collision: the page is not cached).

        leaf: a leaf that only the caller's sequence holds (``ref == 1``), not a root, without
            extra identity bytes (``extras is None``); the page gets none either.
        """
        index = leaf.root.index
        # One set operation: adding a key the index holds changes nothing.
        size = len(index)
        index.add(key)
        if len(index) == size:
            return False
        leaf.tokens += data
        leaf.pages.append(page)
        leaf.keys.append(key)
        self.num_pages += 1
        self.version += 1
        return True

    # ------------------------------------------------------------------ eviction

    def evict(self, count: int) -> list[tuple[Root, array, list[int]]]:
        """Remove up to ``count`` pages from the tree, from the end of the least recently released
        unreferenced leaf's run first, and return them as ``(root, pages, keys)`` per run they
        came from (``pages`` an ``array('i')``), deepest page first (the pages are the caller's
        again). A leaf whose run is
        gone can make its parent a candidate, so a whole unreferenced path can go in one call."""
        recent = self.recent
        older = self.older
        heappop = heapq.heappop
        pb = self.page_bytes
        evicted: list[tuple[Root, array, list[int]]] = []
        removed = 0
        # The next victim when it is already known: a parent just orphaned by eviction that is
        # older than every candidate. A cold path then goes leaf to root without heap traffic.
        known: Node | None = None
        while removed < count:
            if known is not None:
                node = known
                known = None
                listed = False
            else:
                while older and older[0][2].lru_serial != older[0][1]:
                    heappop(older)  # stale: the parent was acquired again after it was pushed
                if recent:
                    node = next(iter(recent))
                    if older and older[0][0] < node.tick:
                        node = older[0][2]
                elif older:
                    node = older[0][2]
                else:
                    break
                listed = True
            root = node.root
            size = len(node.pages)
            want = count - removed
            if want < size:
                # Part of the run: its end goes, the rest keeps its place in the LRU.
                keep = size - want
                pages = node.pages[keep:]
                keys = node.keys[keep:]
                del node.pages[keep:]
                del node.keys[keep:]
                del node.tokens[keep * pb :]
                if node.extras is not None:
                    del node.extras[keep:]
                    if not any(node.extras):
                        node.extras = None
                pages.reverse()
                keys.reverse()
                root.index.difference_update(keys)
                evicted.append((root, pages, keys))
                removed += want
                if not listed:
                    self.push_older(node)
                break
            if listed:
                if node.lru_serial == 0:
                    del recent[node]
                else:
                    heappop(older)
                node.lru_serial = -1
                self.num_lru -= 1
            pages = node.pages
            keys = node.keys
            pages.reverse()
            keys.reverse()
            root.index.difference_update(keys)
            evicted.append((root, pages, keys))
            removed += size
            parent = node.parent
            if parent.child is not node:
                remove_child(parent, node, pb)
                continue
            parent.child = None
            if parent.ref:
                continue
            if parent is root:
                del self.roots[root.namespace]
            elif (
                removed < count
                and (not recent or parent.tick < next(iter(recent)).tick)
                and (not older or parent.tick < older[0][0])
            ):
                # Taken next anyway: ties go to ``recent`` and to older heap entries. (A stale
                # heap head is no newer than the live one, so the test is never too lax.)
                known = parent
            else:
                self.push_older(parent)
        if known is not None:
            self.push_older(known)
        self.num_pages -= removed
        self.num_unreferenced -= removed
        if removed:
            self.version += 1
        return evicted

    def oldest(self) -> Node | None:
        """The least recently released eviction candidate (an unreferenced node with no child on
        the GPU), None when there is none. Changes nothing but dropping stale heap entries."""
        older = self.older
        while older and older[0][2].lru_serial != older[0][1]:
            heapq.heappop(older)  # stale: the parent was acquired again after it was pushed
        recent = self.recent
        if recent:
            node = next(iter(recent))
            if older and older[0][0] < node.tick:
                return older[0][2]
            return node
        return older[0][2] if older else None

    def push_older(self, parent: Node) -> None:
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


def has_gpu_child(node: Node) -> bool:
    """Whether a node below ``node`` has its run on the GPU (not on the host tier only)."""
    child = node.child
    if child is not None:
        return child.pages is not None
    children = node.children
    return children is not None and any(kid.pages is not None for kid in children.values())


def check_key(key: object) -> None:
    """Raise unless ``key``, returned by a caller's hash function, is an int in ``[0, 2**64)``."""
    if type(key) is not int:
        raise TypeError(f"hash_fn must return an int, got {type(key).__name__}")
    if not 0 <= key < _KEY_LIMIT:
        raise ValueError(f"hash_fn must return a key in [0, 2**64), got {key}")

"""Helpers shared by the cache tests: a full snapshot of a cache's bookkeeping, and an independent
computation of block keys."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
from xxhash import xxh3_64_intdigest

from prefix_cache.cache.hashing import Namespace, namespace_seed
from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.cache.sequence import Sequence
from prefix_cache.cache.tree_nodes import Node


def snapshot(cache: PrefixCache) -> tuple:
    """Everything the cache's behaviour depends on, as comparable plain data (after the pages the
    decode path deferred are cached, as any call that reads the tree does first)."""
    assert cache.num_cached_pages >= 0  # caches the deferred pages
    tree = cache._tree
    nodes = sorted(
        (
            repr(n.root.namespace),
            tuple(n.keys),
            n.parent.last_key(),
            tuple(n.pages),
            bytes(n.tokens),
            n.extras,
            n.ref,
            n.tick,
            n.lru_serial,
            child_keys(n),
            sorted((seq._id, start) for seq, start in (n.copies or {}).items()),
        )
        for n in tree.nodes()
    )
    roots = sorted((repr(ns), r.ref, child_keys(r), sorted(r.index)) for ns, r in tree.roots.items())
    heap = [(tick, serial, tuple(node.keys)) for tick, serial, node in tree.older]
    recent = [(tuple(node.keys), node.tick) for node in tree.recent]
    seqs = sorted(
        (
            s._id,
            s._num_tokens,
            s._num_allocated,
            s._capacity,
            s._num_pages,
            s.block_table.tobytes(),
            s.tokens.tobytes(),
            tuple(held_keys(s)),
            s._num_held,
            s._num_full_pages,
            s._broken,
            tuple(s._dups),
        )
        for s in cache._live
    )
    counters = (tree.num_pages, tree.num_unreferenced, tree.num_lru, tree.tick, tree.version)
    return (
        list(cache._pool.free),
        nodes,
        roots,
        recent,
        heap,
        seqs,
        counters,
        cache.stats,
        len(cache._events.pending) if cache._events is not None else 0,
        cache._events.overflowed if cache._events is not None else False,
    )


def held_keys(seq: Sequence) -> list[int]:
    """The keys of the cached pages a live sequence holds, in order (its path of runs)."""
    keys: list[int] = []
    node = seq._node
    while node is not seq._root:
        keys[:0] = node.keys
        node = node.parent
    return keys


def held_nodes(seq: Sequence) -> list[Node]:
    """The nodes a live sequence holds, root side first."""
    nodes: list[Node] = []
    node = seq._node
    while node is not seq._root:
        nodes.insert(0, node)
        node = node.parent
    return nodes


def held_pages(seq: Sequence) -> list[int]:
    """The cached page ids of the runs a live sequence holds (its own copies are in its block
    table instead)."""
    return [page for node in held_nodes(seq) for page in node.pages]


def child_keys(node: Node) -> list[tuple[bytes, tuple[int, ...]]] | None:
    """A node's children as (bytes, keys) pairs, None when it has none: an only child with its
    whole run's token bytes, two or more each with its first page's identity bytes (its key in
    ``children``)."""
    if node.child is not None:
        return [(bytes(node.child.tokens), tuple(node.child.keys))]
    if node.children is None:
        return None
    return sorted((tokens, tuple(child.keys)) for tokens, child in node.children.items())


def chain_keys(tokens: Seq[int], page_size: int, namespace: Namespace = None) -> list[int]:
    """The keys of the full pages of ``tokens``, computed without the library's tree."""
    keys = []
    parent = namespace_seed(namespace)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[start : start + page_size], dtype=np.int32).tobytes()
        parent = xxh3_64_intdigest(page, parent)
        keys.append(parent)
    return keys


def run_prompt(cache: PrefixCache, prompt, namespace=None, close: bool = True) -> Sequence:
    """Open, allocate and commit a whole prompt, the way an engine admits a request."""
    seq = cache.open(prompt, namespace)
    cached = seq.num_cached_tokens
    cache.allocate(seq, len(prompt) - cached)
    cache.commit(seq, list(prompt[cached:]))
    if close:
        cache.close(seq)
    cache.check_invariants()
    return seq

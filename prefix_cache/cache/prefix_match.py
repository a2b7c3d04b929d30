"""``PrefixCache``'s matching of a prompt against the block tree: ``match``, and the walk that
``open``, ``admit`` and ``match_tiers`` share, with its memo of the last walk (``_last_match``).
``PrefixCache`` inherits them; they use its lock and tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefix_cache.cache.hashing import ExtraKey, Namespace, check_namespace, page_extras
from prefix_cache.cache.tokens import as_token_array
from prefix_cache.cache.tree_nodes import NO_WALK

if TYPE_CHECKING:
    import numpy as np

    from prefix_cache.cache.tree_nodes import Root, Walk


class PrefixMatch:
    """The prefix matching of ``PrefixCache`` (a base class: it has no state of its own)."""

    def match(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> int:
        """Length in tokens of the cached prefix ``open(tokens, namespace, extra_keys=...)`` would
        lock now: whole pages, at most ``len(tokens) - 1``. Changes nothing (LRU order and
        statistics included)."""
        arr = as_token_array(tokens)
        check_namespace(namespace)
        extras = page_extras(extra_keys, len(arr), self._page_size)
        self._enter()
        try:
            return self._prefix_walk(arr, namespace, extras).pages * self._page_size
        finally:
            self._baton.append(None)

    def _prefix_walk(self, arr: np.ndarray, namespace: Namespace, extras: dict[int, bytes]) -> Walk:
        """``_walk`` from ``namespace``'s root, ``NO_WALK`` when the namespace has none."""
        root = self._tree.roots.get(namespace)
        return NO_WALK if root is None else self._walk(root, arr, extras)

    def _walk(self, root: Root, arr: np.ndarray, extras: dict[int, bytes]) -> Walk:
        """The longest cached prefix of ``arr`` (with the pages' ``extras``) under ``root``,
        never covering the last token (the engine needs its logits). Changes nothing."""
        page_size = self._page_size
        if root.is_leaf or len(arr) <= page_size:
            return NO_WALK
        tree = self._tree
        store = self._store
        num_pages = (len(arr) - 1) // page_size
        data = arr.tobytes()
        if extras:
            page_extras = [extras.get(i, b"") for i in range(num_pages)]
            walk = tree.walk(root, data, num_pages, page_extras)
            if store.pending and store.flush_walk_end(walk):
                walk = tree.walk(root, data, num_pages, page_extras)
            return walk
        # Engines call match and then open with the same prompt: reuse the walk while the tree
        # is unchanged (one memcmp of the prompt instead of a walk).
        last = self._last_match
        if last is not None and last[0] is root and last[1] == tree.version and last[2] == data:
            walk = last[3]
        else:
            walk = tree.walk(root, data, num_pages, None)
        # A run whose sequence's decoded pages wait (see PageStore.defer_page) may continue.
        if store.pending and store.flush_walk_end(walk):
            walk = tree.walk(root, data, num_pages, None)
        self._last_match = (root, tree.version, data, walk)
        return walk

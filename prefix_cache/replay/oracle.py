"""The best possible prefix hits: what a cache that never evicts would have returned.

Replaying the same sequence of opens and commits through :class:`UnlimitedPrefixIndex` gives the
hit count of a cache with unlimited pages, exactly: pages are keyed by (parent page, page bytes), so
equal keys mean equal token prefixes, with no hash collisions to reason about. It is independent of
:mod:`prefix_cache.cache.prefix_cache` on purpose, so that it can check it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from prefix_cache.replay.conversation import Conversation

ROOT = 0


class UnlimitedPrefixIndex:
    """Every full page ever committed, as a trie of page ids; never forgets."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._children: dict[tuple[int, bytes], int] = {}

    @property
    def num_pages(self) -> int:
        """Distinct pages stored."""
        return len(self._children)

    def match(self, tokens: np.ndarray) -> tuple[int, int]:
        """Cached tokens for a prompt (full pages, at most ``len(tokens) - 1``) and the last page's id.

        The cap mirrors a cache's: at least one prompt token must be computed to get logits.
        """
        ps = self.page_size
        node = ROOT
        hit = 0
        for start in range(0, len(tokens) - 1 - ps + 1, ps):
            child = self._children.get((node, tokens[start : start + ps].tobytes()))
            if child is None:
                break
            node = child
            hit = start + ps
        return hit, node

    def extend(self, node: int, page: np.ndarray) -> int:
        """Store the full page ``page`` after page ``node`` (``ROOT`` for the first); its id."""
        key = (node, page.tobytes())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = len(self._children) + 1
        return child

    def extend_all(self, node: int, tokens: np.ndarray, start: int) -> int:
        """Store the full pages of ``tokens`` from token ``start`` (a page boundary) after ``node``."""
        ps = self.page_size
        for begin in range(start, len(tokens) - ps + 1, ps):
            node = self.extend(node, tokens[begin : begin + ps])
        return node


def working_set_pages(conversations: Iterable[Conversation], page_size: int) -> int:
    """The workload's working set, in pages of ``page_size`` tokens: the distinct full pages of
    every request's prompt and reply (every sample's), that is the pages a cache that never evicts
    holds at the end of a replay in which no request was skipped or cut. It depends on the workload
    alone, not on the pool or the request order."""
    index = UnlimitedPrefixIndex(page_size)
    for conv in conversations:
        context = conv.prefix
        for turn in conv.turns:
            prompt = np.concatenate([context, turn.user])
            node = index.extend_all(ROOT, prompt, 0)
            start = len(prompt) // page_size * page_size
            for reply in turn.replies:
                index.extend_all(node, np.concatenate([prompt[start:], reply]), 0)
            context = np.concatenate([prompt, turn.replies[0]])
    return index.num_pages

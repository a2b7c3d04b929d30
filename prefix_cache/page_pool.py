"""The free pages of the KV pool: a stack of page ids."""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """Page ids ``0 .. num_pages - 1`` that hold nothing, as a LIFO stack (a recently freed page is
    reused first). The pool only counts; which pages are cached or held is the cache's business."""

    __slots__ = ("free", "num_pages")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Reversed, so a fresh pool hands out pages 0, 1, 2, ... in order.
        self.free: list[int] = list(range(num_pages - 1, -1, -1))

    def take(self, count: int) -> list[int]:
        """Pop ``count`` (at most ``len(self.free)``) page ids, in pop order."""
        if count <= 0:
            # ``del free[-0:]`` would empty the whole list.
            return []
        pages = self.free[: -count - 1 : -1]
        del self.free[-count:]
        return pages

    def put_many(self, pages: Iterable[int]) -> None:
        """Return page ids."""
        self.free.extend(pages)

"""The free pages of the KV pool: a stack of page ids."""

from __future__ import annotations

from array import array

import numpy as np


class PagePool:
    """Page ids ``0 .. num_pages - 1`` that hold nothing, as a LIFO stack (a recently freed page is
    reused first). The pool only counts; which pages are cached or held is the cache's business.

    The stack is an ``array('i')``, like the tree's runs and the sequences' int32 block tables, so
    pages move between them as machine ints (one copy, no Python int per page) and the garbage
    collector has no list of a whole pool's ints to traverse.
    """

    __slots__ = ("free", "num_pages")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Reversed, so a fresh pool hands out pages 0, 1, 2, ... in order.
        self.free = array("i", np.arange(num_pages - 1, -1, -1, dtype=np.int32).tobytes())

    def take(self, count: int) -> array:
        """Pop ``count`` (at most ``len(self.free)``) page ids, in pop order."""
        if count <= 0:
            # ``del free[-0:]`` would empty the whole array.
            return array("i")
        pages = self.free[: -count - 1 : -1]
        del self.free[-count:]
        return pages

    def put_many(self, pages: list[int] | array) -> None:
        """Return page ids."""
        self.free.extend(pages)

    def put_table(self, pages: np.ndarray) -> None:
        """Return the page ids of a slice of an int32 block table."""
        self.free.frombytes(pages.tobytes())


def int_pages(table: np.ndarray) -> array:
    """A slice of an int32 block table as the tree's ``array('i')`` of page ids."""
    pages = array("i")
    pages.frombytes(table.tobytes())
    return pages

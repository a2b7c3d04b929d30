"""The errors the cache raises for conditions other than bad arguments (those are ``ValueError`` /
``TypeError`` naming the argument)."""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of the errors this library raises for conditions other than bad arguments."""


class OutOfPages(PrefixCacheError):
    """``allocate`` needs more pages than are free plus evictable. Nothing was changed."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(
            f"need {needed} pages but only {available} are free or evictable "
            "(the rest are held by live sequences)"
        )
        self.needed = needed
        self.available = available


class InvariantError(PrefixCacheError):
    """``check_invariants`` found the bookkeeping inconsistent."""


class ConcurrentUseError(PrefixCacheError):
    """A second thread called into a cache while another was inside it. Nothing was changed."""

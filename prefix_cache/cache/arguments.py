"""Checks of ``PrefixCache`` arguments: each raises an exception naming the argument and the problem.

Tokens, namespaces and extra keys are checked where they are interpreted
(``prefix_cache.cache.tokens``, ``prefix_cache.cache.hashing``).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from prefix_cache.cache.block_tree import check_key
from prefix_cache.cache.hashing import namespace_seed
from prefix_cache.cache.sequence import Sequence

if TYPE_CHECKING:
    from prefix_cache.cache.prefix_cache import PrefixCache


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; TypeError for non-integers (bools included)."""
    if isinstance(value, (bool, float, complex)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {number}")
    return number


def check_hash_fn(hash_fn: object, page_size: int) -> None:
    """Raise TypeError unless ``hash_fn`` takes (page bytes, parent key) and returns a key."""
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
    try:
        key = hash_fn(bytes(4 * page_size), namespace_seed(None))
    except Exception as exc:
        raise TypeError(f"hash_fn(page_bytes, parent_key) failed on a page of zeros: {exc!r}") from exc
    check_key(key)


def check_batch(cache: PrefixCache, seqs: object) -> None:
    """Raise unless ``seqs`` is a list or tuple of distinct open sequences of ``cache``."""
    if not isinstance(seqs, (list, tuple)):
        raise TypeError(f"seqs must be a list of Sequence, got {type(seqs).__name__}")
    try:
        owned = all(seq._owner is cache for seq in seqs)
    except AttributeError:
        owned = False
    if not owned:
        for seq in seqs:
            if getattr(seq, "_owner", None) is not cache:
                reject(cache, seq)
    if len(set(seqs)) != len(seqs):
        raise ValueError("seqs lists a sequence twice")


def reject(cache: PrefixCache, seq: object) -> None:
    """Raise the error explaining why ``seq`` is not an open sequence of ``cache``."""
    if not isinstance(seq, Sequence):
        raise TypeError(f"expected a Sequence, got {type(seq).__name__}")
    if seq._cache is not cache:
        raise ValueError(f"sequence {seq._id} belongs to another PrefixCache")
    raise ValueError(f"sequence {seq._id} is closed")

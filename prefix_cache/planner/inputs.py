"""The planner's inputs checked: page tables, KV and query lengths, the page size.

Nothing is converted that is not an integer already (floats, NaN included, and bools raise), a wrong
shape or a value out of range raises ValueError naming the argument, and nothing is copied that is
already int32. The range of int32 page ids is checked on what a plan reads (``check_read_page_ids``)
rather than in a pass over every table of its own.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from prefix_cache.planner.plan import CascadeLevel

_I32 = np.int32

#: Each request's page ids, ``pages[i][:n]`` for its first n: a 2-D int32 array (a view of the
#: caller's, columns up to the most pages any request uses; rows may hold unused entries past a
#: request's own) or a list of 1-D int32 arrays of exactly the pages used.
Pages = np.ndarray | list[np.ndarray]

#: Page ids, the page size and query offsets end up in int32 plan arrays.
_I32_MAX = int(np.iinfo(_I32).max)
_BOOL_TYPES = frozenset((bool, np.bool_))


def check_setting(name: str, value: object, low: int) -> int:
    """A planner setting as an int >= ``low``: TypeError for anything but an integer (a float, NaN or
    bool would silently change which nodes are kept), ValueError below ``low``."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number


def check_plan_inputs(
    block_tables: np.ndarray | Sequence[Sequence[int] | np.ndarray],
    kv_lens: Sequence[int] | np.ndarray,
    qo_lens: Sequence[int] | np.ndarray,
    page_size: int,
) -> tuple[np.ndarray, np.ndarray, Pages, int, bool]:
    """Checked int64 lengths, the pages (``Pages``), the page size as an int, and whether the page ids
    are still to be checked (int32 ones: ``check_read_page_ids``, once planned). Nothing is
    converted that is not already an integer: floats (NaN too), bools and arrays of the wrong rank
    raise, naming the argument."""
    if isinstance(page_size, bool) or not isinstance(page_size, int | np.integer):
        raise TypeError(f"page_size must be an integer, got {page_size!r}")
    if not 1 <= page_size <= _I32_MAX:
        raise ValueError(f"page_size must be in [1, 2**31), got {page_size}")
    page_size = int(page_size)
    kv = _int_vector("kv_lens", kv_lens).astype(np.int64, copy=False)
    qo = _int_vector("qo_lens", qo_lens).astype(np.int64, copy=False)
    if isinstance(block_tables, np.ndarray) and block_tables.ndim != 2:
        raise ValueError(
            f"block_tables must be 2-D or a sequence of 1-D tables, got shape {block_tables.shape}"
        )
    if kv.shape != qo.shape or len(block_tables) != kv.shape[0]:
        raise ValueError(
            f"block_tables, kv_lens and qo_lens must have one entry per request, got "
            f"{len(block_tables)}, {kv.shape[0]} and {qo.shape[0]}"
        )
    # A negative kv_len has a negative qo_len or one above it: one test for the three, then which.
    if qo.min(initial=0) < 0 or (qo > kv).any():
        if (kv < 0).any() or (qo < 0).any():
            raise ValueError("kv_lens and qo_lens must be >= 0")
        i = int(np.argmax(qo > kv))
        raise ValueError(f"request {i}: qo_len {qo[i]} exceeds kv_len {kv[i]} (queries are part of the KV)")
    if int(qo.sum()) > _I32_MAX:  # query offsets are int32
        raise ValueError(f"qo_lens must sum to less than 2**31, got {int(qo.sum())}")
    if isinstance(block_tables, np.ndarray):
        _check_int_dtype("block_tables", block_tables)  # once for all rows
        width = -(-int(kv.max(initial=0)) // page_size)  # the most pages a request uses
        if block_tables.shape[1] < width:
            num_pages = -(-kv // page_size)
            i = int(np.argmax(num_pages > block_tables.shape[1]))
            raise ValueError(
                f"request {i}: {block_tables.shape[1]} pages for kv_len {kv[i]}, needs {num_pages[i]}"
            )
        matrix = block_tables[:, :width]
        if matrix.dtype == _I32:
            return kv, qo, matrix, page_size, True
        # Every entry in range (unused ones too) is the common case and one pass; otherwise look at
        # the used entries only.
        if matrix.size and (matrix.min() < 0 or matrix.max() > _I32_MAX):
            _check_page_ids(matrix, -(-kv // page_size))
        return kv, qo, matrix.astype(_I32), page_size, False
    num_pages = -(-kv // page_size)
    tables = [
        # Integer numpy rows (the fast path) are taken as they are; anything else is checked.
        (
            row
            if type(row) is np.ndarray and row.ndim == 1 and row.dtype.kind in "iu"
            else _int_vector(f"block_tables[{i}]", row)
        )[:n]
        for i, (row, n) in enumerate(zip(block_tables, num_pages.tolist(), strict=True))
    ]
    for i, (pages, n) in enumerate(zip(tables, num_pages.tolist(), strict=True)):
        if pages.shape[0] < n:
            raise ValueError(f"request {i}: {pages.shape[0]} pages for kv_len {kv[i]}, needs {n}")
    if all(pages.dtype == _I32 for pages in tables):
        return kv, qo, tables, page_size, True
    _check_page_ids(tables, num_pages)
    return kv, qo, [pages.astype(_I32, copy=False) for pages in tables], page_size, False


def _check_page_ids(pages: np.ndarray | list[np.ndarray], num_pages: np.ndarray) -> None:
    """Raise unless every used page id (``pages[i][:num_pages[i]]``) is in [0, 2**31)."""
    if isinstance(pages, np.ndarray):
        used = np.arange(pages.shape[1]) < num_pages[:, None]
        ids = np.where(used, pages, 0)
    else:
        ids = np.concatenate([row[:n] for row, n in zip(pages, num_pages.tolist(), strict=True)] or [[]])
    low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if low < 0 or high > _I32_MAX:
        raise ValueError(f"page ids must be in [0, 2**31), got range [{low}, {high}]")


def check_read_page_ids(
    pages: Pages, num_pages: np.ndarray, active: np.ndarray, levels: list[CascadeLevel]
) -> None:
    """The range check of int32 page ids (only negative ones are out of range), made on what the
    plan reads rather than in a pass over every table: each used page of a request with queries is
    in a level's ``kv_indices`` (a shared segment is read from one member, whose pages the others
    equal); the pages of requests without queries are looked at here."""
    low = min(int(level.kv_indices.min(initial=0)) for level in levels)
    if not active.all():
        idle = np.flatnonzero(~active)
        if isinstance(pages, np.ndarray):
            low = min(low, int(pages[idle].min(initial=0)))  # unused entries too: a second look if < 0
        else:
            spans = zip(idle.tolist(), num_pages[idle].tolist(), strict=True)
            low = min(low, *(int(pages[i][:n].min(initial=0)) for i, n in spans))
    if low < 0:
        _check_page_ids(pages, num_pages)


def _int_vector(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a 1-D integer numpy array (a view where it already is one); raises naming ``name``
    for another rank, a non-integer dtype, or a bool among Python ints (which numpy would take as 0/1)."""
    try:
        arr = np.asarray(values)
    except (ValueError, OverflowError) as exc:  # ragged nesting, or ints that overflow
        raise ValueError(f"{name} must be a 1-D sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64, copy=False)  # [] is float64 to numpy
    if arr.dtype.kind == "O" and all(type(v) is int for v in values):
        raise ValueError(f"{name} holds integers out of range")  # too large for any numpy int
    _check_int_dtype(name, arr)
    if isinstance(values, list | tuple):
        # numpy reads a bool among ints as 0 or 1, so only entries <= 1 can be one: look at those.
        suspects = np.flatnonzero(arr <= 1).tolist()
        if any(type(values[i]) in _BOOL_TYPES for i in suspects):
            raise TypeError(f"{name} must hold integers, got a bool")
    return arr


def _check_int_dtype(name: str, arr: np.ndarray) -> None:
    if arr.size and arr.dtype.kind not in "iu":
        what = "bools" if arr.dtype.kind == "b" else f"dtype {arr.dtype}"
        raise TypeError(f"{name} must hold integers, got {what}")

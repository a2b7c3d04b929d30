"""Block tables written into a caller's buffers, only the entries that changed since the last write."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import numpy as np

from prefix_cache.cache.sequence import Sequence

#: Per row (by the address of its first entry): the sequence written there last, its rollbacks
#: then, and the entries written.
RowMarks = dict[int, tuple[Sequence, int, int]]


class BlockTableWriter:
    """Per caller's buffer and row, what was last written there, so a write touches only new entries.

    Block tables are append-only between rollbacks, so a row that last held the same sequence
    with the same number of rollbacks needs only the entries past the ones written then.

    A buffer is known by the object that owns its memory (the end of its chain of ``.base``), held
    through a weak reference, and the stride of its entries: the marks of a buffer go when its
    owner is freed, so memory reused by a new array is never taken for rows already written, and a
    caller that passes a new view of one buffer each step (``tables[:n]``) finds the marks of its
    rows by their addresses.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        # (id(owner), entry stride) -> (weak reference to the owner, its rows' marks).
        self._buffers: dict[tuple[int, int], tuple[weakref.ref, RowMarks]] = {}

    def _marks(self, out: np.ndarray) -> RowMarks:
        """The row marks of the memory ``out`` views, new when its owner is new."""
        owner: object = out
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        key = (id(owner), out.strides[1])
        entry = self._buffers.get(key)
        if entry is not None and entry[0]() is owner:
            return entry[1]
        buffers = self._buffers
        try:
            ref = weakref.ref(owner, lambda _, key=key: buffers.pop(key, None))
        except TypeError:
            # An owner that takes no weak reference (a bytes object, say): remember nothing, so
            # every write is whole.
            return {}
        marks: RowMarks = {}
        buffers[key] = (ref, marks)
        return marks

    def write(self, seqs: list[Sequence], out: np.ndarray, rows: Iterable[int]) -> int:
        """Write the block table of ``seqs[i]`` into row ``rows[i]`` of ``out`` (a writeable 2-D
        int32 array; rows are ints ``>= 0``, one per sequence) from the first entry not written
        there yet. Returns the number of entries written. Raises ValueError at a row out of range
        or a table longer than a row, leaving the rows before it written."""
        max_rows, max_pages = out.shape
        marks = self._marks(out)
        address = out.__array_interface__["data"][0]
        row_stride = out.strides[0]
        written = 0
        # Rows are checked as they come: an error leaves the rows before it written and recorded.
        for seq, row in zip(seqs, rows, strict=True):
            if row >= max_rows:
                raise ValueError(f"rows entry {row} is past out's {max_rows} rows")
            end = seq._num_pages
            where = address + row * row_stride
            mark = marks.get(where)
            if mark is not None and mark[0] is seq and mark[1] == seq._rollbacks:
                start = mark[2]
                if start == end:
                    continue  # unchanged: not touched
            else:
                start = 0
            if end > max_pages:
                raise ValueError(f"sequence {seq._id} has {end} pages, out has room for {max_pages}")
            out[row, start:end] = seq._pages[start:end]
            written += end - start
            marks[where] = (seq, seq._rollbacks, end)
        return written

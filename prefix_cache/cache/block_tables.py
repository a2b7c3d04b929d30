"""Block tables written into a caller's buffers, only the entries that changed since the last write."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from prefix_cache.cache.sequence import Sequence


class BlockTableWriter:
    """Per caller's buffer and row, what was last written there, so a write touches only new entries.

    Block tables are append-only between rollbacks, so a row that last held the same sequence
    with the same number of rollbacks needs only the entries past the ones written then.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        # id(buffer) -> (buffer, per row: (sequence, rollbacks, entries) of the last write there).
        # The buffer itself is kept, so its id cannot be reused by another array.
        self._buffers: dict[int, tuple[np.ndarray, list[tuple[Sequence, int, int] | None]]] = {}

    def write(self, seqs: list[Sequence], out: np.ndarray, rows: Iterable[int]) -> int:
        """Write the block table of ``seqs[i]`` into row ``rows[i]`` of ``out`` (a writeable 2-D
        int32 array; rows are ints ``>= 0``, one per sequence) from the first entry not written
        there yet. Returns the number of entries written. Raises ValueError at a row out of range
        or a table longer than a row, leaving the rows before it written."""
        max_rows, max_pages = out.shape
        buffer = self._buffers.get(id(out))
        if buffer is None or buffer[0] is not out:
            buffer = self._buffers[id(out)] = (out, [None] * max_rows)
        marks = buffer[1]
        if len(marks) < max_rows:
            marks += [None] * (max_rows - len(marks))
        written = 0
        # Rows are checked as they come: an error leaves the rows before it written and recorded.
        for seq, row in zip(seqs, rows, strict=True):
            if row >= max_rows:
                raise ValueError(f"rows entry {row} is past out's {max_rows} rows")
            end = seq._num_pages
            mark = marks[row]
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
            marks[row] = (seq, seq._rollbacks, end)
        return written

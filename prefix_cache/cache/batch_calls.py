"""``PrefixCache``'s calls for a decode step over many sequences at once: ``allocate_batch``,
``commit_batch`` and ``write_block_tables``. ``PrefixCache`` inherits them; they use its lock, store
and block table writer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.arguments import check_batch, check_int
from prefix_cache.cache.errors import OutOfPages
from prefix_cache.cache.tokens import as_token_array

if TYPE_CHECKING:
    from prefix_cache.cache.sequence import Sequence

_INT32 = np.dtype(np.int32)


class BatchCalls:
    """The decode step's batch calls of ``PrefixCache`` (a base class: it has no state of its own)."""

    def allocate_batch(self, seqs: list[Sequence], num_tokens: int = 1) -> None:
        """``allocate(seq, num_tokens)`` for each of ``seqs`` (the decode step: one slot each), all
        or nothing: raises ``OutOfPages`` and changes nothing when the pages for all of them cannot
        be supplied."""
        if type(num_tokens) is not int or num_tokens < 0:
            num_tokens = check_int("num_tokens", num_tokens, 0)
        check_batch(self, seqs)
        short = [seq for seq in seqs if seq._num_allocated + num_tokens > seq._capacity]
        if not short:
            for seq in seqs:
                seq._num_allocated += num_tokens
            return
        page_size = self._page_size
        needed = sum(-(-(seq._num_allocated + num_tokens) // page_size) - seq._num_pages for seq in short)
        self._enter()
        try:
            free = len(self._pool.free)
            available = free + self._tree.num_unreferenced
            if needed > available:
                raise OutOfPages(needed, available)
            for seq in short:
                pages = -(-(seq._num_allocated + num_tokens) // page_size)
                if pages > len(seq._pages):
                    seq._grow(pages, page_size)  # before anything changes
            if needed > free:
                # The step's pages, evicted in one batch.
                self._store.evict(needed - free)
            pool = self._pool
            for seq in short:
                count = seq._num_pages
                more = -(-(seq._num_allocated + num_tokens) // page_size) - count
                if more == 1:
                    seq._pages_int[count] = pool.free.pop()
                    seq._num_pages = count + 1
                    seq._capacity += page_size
                else:
                    seq._add_pages(pool.take(more), page_size)
            for seq in seqs:
                seq._num_allocated += num_tokens
        finally:
            self._baton.append(None)

    def commit_batch(self, seqs: list[Sequence], tokens: object) -> None:
        """``commit(seq, [token])`` for each of ``seqs`` and the matching entry of ``tokens`` (1-D,
        one token per sequence): the decode step's commit. Every sequence must have a reserved
        slot; checked for all before any is committed (ValueError, nothing changed). An error of a
        caller's ``hash_fn`` leaves the sequences before the failing one committed."""
        arr = as_token_array(tokens)
        if len(arr) != len(seqs):
            raise ValueError(f"tokens has {len(arr)} entries for {len(seqs)} sequences")
        check_batch(self, seqs)
        if not all(seq._num_tokens < seq._num_allocated for seq in seqs):
            seq = next(seq for seq in seqs if seq._num_tokens >= seq._num_allocated)
            raise ValueError(f"cannot commit: sequence {seq._id} has no reserved slot (allocate first)")
        page_size = self._page_size
        self._enter()  # once per batch: the per-token calls alone take the baton inline
        try:
            for seq, token in zip(seqs, arr.tolist(), strict=True):
                n = seq._num_tokens
                seq._tokens_int[n] = token
                n += 1
                if n % page_size == 0 and not seq._dirty:
                    self._store.defer_page(seq, n, token)
                seq._num_tokens = n
        finally:
            self._baton.append(None)

    def write_block_tables(self, seqs: list[Sequence], out: np.ndarray, rows: object = None) -> int:
        """Write the block tables of ``seqs`` into rows of ``out``, an int32 array
        ``[max_requests, max_pages]`` the caller keeps between steps (row ``rows[i]`` for
        ``seqs[i]``; ``rows`` defaults to ``0 .. len(seqs) - 1``). Block tables are append-only,
        so only the entries added since the last write to the same row of the same buffer are
        written, and rows without new entries are not touched. Entries past a sequence's
        ``len(block_table)`` are left as they were. Returns the number of entries written. An
        error (a row out of range, a table longer than a row) leaves the rows before it written.
        """
        if not isinstance(out, np.ndarray) or out.dtype != _INT32 or out.ndim != 2:
            raise TypeError("out must be a 2-D int32 numpy array [max_requests, max_pages]")
        if not out.flags.writeable:
            raise ValueError("out must be writeable")
        check_batch(self, seqs)
        if rows is None:
            row_ids: range | list[int] = range(len(seqs))
        else:
            row_ids = [check_int("rows", row, 0) for row in rows]
            if len(row_ids) != len(seqs):
                raise ValueError(f"rows has {len(row_ids)} entries for {len(seqs)} sequences")
        return self._block_tables.write(seqs, out, row_ids)

"""The int32 image of a Triton backend plan: where each of its tables lives in the plan's one
device buffer (``Sections``), how a plan's tables are written into it (``fill_image``), and how it is
uploaded without a host sync (``Upload``)."""

from __future__ import annotations

import numpy as np
import torch

from prefix_cache.kernels.work import WORK_COLS, LevelArrays


class Sections:
    """Offsets of the int32 sections in the one device buffer of a plan: the item counts, the row
    tables (attention: o_rows per level, q_rows; merge: out rows, first partial rows, counts, and the
    rows of states computed outside the Triton launches), the work lists, and the page ids last (so an
    upload can stop where the pages do)."""

    def __init__(self, work_items: list[int], pages: int, levels: int, tokens: int) -> None:
        self.work_items, self.pages, self.levels, self.tokens = work_items, pages, levels, tokens
        self.num_work = 0
        self.o_rows = len(work_items)
        self.q_rows = self.o_rows + levels * tokens
        self.merge_rows = self.q_rows + tokens
        self.starts = self.merge_rows + tokens
        self.counts = self.starts + tokens
        self.ext = self.counts + tokens
        offset = self.ext + 3 * tokens
        self.work: list[int] = []
        for n in work_items:
            self.work.append(offset)
            offset += n * WORK_COLS
        self.kv_indices = offset
        self.size = offset + pages


class Upload:
    """Host-to-device copies of a plan's int32 image without a host sync: the image is written into a
    pinned buffer and copied asynchronously on the current stream; the next plan waits for that copy
    (not for the kernels) before writing the buffer again. Plain copies for CPU tensors."""

    def __init__(self, device: torch.device) -> None:
        self._pinned = device.type == "cuda"
        self._host = torch.zeros(0, dtype=torch.int32)
        self._host_array = self._host.numpy()  # the same memory
        self._done: torch.cuda.Event | None = None

    def image(self, size: int) -> np.ndarray:
        """A writable int32 host array of ``size`` elements (contents undefined, kept across calls)."""
        if self._done is not None:
            self._done.synchronize()
        if self._host.numel() < size:
            self._host = torch.zeros(
                max(size, 2 * self._host.numel()), dtype=torch.int32, pin_memory=self._pinned
            )
            self._host_array = self._host.numpy()
        return self._host_array[:size]

    def copy(self, dst: torch.Tensor, size: int) -> None:
        """Copy the first ``size`` elements of the image into ``dst[:size]``."""
        dst[:size].copy_(self._host[:size], non_blocking=self._pinned)
        if self._pinned:
            self._done = torch.cuda.Event()
            self._done.record()


def output_states(rows_per_token: np.ndarray, ext: np.ndarray | None) -> np.ndarray:
    """Per planned token (bool [nq]): whether its one state is its output, which a Triton launch
    writes straight to the engine's row, so it takes no partial row and no merge. ``rows_per_token``:
    its states in the Triton launches; ``ext``: as in ``fill_image``."""
    single = rows_per_token == 1
    return single if ext is None else single & (ext[2] == 0)


def fill_image(
    host: np.ndarray,
    sec: Sections,
    works: list[np.ndarray],
    levels: list[LevelArrays],
    splits: np.ndarray,
    order: np.ndarray,
    token_stride: int,
    ext: np.ndarray | None = None,
    merge_slots: int | None = None,
) -> tuple[int, int]:
    """Write a plan's int sections into ``host`` (work lists, counts, pages, row tables); returns
    (merged tokens, partial rows). ext: int32 [3, nq], the states each planned token has outside
    the Triton launches (``SharedLevelsOnFlashInfer.plan``), or None. merge_slots: the merge
    launch's programs (the row length of the ext table); default the merged tokens."""
    nq = order.shape[0]
    for i, (offset, work) in enumerate(zip(sec.work, works, strict=True)):
        host[offset : offset + work.size] = work.reshape(-1)
        host[sec.num_work + i] = work.shape[0]  # an item at a time: no array made of a list
    at = sec.kv_indices
    for level in levels:
        host[at : at + level.kv_indices.shape[0]] = level.kv_indices
        at += level.kv_indices.shape[0]
    # A token's rows in the levels before each, and in all: one row add per level (numpy's cumsum
    # along the levels costs more on these short arrays).
    before = np.zeros(splits.shape, dtype=splits.dtype)
    for i in range(1, splits.shape[0]):
        np.add(before[i - 1], splits[i - 1], out=before[i])
    rows_per_token = before[-1] + splits[-1]
    final = output_states(rows_per_token, ext)
    rows = host[sec.o_rows : sec.o_rows + len(levels) * token_stride].reshape(len(levels), token_stride)
    host[sec.q_rows : sec.q_rows + nq] = order
    if final.all():
        # Every token's one state is its output: o_rows -1 - r sends it to engine row r.
        rows[:, :nq] = -1 - order
        return 0, 0
    # Partial rows for the other tokens only, contiguous per token in planned order; the merge's
    # programs take those tokens in that order. The three cases (all, some, no tokens with one
    # state) are kept apart: one np.where path over all of them made the same int image with
    # measurably more host time per plan.
    some_final = final.any()
    merged = np.flatnonzero(~final) if some_final else slice(None)
    counts = rows_per_token[merged]
    ends = counts.cumsum()
    starts = ends - counts
    if some_final:
        first = np.zeros(nq, dtype=np.int64)
        first[merged] = starts
        rows[:, :nq] = before + first
        rows[:, :nq][:, final] = -1 - order[final]
    else:
        rows[:, :nq] = before + starts
    k = counts.shape[0]
    host[sec.merge_rows : sec.merge_rows + k] = order[merged]
    host[sec.starts : sec.starts + k] = starts
    host[sec.counts : sec.counts + k] = counts
    if ext is not None:
        slots = merge_slots or k
        host[sec.ext : sec.ext + 3 * slots].reshape(3, slots)[:, :k] = ext[:, merged]
    return k, int(ends[-1])

"""Long shared levels on FlashInfer's Hopper prefill kernel (FA3), their KV split by hand (CUDA only).

A shared level with many query rows over a long prefix is compute-bound. FlashInfer's FA3 paged
prefill runs one program per (128 query rows, KV head) and never splits the KV: a prefix of 32768
tokens shared by 128 decoding requests (512 rows per KV head, 8 KV heads) is 32 programs on 132 SMs,
most of the device idle. Cut into S chunks, each chunk a FlashInfer request that repeats the group's
queries, the same level fills the device (S = 4: 128 programs) and ran well ahead of our Triton
kernel (benchmarks/NOTES.md, "long shared levels on FlashInfer's FA3, split by hand"). The S states
of every query, FlashInfer's output dtype and base-2 LSE, are folded in by the Triton backend's
merge with the states of the plan's other levels (``MergeLaunch``'s ``ext``), which our kernels
compute.

``SharedLevelsOnFlashInfer`` is given to a ``TritonBackend`` by the auto backend; it takes the level
``LevelRule`` admits (one per plan), plans it on one FlashInfer wrapper, and runs it before the
Triton launches. Under a ``GraphCapacity`` the wrapper is FlashInfer's CUDA-graph mode over fixed
index buffers, every plan padded to one batch of requests and one count of query rows (as
``flashinfer_graphs`` pads one-level plans), so a captured ``run`` replays after any later plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from prefix_cache.attention.base import reused_buffer
from prefix_cache.attention.kv_layout import flashinfer_page_ids
from prefix_cache.kernels._common import num_sms
from prefix_cache.kernels.work import LevelArrays

if TYPE_CHECKING:
    from prefix_cache.attention.triton_backend import GraphCapacity

#: FA3's query tile: rows of (query tokens x query heads of one KV head) per program.
FA3_ROWS = 128
#: Head dims FlashInfer builds its FA3 kernels for.
FA3_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class LevelRule:
    """Which shared levels run on FlashInfer's FA3: a non-causal level whose every group (with
    queries and KV) has at least ``min_rows`` query rows per KV head (tokens x GQA group),
    ``min_kv_tokens`` KV tokens, and ``min_work`` rows x KV tokens x KV heads. ``min_split_tokens``:
    the shortest chunk a group's KV is cut into.

    The defaults are where sweeps measured the whole step faster with FA3 (benchmarks/NOTES.md,
    "long shared levels on FlashInfer's FA3" and "FA3 levels under a capacity"): one prefix of
    2048-32768 tokens x 16-128 decoding requests (32/8 heads, d64 and d128) gained only at 512
    rows over 16384+ tokens, while at 256 rows or fewer FA3's fixed cost made it slower
    everywhere; and prefill chunks or hundreds of decodes over shorter prefixes, where more rows
    fill the device without splitting the KV. The work counts every KV head: FA3 runs one program
    per 128 rows, KV head and chunk, and under MQA (32/1) a level of as many rows x tokens per KV
    head as an admitted 8-KV-head one ran slower on it than on the Triton kernels."""

    min_rows: int = 512
    min_kv_tokens: int = 2048
    min_work: int = 512 * 16384 * 8
    min_split_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("min_rows", "min_kv_tokens", "min_work", "min_split_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"LevelRule.{name} must be >= 1, got {getattr(self, name)}")


class SharedLevelsOnFlashInfer:
    """The level of a plan that runs on FlashInfer's FA3 paged prefill, split by hand.

    flashinfer: the imported module. workspace_bytes: FlashInfer's float workspace (FA3 keeps no
    split results in it, but the wrapper needs one). capacity: the Triton backend's, for CUDA-graph
    replay across plans (fixed buffers, see the module docstring); None sizes every plan exactly.
    """

    def __init__(
        self,
        flashinfer,
        device: torch.device,
        rule: LevelRule | None = None,
        workspace_bytes: int = 16 << 20,
        *,
        capacity: GraphCapacity | None = None,
    ) -> None:
        self._flashinfer = flashinfer
        self._device = device
        self.rule = rule or LevelRule()
        self._workspace_bytes = workspace_bytes
        self._capacity = capacity
        # The graph-mode wrapper's ((requests, query rows), (heads, head_dim, page_size, scale, dtype)).
        self._fixed: tuple | None = None
        self._wrapper = None  # made, with its workspace, at the first plan
        self._q_index: torch.Tensor | None = None  # engine rows of q, one per FlashInfer query row
        self._pending: tuple | None = None  # what ``plan`` computed for ``commit``
        self._buffers: dict[str, torch.Tensor] = {}
        self.o: torch.Tensor | None = None  # [rows, Hq, D] in q's dtype
        self.lse: torch.Tensor | None = None  # [rows, Hq] float32, base 2

    def take(
        self, levels: list[LevelArrays], causal: list[bool], heads: tuple[int, int], head_dim: int, dtype
    ) -> int | None:
        """The index of the level of ``levels`` (checked index arrays; ``causal`` per level) this
        runs for q and KV of ``dtype`` (the KV's: an fp8 cache takes nothing), ``heads`` (query
        heads, KV heads) and ``head_dim``, or None. One level at most: a token's states here are
        one run of rows (``plan``'s table), and the last level is left to the Triton kernels, which
        write every token's own KV. Among the levels the rule admits, the one with the most query x
        KV work. FA3 takes fp16 and bf16, and the head
        dims of ``FA3_HEAD_DIMS``."""
        if dtype not in (torch.float16, torch.bfloat16) or head_dim not in FA3_HEAD_DIMS:
            return None
        rule = self.rule
        num_qo_heads, num_kv_heads = heads
        group_size = num_qo_heads // num_kv_heads
        best, best_work = None, 0
        for i, (level, is_causal) in enumerate(zip(levels[:-1], causal[:-1], strict=True)):
            used = (level.q_len > 0) & (level.kv_len > 0)
            if is_causal or not used.any():
                continue
            q_len, kv_len = level.q_len[used].astype(np.int64), level.kv_len[used].astype(np.int64)
            rows = q_len * group_size
            if (
                (rows >= rule.min_rows).all()
                and (kv_len >= rule.min_kv_tokens).all()
                and (rows * kv_len * num_kv_heads >= rule.min_work).all()
            ):
                work = int((q_len * kv_len).sum())
                if work > best_work:
                    best, best_work = i, work
        return best

    def plan(
        self,
        level: LevelArrays,
        kv_last_page_len: np.ndarray,
        order: np.ndarray,
        page_size: int,
        heads: tuple[int, int, int, float],
        dtype: torch.dtype,
    ) -> np.ndarray:
        """Plan ``level`` (the one ``take`` chose; its last-page lengths; ``order``: the planned
        order's engine rows) for FlashInfer, on the host: ``commit`` hands it to FlashInfer.
        heads: (num_qo_heads, num_kv_heads, head_dim, sm_scale).
        Returns int32 [3, num_query_tokens]: per planned query token, its first row in ``o`` / ``lse``,
        the rows between its states, and its number of states (0 for tokens without KV there)."""
        hq, hkv, head_dim, sm_scale = heads
        group = hq // hkv
        ext = np.zeros((3, order.shape[0]), dtype=np.int32)
        groups = np.flatnonzero((level.q_len > 0) & (level.kv_len > 0))
        # Chunks per group: enough programs to fill the device once (FA3 runs one wave best), each
        # chunk at least min_split_tokens long.
        programs = int((-(-level.q_len[groups] * group // FA3_ROWS)).sum()) * hkv
        splits = max(1, num_sms(self._device) // max(programs, 1))
        qo, kv, indices, lasts, q_index = [0], [0], [], [], []
        row = 0
        for g in groups.tolist():
            q0, q1 = int(level.qo_indptr[g]), int(level.qo_indptr[g + 1])
            p0, p1 = int(level.kv_indptr[g]), int(level.kv_indptr[g + 1])
            chunks = max(1, min(splits, int(level.kv_len[g]) // self.rule.min_split_tokens, p1 - p0))
            per_chunk = -(-(p1 - p0) // chunks)
            chunks = -(-(p1 - p0) // per_chunk)
            for c in range(chunks):
                a, b = p0 + c * per_chunk, min(p0 + (c + 1) * per_chunk, p1)
                indices.append(level.kv_indices[a:b])
                lasts.append(int(kv_last_page_len[g]) if b == p1 else page_size)
                kv.append(kv[-1] + b - a)
                qo.append(qo[-1] + q1 - q0)
                q_index.append(order[q0:q1])
            ext[0, q0:q1] = row + np.arange(q1 - q0)
            ext[1, q0:q1] = q1 - q0
            ext[2, q0:q1] = chunks
            row += chunks * (q1 - q0)
        qo_a, kv_a, lasts_a = (np.asarray(a, dtype=np.int32) for a in (qo, kv, lasts))
        q_index_a = np.concatenate(q_index).astype(np.int64)
        indices_a = np.concatenate(indices).astype(np.int32)
        shape = (hq, hkv, head_dim, page_size, sm_scale, dtype)
        if self._capacity is None:
            self._pending = (None, (qo_a, kv_a, indices_a, lasts_a), row, q_index_a, shape)
            return ext
        requests, rows = self._fixed_sizes(hkv, group)
        # The level's pages are within the plan's, which the Triton backend checked.
        assert qo_a.shape[0] <= requests and row <= rows, "FA3 level over its fixed sizes"
        # Padded to the fixed batch: the first padding request owns the rows past the plan's (FA3
        # takes q's row count at launch; a graph keeps the captured one), with no KV.
        qo_f = np.full(requests + 1, rows, dtype=np.int32)
        qo_f[: qo_a.shape[0]] = qo_a
        kv_f = np.full(requests + 1, kv_a[-1], dtype=np.int32)
        kv_f[: kv_a.shape[0]] = kv_a
        lasts_f = np.zeros(requests, dtype=np.int32)
        lasts_f[: lasts_a.shape[0]] = lasts_a
        q_index_f = np.zeros(rows, dtype=np.int64)  # padding rows read q's row 0
        q_index_f[:row] = q_index_a
        self._pending = ((requests, rows), (qo_f, kv_f, indices_a, lasts_f), rows, q_index_f, shape)
        return ext

    def commit(self) -> None:
        """Plan FlashInfer's wrapper with the last ``plan`` and upload its query rows (apart from
        ``plan`` so that a plan the Triton backend then refuses leaves them as they were). Raises
        ValueError, changing nothing, when a fixed-capacity wrapper's shape would change."""
        assert self._pending is not None
        fixed, arrays, rows, q_index, shape = self._pending
        self._pending = None
        self._plan_wrapper(self._make(shape, fixed), *arrays, shape)
        self._bind_buffers(rows, shape)
        # No host sync: the copy is ordered after the kernels that read the previous rows.
        self._q_index.copy_(torch.from_numpy(q_index), non_blocking=True)

    def _fixed_sizes(self, num_kv_heads: int, group: int) -> tuple[int, int]:
        """(requests, query rows) of the graph-mode wrapper. ``plan`` gives a group of q query tokens
        ``c = min(S, ...)`` chunks with ``S = max(1, sms // programs)``, programs at least
        ``num_kv_heads * rows / FA3_ROWS`` over the level's rows: so at most ``max(tokens, sms *
        FA3_ROWS / (num_kv_heads * group))`` query rows in all, and ``max(groups, sms / num_kv_heads)``
        requests, groups at most the tokens: the batch is ``max(tokens, sms)`` requests and one more,
        so that a padding request always follows the plan's."""
        assert self._capacity is not None
        tokens, sms = self._capacity.max_query_tokens, num_sms(self._device)
        return max(tokens, sms) + 1, max(tokens, sms * FA3_ROWS // (num_kv_heads * group))

    def _make(self, shape: tuple, fixed: tuple[int, int] | None):
        """The wrapper: plain, or over fixed index buffers of ``fixed`` (requests, query rows), given
        a first plan of that many rows (FlashInfer sizes its grid from it; nothing runs it)."""
        if self._wrapper is not None:
            if fixed is not None and (fixed, shape) != self._fixed:
                raise ValueError(
                    f"a fixed-capacity backend's FA3 level keeps its heads, head_dim, page_size, "
                    f"sm_scale and dtype {self._fixed[1]}; got {shape}: make a new backend"
                )
            return self._wrapper
        workspace = torch.empty(self._workspace_bytes, dtype=torch.uint8, device=self._device)
        wrapper_type = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper
        if fixed is None:
            self._wrapper = wrapper_type(workspace, "NHD", backend="fa3")
            return self._wrapper
        requests, rows = fixed
        device = self._device
        self._wrapper = wrapper_type(
            workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(requests + 1, dtype=torch.int32, device=device),
            paged_kv_indptr_buf=torch.zeros(requests + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buf=torch.zeros(self._capacity.max_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buf=torch.zeros(requests, dtype=torch.int32, device=device),
            backend="fa3",
        )
        self._fixed = (fixed, shape)
        qo = np.full(requests + 1, rows, dtype=np.int32)
        qo[0] = 0
        zeros = np.zeros(requests + 1, dtype=np.int32)
        self._plan_wrapper(self._wrapper, qo, zeros, zeros[:0], zeros[:requests], shape)
        return self._wrapper

    def _plan_wrapper(self, wrapper, qo, kv, indices, lasts, shape: tuple) -> None:
        hq, hkv, head_dim, page_size, sm_scale, dtype = shape
        wrapper.plan(
            torch.from_numpy(qo),
            torch.from_numpy(kv),
            flashinfer_page_ids(indices, self._device),
            torch.from_numpy(lasts),
            hq, hkv, head_dim, page_size,
            causal=False, sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype,
        )  # fmt: skip

    def _bind_buffers(self, rows: int, shape: tuple) -> None:
        """``o``, ``lse``, the gathered q and its engine rows for ``rows`` FlashInfer query rows (kept,
        and grown only, across plans: a fixed-capacity backend's are made once, at their final size)."""
        hq, _, head_dim, _, _, dtype = shape
        buffers, device = self._buffers, self._device
        self._q_index = reused_buffer(buffers, "q_index", rows, torch.int64, device)
        self.o = reused_buffer(buffers, "o", rows * hq * head_dim, dtype, device).view(rows, hq, head_dim)
        self.lse = reused_buffer(buffers, "lse", rows * hq, torch.float32, device).view(rows, hq)
        self._q = reused_buffer(buffers, "q", rows * hq * head_dim, dtype, device).view(rows, hq, head_dim)

    def run(self, q: torch.Tensor, paged) -> None:
        """Write the planned levels' states into ``o`` and ``lse``. q: the engine's [*, Hq, D];
        paged: the KV cache as FlashInfer takes it (the 5-D NHD tensor or a (k, v) pair)."""
        torch.index_select(q, 0, self._q_index, out=self._q)
        self._wrapper.run(self._q, paged, out=self.o, lse=self.lse, return_lse=True)

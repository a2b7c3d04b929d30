"""A backend on FlashInfer's paged decode and prefill kernels and its multi-level cascade wrapper
(CUDA only).

FlashInfer plans on the host per level (``plan``) and runs per layer (``run``); its plan needs the
query dtype: given to ``plan`` (``q_dtype=``), FlashInfer plans there; otherwise at the first run of a
step and again whenever the dtype changes. A plan of one causal level with one query per request
(plain decode) runs on the decode wrapper with tensor cores, other one-level plans on the paged
prefill wrapper (FA3 on Hopper), shared levels on the cascade wrapper.

Groups that have queries but no KV at a level (a request outside every shared node of that level) are
taken out of the level before FlashInfer sees it, and the level runs on the remaining query rows only:
whether FlashInfer's kernels (fa2 or fa3, chosen per device) return a finite output and an lse of -inf
for an empty KV segment is not something this backend relies on. With no such gap anywhere,
``MultiLevelCascadeAttentionWrapper`` runs the plan as it is.

An fp8 cache (``torch.float8_e4m3fn``, q fp16 or bf16) runs on the same wrappers, planned with
``kv_data_type`` fp8 and given the layer's ``k_scale`` and ``v_scale`` at ``run`` (FlashInfer picks
FA2 for it: its FA3 takes fp8 KV only with an fp8 q); shared levels then run level by level on the
prefill wrappers, whose ``run`` takes the scales, and are merged with FlashInfer's merge.

FlashInfer's lse is base 2; it never leaves this module (FlashInfer's own merge consumes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend, check_pool, in_engine_order, to_planned_order
from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, flashinfer_paged
from prefix_cache.attention.triton_backend import checked_levels
from prefix_cache.planner.plan import CascadeLevel, CascadePlan

_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CompactLevel:
    """A level without the groups that have no queries or no KV. Index arrays int32, host memory.

    rows: int64 planned query rows the remaining groups cover, in order, or None when they cover
        every query of the plan (nothing was taken out but groups without queries).
    """

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    causal: bool
    rows: np.ndarray | None

    @property
    def num_groups(self) -> int:
        return int(self.kv_last_page_len.shape[0])


def compact_level(level: CascadeLevel) -> CompactLevel:
    """Drop the groups of ``level`` that have no queries or no KV pages; see ``CompactLevel``."""
    qo_lens = np.diff(level.qo_indptr.astype(np.int64))
    num_pages = np.diff(level.kv_indptr.astype(np.int64))
    keep = (qo_lens > 0) & (num_pages > 0)
    kept_rows = np.repeat(keep, qo_lens)
    rows = None if kept_rows.all() else np.flatnonzero(kept_rows).astype(np.int64)
    return CompactLevel(
        qo_indptr=_indptr(qo_lens[keep]),
        kv_indptr=_indptr(num_pages[keep]),
        kv_indices=level.kv_indices[np.repeat(keep, num_pages)].astype(np.int32),
        kv_last_page_len=level.kv_last_page_len[keep].astype(np.int32),
        causal=level.causal,
        rows=rows,
    )


def _indptr(counts: np.ndarray) -> np.ndarray:
    indptr = np.zeros(counts.shape[0] + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    return indptr


class FlashInferBackend(AttentionBackend):
    """Cascade attention with FlashInfer on one CUDA device; q fp16 or bf16, KV q's dtype or fp8.

    device: the CUDA device of q and kv_cache.
    workspace_bytes: FlashInfer's float workspace (split-KV partial results), shared by all levels,
        which run one after another on the current stream.
    """

    name = "flashinfer"

    def __init__(self, device: str | torch.device = "cuda", workspace_bytes: int = 128 * 1024 * 1024) -> None:
        try:
            import flashinfer
        except ModuleNotFoundError as error:
            raise ImportError(
                "the 'flashinfer' attention backend needs the 'flashinfer' package "
                "(a flashinfer-python wheel that matches your torch and CUDA)"
            ) from error
        if not torch.cuda.is_available():
            raise RuntimeError("the 'flashinfer' attention backend needs a CUDA device")
        super().__init__()
        self._flashinfer = flashinfer
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            # Tensors report their index ("cuda:0"): compare against the same spelling.
            self._device = torch.device(self._device.type, torch.cuda.current_device())
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self._device)
        # FlashInfer wrappers own pinned and device buffers: made once, re-planned every step.
        self._prefill_wrappers: list = []
        self._cascade_wrappers: dict[int, object] = {}
        self._levels: list[CompactLevel] = []
        self._rows: list[torch.Tensor | None] = []
        self._query_order = torch.zeros(0, dtype=torch.int64)
        self._in_order = True
        self._planned_dtype: tuple[torch.dtype, torch.dtype] | None = None  # (q, KV) of the wrappers' plans
        self._max_page = -1  # the largest page id the current plan reads
        self._decode = None  # made on first use
        self._decode_wrapper = None  # the decode wrapper when the current plan is plain decode
        self._planned_kv: torch.dtype | None = None  # the KV dtype the wrappers are being planned for

    def _prepare(self, plan: CascadePlan) -> None:
        # FlashInfer's kernels read whatever page ids they are given: the Triton backend's checks,
        # once per plan (``run`` then compares the largest id with the pool's size).
        self._max_page = max((level.max_page for level in checked_levels(plan)), default=-1)
        levels = [compact_level(level) for level in plan.levels]
        # The merge starts from the last level's state, which must hold every query row.
        if plan.num_query_tokens and levels[-1].rows is not None:
            raise ValueError("the last level of the plan must give every query some KV")
        self._levels = [level for level in levels if level.num_groups]
        self._rows = [
            None if level.rows is None else torch.from_numpy(level.rows).to(self._device)
            for level in self._levels
        ]
        # One-level plans come in the engine's order: no q gather, no output scatter.
        self._in_order = in_engine_order(plan.query_order)
        if not self._in_order:
            self._query_order = torch.from_numpy(plan.query_order).to(self._device)
        self._planned_dtype = None
        self._decode_wrapper = None
        if self.dtype is not None and plan.num_query_tokens:
            if self.dtype not in _FLASHINFER_DTYPES:
                raise ValueError(f"the 'flashinfer' attention backend takes fp16 or bf16, got {self.dtype}")
            self._plan_flashinfer((self.dtype, self.kv_dtype), plan.page_size)

    def _run(self, plan: CascadePlan, q, kv_cache, k, v, out, scales=(1.0, 1.0)) -> None:
        if q.dtype not in _FLASHINFER_DTYPES:
            raise ValueError(f"the 'flashinfer' attention backend takes fp16 or bf16, got {q.dtype}")
        check_pool(self._device, self._max_page, q, k)
        if plan.num_query_tokens == 0:
            return
        if self._planned_dtype != (q.dtype, k.dtype):
            self._plan_flashinfer((q.dtype, k.dtype), plan.page_size)
        paged = flashinfer_paged(kv_cache, k, v)
        fp8 = {"k_scale": scales[0], "v_scale": scales[1]} if k.dtype == FP8_KV_DTYPE else {}
        q_planned = q.contiguous() if self._in_order else to_planned_order(q, self._query_order)
        # One-level wrappers write an in-order, contiguous ``out`` themselves: no copy launch.
        direct = self._in_order and len(self._levels) == 1 and out.is_contiguous()
        if self._decode_wrapper is not None:
            result = self._decode_wrapper.run(q_planned, paged, out=out if direct else None, **fp8)
        elif direct:
            result = self._prefill_wrappers[0].run(q_planned, paged, out=out, **fp8)
        elif self._use_cascade_wrapper():
            result = self._cascade_wrappers[len(self._levels)].run(q_planned, paged)
        else:
            result = self._run_levels(q_planned, paged, fp8)
        if direct:
            return
        if self._in_order:
            out.copy_(result)
        else:
            out.index_copy_(0, self._query_order, result)

    def _use_decode_wrapper(self) -> bool:
        """One causal level where every query token is its own group's only one: plain decode, which
        FlashInfer's decode wrapper (tensor-core kernels) runs faster than its prefill kernels."""
        return (
            len(self._levels) == 1
            and self._rows[0] is None
            and self._levels[0].causal
            and bool((np.diff(self._levels[0].qo_indptr) == 1).all())
        )

    def _use_cascade_wrapper(self) -> bool:
        """The cascade wrapper runs every level on every query, shared levels non-causal and the last
        one causal: usable when there are shared levels and no level had to be cut down to fewer
        rows, and the cache is not fp8 (its ``run`` takes no KV scales)."""
        return (
            len(self._levels) > 1
            and self._planned_kv != FP8_KV_DTYPE
            and all(rows is None for rows in self._rows)
            and [level.causal for level in self._levels] == [False] * (len(self._levels) - 1) + [True]
        )

    def _plan_flashinfer(self, dtypes: tuple[torch.dtype, torch.dtype], page_size: int) -> None:
        """Plan the wrappers for q and KV of ``dtypes``."""
        dtype, kv_dtype = dtypes
        self._planned_kv = kv_dtype
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, page_size)
        # Host-side index arrays: FlashInfer reads the indptrs on the host to schedule, then copies.
        arrays = [
            [torch.from_numpy(a) for a in (lv.qo_indptr, lv.kv_indptr, lv.kv_indices, lv.kv_last_page_len)]
            for lv in self._levels
        ]
        self._decode_wrapper = None
        if self._use_decode_wrapper():
            if self._decode is None:
                self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=True
                )
            _, kvp, idx, last = arrays[0]
            self._decode.plan(
                kvp, idx, last, *heads, sm_scale=self.sm_scale, q_data_type=dtype, kv_data_type=kv_dtype
            )
            self._decode_wrapper = self._decode
        elif self._use_cascade_wrapper():
            wrapper = self._cascade_wrappers.get(len(self._levels))
            if wrapper is None:
                wrapper = self._flashinfer.MultiLevelCascadeAttentionWrapper(
                    len(self._levels), self._workspace, "NHD"
                )
                self._cascade_wrappers[len(self._levels)] = wrapper
            wrapper.plan(
                *[list(column) for column in zip(*arrays, strict=True)],
                *heads,
                causal=True,  # applied to the last level only
                sm_scale=self.sm_scale,
                q_data_type=dtype,
                kv_data_type=kv_dtype,
            )
        else:
            while len(self._prefill_wrappers) < len(self._levels):
                self._prefill_wrappers.append(
                    self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
                )
            for wrapper, level, level_arrays in zip(
                self._prefill_wrappers[: len(arrays)], self._levels, arrays, strict=True
            ):
                wrapper.plan(
                    *level_arrays,
                    *heads,
                    causal=level.causal,
                    sm_scale=self.sm_scale,
                    q_data_type=dtype,
                    kv_data_type=kv_dtype,
                )
        self._planned_dtype = dtypes

    def _run_levels(self, q: torch.Tensor, kv_cache, fp8: dict) -> torch.Tensor:
        """Each level on its own rows, merged into the last level's state (which holds every row).
        fp8: the KV scales for the wrappers' ``run``, or empty."""
        wrappers = self._prefill_wrappers[: len(self._levels)]
        out, lse = wrappers[-1].run(q, kv_cache, return_lse=True, **fp8)
        for wrapper, rows in zip(wrappers[:-1], self._rows[:-1], strict=True):
            if rows is None:
                level_out, level_lse = wrapper.run(q, kv_cache, return_lse=True, **fp8)
                self._flashinfer.merge_state_in_place(out, lse, level_out, level_lse)
            else:
                level_out, level_lse = wrapper.run(q.index_select(0, rows), kv_cache, return_lse=True, **fp8)
                merged_out, merged_lse = self._flashinfer.merge_state(
                    out.index_select(0, rows), lse.index_select(0, rows), level_out, level_lse
                )
                out.index_copy_(0, rows, merged_out)
                lse.index_copy_(0, rows, merged_lse)
        return out

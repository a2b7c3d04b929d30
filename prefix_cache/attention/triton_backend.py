"""Cascade attention with the Triton kernels of ``prefix_cache.kernels``.

Per ``run``: one level-attention launch per level, then one merge launch. Every (level, split) of a
query token writes a partial (out, lse) row into one float32 buffer, the token's rows contiguous; the
merge combines them and writes the token's output straight to its engine-order row. The level
kernels read q through the same permutation, so q is never copied. A plan with one level and no
split skips the buffer: that level writes the output directly.
"""

from __future__ import annotations

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend
from prefix_cache.cascade import CascadePlan
from prefix_cache.kernels.attention import LevelSchedule, launch_level, plan_level
from prefix_cache.kernels.merge_state import merge_states_varlen


class TritonBackend(AttentionBackend):
    """Cascade attention on the GPU (or in Triton's interpreter for CPU tensors).

    device: where plans are uploaded and ``run`` expects its tensors; default CUDA when available.
    kv_chunk_size: force a split-KV chunk length in tokens for every level (tests); None lets each
        level choose from its KV lengths and the SM count.
    """

    name = "triton"

    def __init__(self, device: torch.device | str | None = None, *, kv_chunk_size: int | None = None):
        super().__init__()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report their index ("cuda:0"); compare against the same spelling.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kv_chunk_size = kv_chunk_size
        self._query_order = torch.zeros(0, dtype=torch.int64)
        self._direct = False
        self._levels: list[LevelSchedule] = []
        self._o_rows: list[torch.Tensor] = []
        self._part_o: torch.Tensor | None = None
        self._part_lse: torch.Tensor | None = None
        self._starts: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def _prepare(self, plan: CascadePlan) -> None:
        num_qo_heads, num_kv_heads, head_dim = self.num_qo_heads, self.num_kv_heads, self.head_dim
        if not plan.levels:
            raise ValueError("a cascade plan needs at least one level")
        nq = plan.num_query_tokens
        levels = [
            plan_level(
                level.qo_indptr, level.kv_indptr, level.kv_indices, level.kv_last_page_len,
                causal=level.causal, page_size=plan.page_size, num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, device=self.device,
                kv_chunk_size=self.kv_chunk_size,
            )
            for level in plan.levels
        ]  # fmt: skip
        for i, sched in enumerate(levels):
            if sched.num_query_tokens != nq:
                raise ValueError(f"level {i} covers {sched.num_query_tokens} query tokens, the plan has {nq}")
        order = np.asarray(plan.query_order, dtype=np.int64)
        if order.shape != (nq,) or (nq and not np.array_equal(np.sort(order), np.arange(nq))):
            raise ValueError("plan.query_order must be a permutation of the query tokens")

        self._levels = levels
        self._query_order = torch.from_numpy(order).to(self.device)
        rows_per_token = np.sum([s.splits for s in levels], axis=0, dtype=np.int64)
        self._direct = len(levels) == 1 and bool((rows_per_token == 1).all())
        if self._direct:
            # The only partial state is the final one: write it to the output's engine-order rows.
            self._o_rows = [self._query_order]
            self._part_o = None
            self._part_lse = torch.empty((nq, num_qo_heads), dtype=torch.float32, device=self.device)
            return
        starts = np.cumsum(rows_per_token) - rows_per_token
        row, self._o_rows = starts.copy(), []
        for sched in levels:
            self._o_rows.append(torch.from_numpy(row.copy()).to(self.device))
            row += sched.splits
        num_rows = int(rows_per_token.sum())
        self._starts = torch.from_numpy(starts).to(self.device)
        self._counts = torch.from_numpy(rows_per_token.astype(np.int32)).to(self.device)
        self._part_o = torch.empty(
            (num_rows, num_qo_heads, head_dim), dtype=torch.float32, device=self.device
        )
        self._part_lse = torch.empty((num_rows, num_qo_heads), dtype=torch.float32, device=self.device)

    def _run(self, plan: CascadePlan, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        if q.device != self.device:
            raise ValueError(f"q and kv_cache must be on {self.device} (the plan's device), got {q.device}")
        nq = plan.num_query_tokens
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nq == 0:
            return out
        part_o = out if self._direct else self._part_o
        for sched, o_rows in zip(self._levels, self._o_rows, strict=True):
            launch_level(
                sched, q, kv_cache, sm_scale=self.sm_scale, q_rows=self._query_order,
                o_rows=o_rows, out=part_o, lse=self._part_lse,
            )  # fmt: skip
        if not self._direct:
            merge_states_varlen(
                self._part_o, self._part_lse, self._starts, self._counts, out, out_rows=self._query_order
            )
        return out

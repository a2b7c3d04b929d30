"""A plain PyTorch backend: the readable reference for what a cascade plan computes. Any device."""

from __future__ import annotations

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend, check_pool, to_planned_order
from prefix_cache.attention.merge import merge_states
from prefix_cache.planner.plan import CascadeLevel, CascadePlan


class TorchBackend(AttentionBackend):
    """Per level and group: gather the group's pages, softmax attention in float32, then merge the
    levels by their log-sum-exp. One Python iteration per group: for tests and small batches. An
    fp8 cache is read as stored value x the layer's scale, in float32."""

    name = "torch"

    def __init__(self, device: torch.device | str | None = None) -> None:
        """device: where ``plan`` puts the plan's index tensors (those of q at ``run``); None keeps them
        on the CPU and moves them at every ``run``."""
        super().__init__()
        self._device = torch.device("cpu" if device is None else device)
        self._query_order = torch.zeros(0, dtype=torch.int64)
        self._max_page = -1  # the largest page id the current plan reads

    def _prepare(self, plan: CascadePlan) -> None:
        # The gather below would read a negative page id from the pool's end: refuse it here, and
        # compare the largest id with the pool at ``run``, as the other backends do.
        read = [level.kv_indices[: level.kv_indptr[-1]] for level in plan.levels if level.kv_indptr[-1]]
        lowest = min((int(pages.min()) for pages in read), default=0)
        if lowest < 0:
            raise ValueError(f"the plan references page {lowest}: page ids are >= 0")
        self._max_page = max((int(pages.max()) for pages in read), default=-1)
        self._query_order = torch.from_numpy(plan.query_order).to(self._device)

    def _run(
        self,
        plan: CascadePlan,
        q,
        kv_cache,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        check_pool(q.device, self._max_page, q, k)
        query_order = self._query_order.to(q.device)
        q_planned = to_planned_order(q, query_order).float()
        states = [self._attend_level(level, q_planned, k, v, scales) for level in plan.levels]
        merged, _ = merge_states([o for o, _ in states], [s for _, s in states])
        out.index_copy_(0, query_order, merged.to(q.dtype))

    def _attend_level(
        self,
        level: CascadeLevel,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scales: tuple[float, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, Hq, D], lse [T, Hq]) of one level, float32; rows of groups without KV: 0, -inf.
        k_cache, v_cache: [num_pages, page_size, Hkv, D]; scales: their (k_scale, v_scale)."""
        k_scale, v_scale = scales
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
        page_size = k_cache.shape[1]
        pages = torch.from_numpy(level.kv_indices.astype(np.int64)).to(q.device)
        for g in range(level.qo_indptr.shape[0] - 1):
            q0, q1 = int(level.qo_indptr[g]), int(level.qo_indptr[g + 1])
            p0, p1 = int(level.kv_indptr[g]), int(level.kv_indptr[g + 1])
            if q0 == q1 or p0 == p1:
                continue
            kv_len = (p1 - p0 - 1) * page_size + int(level.kv_last_page_len[g])
            k = k_cache[pages[p0:p1]].float().flatten(0, 1)[:kv_len] * k_scale  # [kv_len, Hkv, D]
            v = v_cache[pages[p0:p1]].float().flatten(0, 1)[:kv_len] * v_scale
            out[q0:q1], lse[q0:q1] = self._attend(q[q0:q1], k, v, level.causal)
        return out, lse

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Q, Hq, D], k and v [L, Hkv, D] -> (out [Q, Hq, D], lse [Q, Hq]).

        GQA: query head h reads KV head h // (Hq // Hkv). Causal is bottom-right aligned: the Q
        queries are the segment's last Q tokens, so query j sees keys 0 .. L - Q + j."""
        num_q, num_qo_heads, head_dim = q.shape
        num_k, num_kv_heads, _ = k.shape
        grouped = q.view(num_q, num_kv_heads, num_qo_heads // num_kv_heads, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", grouped, k) * self.sm_scale
        if causal:
            rows = torch.arange(num_q, device=q.device).unsqueeze(1)
            cols = torch.arange(num_k, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(cols > num_k - num_q + rows, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        # A fully masked row (only if Q > L) has lse -inf: subtract 0 so its weights are 0, not NaN.
        probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
        out = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(num_q, num_qo_heads, head_dim)
        return out, lse.permute(2, 0, 1).reshape(num_q, num_qo_heads)

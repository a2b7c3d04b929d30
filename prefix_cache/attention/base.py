"""The attention backend interface: plan once per batch on the host, run once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from prefix_cache.cascade import CascadePlan


class AttentionBackend(ABC):
    """Computes attention for a batch described by a ``CascadePlan``.

    Usage per engine step: ``backend.plan(plan, ...)`` once (host-side work, uploads of the plan's
    index arrays), then ``backend.run(q, kv_cache)`` for every layer.
    """

    #: The name ``create_backend`` knows this backend by.
    name: str

    @abstractmethod
    def plan(
        self,
        plan: CascadePlan,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sm_scale: float | None = None,
    ) -> None:
        """Prepare to run ``plan``. ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA);
        ``sm_scale`` defaults to ``head_dim ** -0.5``."""

    @abstractmethod
    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the planned batch for one layer.

        q: [num_query_tokens, num_qo_heads, head_dim], the engine's request order (request 0's query
            tokens first), fp16, bf16 or fp32.
        kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (K at index 0, V at 1; NHD), same dtype.
        Returns [num_query_tokens, num_qo_heads, head_dim] in q's dtype and order.
        """

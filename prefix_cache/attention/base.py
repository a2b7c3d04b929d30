"""The attention backend interface: plan once per batch on the host, run once per layer.

Also the checks and the query permutation that every backend shares, so that they agree on what a
valid call is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from prefix_cache.cascade import CascadePlan

#: Query/KV dtypes the interface accepts (a backend may accept fewer and says so when run).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AttentionBackend(ABC):
    """Computes attention for a batch described by a ``CascadePlan``.

    Usage per engine step: ``backend.plan(plan, ...)`` once (host-side work, uploads of the plan's
    index arrays), then ``backend.run(q, kv_cache)`` for every layer. This class checks the arguments
    and keeps the planned shapes; a backend implements ``_prepare`` and ``_run``.
    """

    #: The name ``create_backend`` knows this backend by.
    name: str

    def __init__(self) -> None:
        self._plan: CascadePlan | None = None
        self.num_qo_heads = self.num_kv_heads = self.head_dim = 0
        self.sm_scale = 1.0

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
        ``sm_scale`` defaults to ``head_dim ** -0.5``. If this raises, the backend holds no plan."""
        scale = check_plan_args(num_qo_heads, num_kv_heads, head_dim, sm_scale)
        self._plan = None
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.sm_scale = scale
        self._prepare(plan)
        self._plan = plan

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the planned batch for one layer.

        q: [num_query_tokens, num_qo_heads, head_dim], the engine's request order (request 0's query
            tokens first), fp16, bf16 or fp32.
        kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (K at index 0, V at 1; NHD), same dtype.
        Returns [num_query_tokens, num_qo_heads, head_dim] in q's dtype and order.
        """
        plan = check_run_args(
            self._plan,
            q,
            kv_cache,
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        return self._run(plan, q, kv_cache)

    @abstractmethod
    def _prepare(self, plan: CascadePlan) -> None:
        """The backend's host-side work for ``plan``; the head counts and ``sm_scale`` are set."""

    @abstractmethod
    def _run(self, plan: CascadePlan, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``run`` on arguments already checked against ``plan``."""


def check_plan_args(num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float | None) -> float:
    """Validate ``plan``'s keyword arguments; returns the softmax scale to use."""
    if num_kv_heads < 1 or num_qo_heads < 1 or head_dim < 1:
        raise ValueError(
            "num_qo_heads, num_kv_heads and head_dim must be >= 1, "
            f"got {num_qo_heads}, {num_kv_heads}, {head_dim}"
        )
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return head_dim**-0.5 if sm_scale is None else float(sm_scale)


def check_run_args(
    plan: CascadePlan | None,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> CascadePlan:
    """Validate ``run``'s tensors against the plan and the planned shapes; returns the plan."""
    if plan is None:
        raise RuntimeError("run() called before plan()")
    expected_q = (plan.num_query_tokens, num_qo_heads, head_dim)
    if tuple(q.shape) != expected_q:
        raise ValueError(f"q has shape {tuple(q.shape)}, the plan needs {expected_q}")
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[1] != 2
        or tuple(kv_cache.shape[2:])
        != (
            plan.page_size,
            num_kv_heads,
            head_dim,
        )
    ):
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}, the plan needs "
            f"[num_pages, 2, {plan.page_size}, {num_kv_heads}, {head_dim}]"
        )
    if q.dtype not in SUPPORTED_DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(
            f"q and kv_cache must share one of {SUPPORTED_DTYPES}, got {q.dtype}, {kv_cache.dtype}"
        )
    if q.device != kv_cache.device:
        raise ValueError(f"q is on {q.device}, kv_cache on {kv_cache.device}")
    return plan


def to_planned_order(x: torch.Tensor, query_order: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (engine order) in planned order. query_order: int64 [num_query_tokens], on x's device."""
    return x.index_select(0, query_order)


def to_engine_order(x: torch.Tensor, query_order: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_planned_order``: rows of ``x`` (planned order) back in the engine's order."""
    out = torch.empty_like(x)
    out.index_copy_(0, query_order, x)
    return out

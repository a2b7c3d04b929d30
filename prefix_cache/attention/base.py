"""The attention backend interface: plan once per batch on the host, run once per layer.

Also the checks and the query permutation that every backend shares, so that they agree on what a
valid call is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, KVCache, check_kv_scales, split_kv_cache
from prefix_cache.planner.plan import CascadePlan

#: Query/KV dtypes the interface accepts (a backend may accept fewer and says so when run).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: KV dtypes: q's, or fp8 with per-layer K and V scales (``FP8_KV_DTYPE``) for a q of any of the above.
KV_DTYPES = (*SUPPORTED_DTYPES, FP8_KV_DTYPE)


class AttentionBackend(ABC):
    """Computes attention for a batch described by a ``CascadePlan``.

    Usage per engine step: ``backend.plan(plan, ...)`` once (host-side work, uploads of the plan's
    index arrays, every check that does not depend on the layer), then ``backend.run(q, kv_cache)``
    for every layer, which only checks what a layer can change (shapes, dtype, device). This class
    does those checks and keeps the planned shapes; a backend implements ``_prepare`` and ``_run``.
    """

    #: The name ``create_backend`` knows this backend by.
    name: str

    def __init__(self) -> None:
        self._plan: CascadePlan | None = None
        self.num_qo_heads = self.num_kv_heads = self.head_dim = 0
        self.sm_scale = 1.0
        #: The dtype of q given to ``plan``, or None: fixed by each ``run``.
        self.dtype: torch.dtype | None = None
        #: The KV cache's dtype given to ``plan`` (q's, or ``FP8_KV_DTYPE``), or None: fixed by each ``run``.
        self.kv_dtype: torch.dtype | None = None
        # Query rows run() accepts: exactly the plan's, or up to this many (fixed-capacity backends,
        # whose extra rows are padding).
        self._max_query_rows: int | None = None

    def plan(
        self,
        plan: CascadePlan,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sm_scale: float | None = None,
        q_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Prepare to run ``plan``. ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA);
        ``sm_scale`` defaults to ``head_dim ** -0.5``. ``q_dtype`` (one of ``SUPPORTED_DTYPES``) and
        ``kv_dtype`` (q's, its default, or ``torch.float8_e4m3fn`` for an fp8 cache) let a backend
        finish its planning here (FlashInfer needs them); without them it may finish at the first
        ``run``. If this raises, the backend holds no plan."""
        scale = check_plan_args(num_qo_heads, num_kv_heads, head_dim, sm_scale)
        dtype, kv = check_plan_dtypes(q_dtype, kv_dtype)
        self._plan = None
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.sm_scale = scale
        self.dtype, self.kv_dtype = dtype, kv
        self._prepare(plan)
        self._plan = plan

    def run(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        *,
        out: torch.Tensor | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        """Attention of the planned batch for one layer.

        q: [num_query_tokens, num_qo_heads, head_dim], the engine's request order (request 0's query
            tokens first), fp16, bf16 or fp32 (the planned dtype, if one was given).
        kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (K at index 0, V at 1; NHD), or a
            (k_cache, v_cache) pair of [num_pages, page_size, num_kv_heads, head_dim] tensors of any
            strides (see ``prefix_cache.attention.kv_layout``); q's device, q's dtype or fp8
            (``torch.float8_e4m3fn``, the planned ``kv_dtype`` if one was given).
        out: optional [num_query_tokens, num_qo_heads, head_dim] tensor in q's dtype to write into
            (no allocation); a new one otherwise.
        k_scale, v_scale: the layer's scales of an fp8 cache (K and V are read as stored x scale),
            positive and finite, default 1; only for an fp8 cache.
        Returns the output, [num_query_tokens, num_qo_heads, head_dim] in q's dtype and order.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        k, v = split_kv_cache(kv_cache)
        check_run_tensors(self, plan, q, k)
        scales = check_kv_scales(k.dtype, k_scale, v_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
            raise ValueError(
                f"out must be like q ({tuple(q.shape)}, {q.dtype}, {q.device}), got "
                f"{tuple(out.shape)}, {out.dtype}, {out.device}"
            )
        self._run(plan, q, kv_cache, k, v, out, scales)
        return out

    @property
    def graph_key(self) -> str | None:
        """For a backend whose ``run`` replays from CUDA graphs across plans (one with a
        ``GraphCapacity``): the name of the fixed sequence of launches ``run`` makes for the current
        plan. A graph captured after a plan replays after any later plan with the same key; an engine
        keeps one graph per key. None for a backend without a capacity."""
        return None

    @abstractmethod
    def _prepare(self, plan: CascadePlan) -> None:
        """The backend's host-side work for ``plan``; the head counts, ``sm_scale`` and ``dtype`` are set."""

    @abstractmethod
    def _run(
        self,
        plan: CascadePlan,
        q: torch.Tensor,
        kv_cache: KVCache,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scales: tuple[float, float],
    ) -> None:
        """``run`` on arguments already checked against ``plan``: write the output into ``out``.
        ``k`` and ``v`` are the [num_pages, page_size, Hkv, D] views of ``kv_cache``; ``scales`` its
        (k_scale, v_scale), (1, 1) unless it is fp8."""


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


def check_plan_dtypes(
    q_dtype: torch.dtype | None, kv_dtype: torch.dtype | None
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The planned dtypes of q and of the KV cache (None: not given). A KV dtype other than fp8
    is q's (either one given stands for both)."""
    if q_dtype is not None and q_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q_dtype must be one of {SUPPORTED_DTYPES}, got {q_dtype}")
    if kv_dtype is None:
        return q_dtype, q_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype}")
    if kv_dtype == FP8_KV_DTYPE:
        return q_dtype, kv_dtype
    if q_dtype is not None and kv_dtype != q_dtype:
        raise ValueError(f"kv_dtype ({kv_dtype}) must equal q_dtype ({q_dtype}) or be {FP8_KV_DTYPE}")
    return kv_dtype, kv_dtype


def check_run_tensors(backend: AttentionBackend, plan: CascadePlan, q: torch.Tensor, k: torch.Tensor) -> None:
    """Validate ``run``'s q and K view against the plan and the planned shapes (a handful of
    comparisons: everything that cannot change between layers was checked by ``plan``)."""
    rows = q.shape[0]
    ok_rows = rows == plan.num_query_tokens or (
        backend._max_query_rows is not None and plan.num_query_tokens <= rows <= backend._max_query_rows
    )
    if q.dim() != 3 or not ok_rows or q.shape[1] != backend.num_qo_heads or q.shape[2] != backend.head_dim:
        raise ValueError(
            f"q has shape {tuple(q.shape)}, the plan needs "
            f"{(plan.num_query_tokens, backend.num_qo_heads, backend.head_dim)}"
        )
    if k.shape[1] != plan.page_size or k.shape[2] != backend.num_kv_heads or k.shape[3] != backend.head_dim:
        raise ValueError(
            f"kv_cache has pages of {tuple(k.shape[1:])}, the plan needs "
            f"[num_pages, 2, {plan.page_size}, {backend.num_kv_heads}, {backend.head_dim}] "
            "or (k, v) of [num_pages, page_size, num_kv_heads, head_dim]"
        )
    dtype, kv_dtype = backend.dtype, backend.kv_dtype
    if (
        (dtype is not None and q.dtype != dtype)
        or (kv_dtype is not None and k.dtype != kv_dtype)
        or q.dtype not in SUPPORTED_DTYPES
        or (k.dtype != q.dtype and k.dtype != FP8_KV_DTYPE)
    ):
        raise ValueError(
            f"q and kv_cache must share one of {SUPPORTED_DTYPES}, or kv_cache be {FP8_KV_DTYPE}"
            + (f" (planned: {dtype}, {kv_dtype})" if dtype is not None or kv_dtype is not None else "")
            + f", got {q.dtype}, {k.dtype}"
        )
    if q.device != k.device:
        raise ValueError(f"q is on {q.device}, kv_cache on {k.device}")
    if q.stride(-1) != 1:
        raise ValueError("the head_dim axis of q must be contiguous")


def check_pool(device: torch.device, max_page: int, q: torch.Tensor, k: torch.Tensor) -> None:
    """``run``'s check of a backend that reads the pool through the plan's page ids: q on the plan's
    ``device``, and every page id of the plan (at most ``max_page``) inside the pool ``k``."""
    if q.device != device:
        raise ValueError(f"q and kv_cache must be on {device} (the plan's device), got {q.device}")
    if max_page >= k.shape[0]:
        raise ValueError(f"the plan references page {max_page}, the KV cache has {k.shape[0]} pages")


def reused_buffer(
    stores: dict[str, torch.Tensor], name: str, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The first ``numel`` elements of ``stores[name]``, a device buffer kept across plans and remade
    (doubling) when too small or of another dtype: a step's plan allocates nothing in the steady
    state. Kernels of the previous step that still read it run earlier on the same stream."""
    store = stores.get(name)
    if store is None or store.dtype != dtype or store.numel() < numel:
        grown = 0 if store is None or store.dtype != dtype else 2 * store.numel()
        store = stores[name] = torch.empty(max(numel, grown), dtype=dtype, device=device)
    return store[:numel]


def in_engine_order(query_order: np.ndarray) -> bool:
    """True when planned query token t is the engine's token t for every t (``CascadePlanner``'s
    one-level plans): a backend then passes q and its output through without a gather or scatter."""
    return bool(np.array_equal(query_order, np.arange(query_order.shape[0])))


def to_planned_order(x: torch.Tensor, query_order: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (engine order) in planned order. query_order: int64 [num_query_tokens], on x's device."""
    return x.index_select(0, query_order)

"""The default backend for engines: per plan, our Triton kernels or FlashInfer's, whichever is faster.

Routes, chosen once per ``plan`` from the plan's shape (``choose_route``; thresholds measured on an
H200, see benchmarks/results/):

- ``triton``: our kernels for every level (shared prefixes, decode, short chunks).
- ``flashinfer``: a plan of one level whose requests prefill long chunks runs on FlashInfer's paged
  prefill wrapper (FA3 on Hopper), which our Triton kernel does not match on compute-bound prefill;
  plain decode of one level runs there too when ``Routing.decode_to_flashinfer``.
- ``hybrid``: a cascade whose last level prefills long chunks: the shared levels on our kernels, the
  last level on FlashInfer's prefill wrapper, its state (base-2 LSE converted) written into our
  partial rows and merged by our merge kernel.

FlashInfer is used only where it is importable, the device is CUDA, ``plan`` was given ``q_dtype``
and the backend has no ``GraphCapacity`` (a CUDA graph replays one fixed set of launches: with a
capacity every plan takes the Triton route, which is graph-safe across plans).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend
from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend
from prefix_cache.cascade import CascadePlan

_LN2 = math.log(2.0)


@dataclass(frozen=True)
class Routing:
    """When the auto backend leaves our kernels for FlashInfer's.

    prefill_min_tokens: a request with at least this many query tokens this step is a prefill chunk;
        a level whose prefill chunks hold at least ``prefill_level_tokens`` query tokens in all goes
        to FlashInfer's prefill wrapper (the whole plan if it has one level, the last level if not).
    decode_to_flashinfer: plain one-level decode on FlashInfer's decode wrapper.
    """

    prefill_min_tokens: int = 64
    prefill_level_tokens: int = 512
    decode_to_flashinfer: bool = False


def choose_route(plan: CascadePlan, routing: Routing) -> str:
    """``"triton"``, ``"flashinfer"`` or ``"hybrid"`` for ``plan`` (see the module docstring)."""
    last = plan.levels[-1]
    q_len = np.diff(last.qo_indptr.astype(np.int64))
    chunks = q_len[q_len >= routing.prefill_min_tokens]
    prefill_heavy = int(chunks.sum()) >= routing.prefill_level_tokens
    if len(plan.levels) == 1:
        if prefill_heavy:
            return "flashinfer"
        if routing.decode_to_flashinfer and q_len.size and bool((q_len <= 1).all()):
            return "flashinfer"
        return "triton"
    return "hybrid" if prefill_heavy else "triton"


class AutoBackend(AttentionBackend):
    """Cascade attention on the fastest kernels for each plan; see the module docstring.

    device: CUDA device (default: the current one; CPU tensors run the Triton route in Triton's
        interpreter). capacity: see ``GraphCapacity`` (forces the Triton route). routing: thresholds.
    """

    name = "auto"

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        capacity: GraphCapacity | None = None,
        routing: Routing | None = None,
        workspace_bytes: int = 128 * 1024 * 1024,
    ) -> None:
        super().__init__()
        self._triton = TritonBackend(device, capacity=capacity)
        self.device = self._triton.device
        self._max_query_rows = self._triton._max_query_rows
        self.routing = routing or Routing()
        self._fi_module = None
        if capacity is None and self.device.type == "cuda":
            try:
                import flashinfer
            except ModuleNotFoundError:
                flashinfer = None
            self._fi_module = flashinfer
        self._workspace_bytes = workspace_bytes
        self._fi_backend = None  # FlashInferBackend, made on first use
        self._prefill = None  # FlashInfer prefill wrapper of the hybrid route, made on first use
        self.route = "triton"
        self._query_order: torch.Tensor | None = None

    def _prepare(self, plan: CascadePlan) -> None:
        heads = dict(
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            sm_scale=self.sm_scale, q_dtype=self.dtype,
        )  # fmt: skip
        route = "triton"
        if (
            self._fi_module is not None
            and self.dtype in (torch.float16, torch.bfloat16)
            and plan.num_query_tokens
        ):
            route = choose_route(plan, self.routing)
        if route == "flashinfer":
            if self._fi_backend is None:
                from prefix_cache.attention.flashinfer_backend import FlashInferBackend

                self._fi_backend = FlashInferBackend(self.device, self._workspace_bytes)
            self._fi_backend.plan(plan, **heads)
        else:
            self._triton._external_last_level = route == "hybrid"
            self._triton.plan(plan, **heads)
            if route == "hybrid":
                self._plan_last_level(plan)
        self.route = route

    def _plan_last_level(self, plan: CascadePlan) -> None:
        """FlashInfer's prefill wrapper over the plan's last level (planned query order)."""
        from prefix_cache.attention.flashinfer_backend import compact_level

        level = compact_level(plan.levels[-1])
        if self._prefill is None:
            workspace = torch.empty(self._workspace_bytes, dtype=torch.uint8, device=self.device)
            self._prefill = self._fi_module.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill.plan(
            *[torch.from_numpy(a) for a in (level.qo_indptr, level.kv_indptr, level.kv_indices)],
            torch.from_numpy(level.kv_last_page_len),
            self.num_qo_heads, self.num_kv_heads, self.head_dim, plan.page_size,
            causal=True, sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )  # fmt: skip
        self._level_rows = None if level.rows is None else torch.from_numpy(level.rows).to(self.device)
        self._query_order = torch.from_numpy(plan.query_order).to(self.device)

    def _run(self, plan, q, kv_cache, k, v, out) -> None:
        if self.route == "flashinfer":
            self._fi_backend._run(plan, q, kv_cache, k, v, out)
            return
        triton = self._triton
        if self.route == "triton":
            triton._run(plan, q, kv_cache, k, v, out)
            return
        # Hybrid: shared levels on our kernels, the last level on FlashInfer, merged by ours.
        triton._run(plan, q, kv_cache, k, v, out)  # launches the shared levels only
        paged = kv_cache if isinstance(kv_cache, torch.Tensor) else (k, v)
        q_planned = q.index_select(0, self._query_order)
        rows = triton.last_level_rows
        if self._level_rows is not None:  # some queries have no KV at the last level
            q_planned = q_planned.index_select(0, self._level_rows)
            rows = rows.index_select(0, self._level_rows)
        level_out, level_lse = self._prefill.run(q_planned, paged, return_lse=True)
        part_o, part_lse = triton.partial_states
        part_o.index_copy_(0, rows, level_out.float())
        part_lse.index_copy_(0, rows, level_lse * _LN2)  # FlashInfer's LSE is base 2
        triton.merge(out)

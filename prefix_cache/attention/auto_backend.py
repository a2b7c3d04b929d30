"""The default backend for engines: per plan, our Triton kernels or FlashInfer's, whichever is faster.

Routes, chosen once per ``plan`` from the plan's shape (``choose_route``; the rule and its thresholds
come from the side-by-side measurements in benchmarks/results/attention_h200.md):

- ``flashinfer``: a plan whose requests prefill long chunks (compute-bound: FlashInfer's FA3 prefill
  on Hopper is about 2x our Triton kernel there), on FlashInfer's prefill or multi-level cascade
  wrapper; and plain one-level decode with a GQA group of at most 8, on FlashInfer's tensor-core
  decode wrapper (faster than ours on small unshared batches).
- ``triton``: everything else, in particular every decode batch with shared levels.

FlashInfer is used only where it is importable, the device is CUDA, ``plan`` was given ``q_dtype``
(fp16 or bf16) and the backend has no ``GraphCapacity``: a CUDA graph replays one fixed set of
launches, so with a capacity every plan takes the Triton route, which is graph-safe across plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend
from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend
from prefix_cache.cascade import CascadePlan


@dataclass(frozen=True)
class Routing:
    """When the auto backend leaves our kernels for FlashInfer's.

    prefill_min_tokens: a request with at least this many query tokens this step is a prefill chunk;
        a plan whose prefill chunks hold at least ``prefill_tokens`` query tokens in all runs on
        FlashInfer.
    decode_max_group: one-level decode plans (one query per request) run on FlashInfer's decode
        wrapper when the GQA group (query heads per KV head) is at most this; 0 never.
    """

    prefill_min_tokens: int = 64
    prefill_tokens: int = 512
    decode_max_group: int = 8


def choose_route(plan: CascadePlan, group_size: int, routing: Routing) -> str:
    """``"triton"`` or ``"flashinfer"`` for ``plan`` (see the module docstring)."""
    last = plan.levels[-1]
    q_len = np.diff(last.qo_indptr.astype(np.int64))
    chunks = q_len[q_len >= routing.prefill_min_tokens]
    if int(chunks.sum()) >= routing.prefill_tokens:
        return "flashinfer"
    decode = q_len.size > 0 and bool((q_len <= 1).all())
    if len(plan.levels) == 1 and decode and group_size <= routing.decode_max_group:
        return "flashinfer"
    return "triton"


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
        self.route = "triton"

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
            route = choose_route(plan, self.num_qo_heads // self.num_kv_heads, self.routing)
        if route == "flashinfer":
            if self._fi_backend is None:
                from prefix_cache.attention.flashinfer_backend import FlashInferBackend

                self._fi_backend = FlashInferBackend(self.device, self._workspace_bytes)
            self._fi_backend.plan(plan, **heads)
        else:
            self._triton.plan(plan, **heads)
        self.route = route

    def _run(self, plan, q, kv_cache, k, v, out) -> None:
        backend = self._fi_backend if self.route == "flashinfer" else self._triton
        backend._run(plan, q, kv_cache, k, v, out)

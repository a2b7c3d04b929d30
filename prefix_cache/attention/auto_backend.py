"""The default backend for engines: per plan, our Triton kernels or FlashInfer's, whichever is faster.

Routes, chosen once per ``plan`` from the plan's shape (``choose_route``; the rule and its thresholds
come from the side-by-side measurements in benchmarks/results/attention_h200.md):

- ``flashinfer``: a plan whose requests prefill long chunks (compute-bound: FlashInfer's FA3 prefill
  on Hopper is about 2x our Triton kernel there), on FlashInfer's prefill or multi-level cascade
  wrapper; and plain one-level decode with a GQA group of at most 8, on FlashInfer's tensor-core
  decode wrapper (faster than ours on small unshared batches).
- ``flashinfer`` too, eager only: a small decode cascade (``Routing.eager_flat_kv_bytes``) as its
  one-level plan (``one_level_decode``) on that decode wrapper: one launch where ours make two.
- ``triton``: everything else, in particular every other decode batch with shared levels. On Hopper, a
  long shared level with many query rows (``LevelRule``) runs there on FlashInfer's FA3 kernel, its
  KV split by hand, merged with our kernels' other levels
  (``prefix_cache.attention.flashinfer_levels``; ``route`` is then ``"triton+fa3"``). A cascade
  with prefill chunks whose shared level FA3 takes runs there too, not on FlashInfer's cascade
  wrapper: FA3 on the long level beside our launches ran faster than that wrapper on every such
  batch measured (benchmarks/NOTES.md, "FA3 levels under a capacity").

FlashInfer is used only where it is importable, the device is CUDA and ``plan`` was given
``q_dtype`` (fp16 or bf16). An fp8 cache (``kv_dtype=torch.float8_e4m3fn``) takes the same routes
with FlashInfer's fp8 support (its FA2 kernels: FA3 takes fp8 KV only beside an fp8 q), except FA3's:
shared levels stay on our kernels, and under a capacity FlashInfer's prefill graph becomes
``"triton"``.

With a ``GraphCapacity`` (``run`` captured in CUDA graphs and replayed across plans), a causal plan
of one level whose requests all have KV, that the rule sends to FlashInfer, runs on FlashInfer's
CUDA-graph prefill wrappers (``prefix_cache.attention.flashinfer_graphs``: FA2 for decode, FA3 on
Hopper for prefill and for a decode of one or two short requests), except a decode of many requests
(``Routing.graph_triton_decodes``), and every other plan on the fixed-capacity Triton backend, on
Hopper with its ``LevelRule`` level on FA3's CUDA-graph mode. Those are seven fixed sequences of
launches (``"flashinfer-decode"``, ``"flashinfer-prefill"``, ``"triton"``, ``"triton-mid"``,
``"triton-narrow"``, ``"triton-decode"``, ``"triton+fa3"``), one graph each:
``graph_key`` names the current plan's, and a graph captured under one key replays after any later
plan with the same key. An engine keeps a graph per (batch bucket, key).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache.attention.base import AttentionBackend, check_pool, in_engine_order
from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer
from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, flashinfer_paged
from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend, checked_levels
from prefix_cache.planner.kv_split import DECODE_TILE_ROWS, MIN_SPLIT_TOKENS, min_split_tokens
from prefix_cache.planner.plan import CascadePlan, one_level_decode


@dataclass(frozen=True)
class Routing:
    """When the auto backend leaves our kernels for FlashInfer's.

    prefill_min_tokens: a request with at least this many query tokens this step is a prefill chunk;
        a plan whose prefill chunks hold at least ``prefill_tokens`` query tokens in all runs on
        FlashInfer.
    decode_max_group: one-level decode plans (one query per request) run on FlashInfer's decode
        wrapper when the GQA group (query heads per KV head) is at most this; 0 never.
    graph_triton_decodes: under a ``GraphCapacity``, such decode plans of at least this many
        requests stay on our Triton kernels: FlashInfer's CUDA-graph mode splits every request's KV
        and pads its grid to the capacity, where our fixed launches split only what fills the
        device; from this many requests up, and at head dims up to 128 (where a lone level splits
        from ``kv_split.ONE_LEVEL_MIN_SPLIT_TOKENS``), our launches replayed as fast or faster
        (benchmarks/NOTES.md, "routes of one-level decodes replayed in graphs" and "a lone level of
        decodes splits from 128 tokens").
    graph_triton_decodes_large_heads: ``graph_triton_decodes`` for head dims over 128, whose lone
        levels keep the longer split floor (``kv_split.min_split_tokens``), so FlashInfer's graph
        stays ahead up to more requests.
    graph_fa3_decodes, graph_fa3_decode_kv: under a ``GraphCapacity``, such decode plans of at most
        ``graph_fa3_decodes`` requests, none over ``graph_fa3_decode_kv`` KV tokens, run on
        FlashInfer's prefill kernels (FA3 on Hopper), which do not split: on one or two short
        requests that beats its split decode kernels' fixed cost, while longer KV or more requests
        ran slower on it.
    eager_flat_kv_bytes: without a capacity, a decode cascade whose one-level plan reads at most
        this many bytes of K and V runs as that plan on FlashInfer's decode wrapper (GQA groups up
        to ``decode_max_group``); 0 never. Eager, such a batch is bound by host time: FlashInfer's
        one decode launch costs the host less than our attention and merge launches, so it wins
        while the one level's GPU time, which grows because it reads the shared pages once per
        request, stays under our launches' host time. The default is about the bytes the device
        copies in that host time (benchmarks/NOTES.md, "the eager flat route up to 256 MiB"; per
        batch in benchmarks/results/eager_routes_h200.md).
    """

    prefill_min_tokens: int = 64
    prefill_tokens: int = 512
    decode_max_group: int = 8
    graph_triton_decodes: int = 8
    graph_triton_decodes_large_heads: int = 16
    graph_fa3_decodes: int = 2
    graph_fa3_decode_kv: int = 256
    eager_flat_kv_bytes: int = 256 * 2**20


def choose_route(plan: CascadePlan, group_size: int, routing: Routing) -> str:
    """``"triton"`` or ``"flashinfer"`` for ``plan`` (see the module docstring), eager."""
    last = plan.levels[-1]
    q_len = np.diff(last.qo_indptr.astype(np.int64))
    chunks = q_len[q_len >= routing.prefill_min_tokens]
    if int(chunks.sum()) >= routing.prefill_tokens:
        return "flashinfer"
    decode = q_len.size > 0 and bool((q_len <= 1).all())
    if len(plan.levels) == 1 and decode and group_size <= routing.decode_max_group:
        return "flashinfer"
    return "triton"


def choose_flat_decode(
    plan: CascadePlan, group_size: int, num_kv_heads: int, head_dim: int, itemsize: int, routing: Routing
) -> CascadePlan | None:
    """For an eager plan of several levels: its one-level plan (``one_level_decode``) where
    ``Routing.eager_flat_kv_bytes`` sends it to FlashInfer's decode wrapper, else None. itemsize:
    bytes per K or V element. Raises ValueError for a malformed plan (``checked_levels``), as the
    Triton route's ``plan`` would."""
    if routing.eager_flat_kv_bytes <= 0 or len(plan.levels) < 2 or group_size > routing.decode_max_group:
        return None
    # The pages the one level would read (each group's once per query row), before building it.
    pages = sum(
        int((np.diff(lv.kv_indptr.astype(np.int64)) * np.diff(lv.qo_indptr.astype(np.int64))).sum())
        for lv in plan.levels
    )
    if pages * plan.page_size * num_kv_heads * head_dim * 2 * itemsize > routing.eager_flat_kv_bytes:
        return None
    checked_levels(plan)
    return one_level_decode(plan)


def choose_graph_key(plan: CascadePlan, group_size: int, head_dim: int, routing: Routing) -> str:
    """The launches of ``plan`` under a ``GraphCapacity``: for a causal one-level plan in the engine's
    order, every request with queries and KV, that ``choose_route`` sends to FlashInfer,
    ``"flashinfer-prefill"`` (some request has several query tokens, or a decode of few short
    requests) or ``"flashinfer-decode"`` (a decode of fewer than ``graph_triton_decodes`` requests);
    ``"triton"`` otherwise (the Triton backend also raises for a malformed plan). See ``Routing``."""
    if len(plan.levels) != 1 or choose_route(plan, group_size, routing) != "flashinfer":
        return "triton"
    level = plan.levels[0]
    q_len = np.diff(level.qo_indptr.astype(np.int64))
    pages = np.diff(level.kv_indptr.astype(np.int64))
    if (
        not level.causal
        or not in_engine_order(plan.query_order)
        or int(level.qo_indptr[-1]) != plan.num_query_tokens
        # FlashInfer's fixed batch gives every request a query row; a request without KV is left to
        # the Triton kernels, as the eager FlashInfer backend leaves it out of its levels.
        or (q_len < 1).any()
        or (pages < 1).any()
    ):
        return "triton"
    if not bool((q_len == 1).all()):
        return "flashinfer-prefill"
    large = min_split_tokens(1, DECODE_TILE_ROWS, head_dim) == MIN_SPLIT_TOKENS
    if q_len.size >= (routing.graph_triton_decodes_large_heads if large else routing.graph_triton_decodes):
        return "triton"
    kv_tokens = (pages - 1) * plan.page_size + level.kv_last_page_len.astype(np.int64)
    if q_len.size <= routing.graph_fa3_decodes and int(kv_tokens.max()) <= routing.graph_fa3_decode_kv:
        return "flashinfer-prefill"
    return "flashinfer-decode"


class AutoBackend(AttentionBackend):
    """Cascade attention on the fastest kernels for each plan; see the module docstring.

    device: CUDA device (default: the current one; CPU tensors run the Triton route in Triton's
        interpreter). capacity: see ``GraphCapacity`` and the module docstring. routing: thresholds.
        level_rule: which shared levels run on FlashInfer's FA3 (Hopper only).
    """

    name = "auto"

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        capacity: GraphCapacity | None = None,
        routing: Routing | None = None,
        workspace_bytes: int = 128 * 1024 * 1024,
        level_rule: LevelRule | None = None,
    ) -> None:
        super().__init__()
        self._triton = TritonBackend(device, capacity=capacity)
        self.device = self._triton.device
        self.capacity = capacity
        self._max_query_rows = self._triton._max_query_rows
        self.routing = routing or Routing()
        self._fi_module = None
        if self.device.type == "cuda":
            try:
                import flashinfer
            except ModuleNotFoundError:
                flashinfer = None
            self._fi_module = flashinfer
            # FA3 is Hopper's.
            hopper = torch.cuda.get_device_capability(self.device)[0] == 9
            if flashinfer is not None and hopper:
                self._triton._shared_levels = SharedLevelsOnFlashInfer(
                    flashinfer, self.device, level_rule, capacity=capacity
                )
        self._workspace_bytes = workspace_bytes
        self._fi_backend = None  # FlashInferBackend, made on first use (no capacity)
        self._fi_graphs = None  # OneLevelGraphs, made on first use (with a capacity)
        self.route = "triton"
        self._graph_key = "triton"

    @property
    def graph_key(self) -> str | None:
        return None if self.capacity is None else self._graph_key

    def _prepare(self, plan: CascadePlan) -> None:
        heads = dict(
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            sm_scale=self.sm_scale,
        )  # fmt: skip
        group = self.num_qo_heads // self.num_kv_heads
        flashinfer = (
            self._fi_module is not None
            and self.dtype in (torch.float16, torch.bfloat16)
            and plan.num_query_tokens > 0
        )
        if self.capacity is not None:
            key = choose_graph_key(plan, group, self.head_dim, self.routing) if flashinfer else "triton"
            if key.startswith("flashinfer") and self.kv_dtype == FP8_KV_DTYPE:
                # FlashInfer applies the V scale as a separate multiply over the rows of ``out`` it
                # is given at capture, which a replay of a plan with other rows would scale wrong;
                # its prefill graph is FA3, which takes fp8 KV only beside an fp8 q.
                key = "triton"
            if key == "triton":
                self._triton.plan(plan, **heads, q_dtype=self.dtype, kv_dtype=self.kv_dtype)
                key = self._triton.graph_key
            else:
                if self._fi_graphs is None:
                    from prefix_cache.attention.flashinfer_graphs import OneLevelGraphs

                    self._fi_graphs = OneLevelGraphs(
                        self._fi_module, self.device, self.capacity, self._workspace_bytes
                    )
                kind = key.removeprefix("flashinfer-")
                self._fi_graphs.plan(kind, plan.levels[0], plan.page_size, heads, (self.dtype, self.kv_dtype))
            self._graph_key = key
            self.route = key if key.startswith("triton") else "flashinfer"
            return
        route = choose_route(plan, group, self.routing) if flashinfer else "triton"
        if route == "flashinfer" and len(plan.levels) > 1 and self._fa3_takes_a_level(plan):
            route = "triton"
        if route == "triton" and flashinfer:
            flat = choose_flat_decode(
                plan, group, self.num_kv_heads, self.head_dim, self.kv_dtype.itemsize, self.routing
            )
            if flat is not None:
                plan, route = flat, "flashinfer"
        if route == "flashinfer":
            if self._fi_backend is None:
                from prefix_cache.attention.flashinfer_backend import FlashInferBackend

                self._fi_backend = FlashInferBackend(self.device, self._workspace_bytes)
            self._fi_backend.plan(plan, **heads, q_dtype=self.dtype, kv_dtype=self.kv_dtype)
        else:
            self._triton.plan(plan, **heads, q_dtype=self.dtype, kv_dtype=self.kv_dtype)
            route = "triton+fa3" if self._triton._external else "triton"
        self.route = route

    def _fa3_takes_a_level(self, plan: CascadePlan) -> bool:
        """Whether the Triton backend would run one of ``plan``'s shared levels on FA3."""
        shared = self._triton._shared_levels
        if shared is None:
            return False
        causal = [lv.causal for lv in plan.levels]
        heads = (self.num_qo_heads, self.num_kv_heads)
        return shared.take(checked_levels(plan), causal, heads, self.head_dim, self.kv_dtype) is not None

    def _run(self, plan, q, kv_cache, k, v, out, scales=(1.0, 1.0)) -> None:
        if self.route.startswith("triton"):
            self._triton._run(plan, q, kv_cache, k, v, out, scales)
        elif self.capacity is not None:
            check_pool(self.device, self._fi_graphs.max_page, q, k)
            self._fi_graphs.run(
                self._graph_key.removeprefix("flashinfer-"), q, flashinfer_paged(kv_cache, k, v), out, scales
            )
        else:
            # Its own plan: the one-level plan of a flattened decode cascade, else ``plan``.
            self._fi_backend._run(self._fi_backend._plan, q, kv_cache, k, v, out, scales)

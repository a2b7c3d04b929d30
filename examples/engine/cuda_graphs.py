"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A step whose batch is all single-token chunks (decodes) is padded to the smallest bucket that holds
it (1, 2, 4, ... up to ``max_num_seqs``). Each bucket owns an attention backend (the engine's, "auto"
or "triton") with a ``GraphCapacity`` of that many query tokens (``bucket_capacity``: its KV-split
buffers grow with the bucket), static input buffers (token ids, positions, KV slots, the rows to
sample) and a graph of the model's whole forward over them per ``graph_key`` the backend has run
(the "auto" backend runs a plan on one of three fixed sets of launches: FlashInfer's decode or
prefill kernels for one level, our Triton kernels otherwise). Per step: the step's plan goes into
the bucket's backend (``plan`` only rewrites the contents of the backend's fixed buffers), the
inputs are copied into the static buffers, the graph of the plan's key is replayed, and the logits of
the sampled rows are read from that graph's static output.

Padding tokens have slot -1 (the KV-append kernel skips them, so no real page is written), are not
in the plan (the backend leaves their attention rows alone) and are not among the rows sampled; the
linear layers are row-wise, so whatever the padding rows hold never reaches a real row.

A bucket's first plan of a key runs the forward eagerly through its static buffers (compiling the
kernels for that shape; its logits are that step's result) and then captures the key's graph. A plan over the
bucket's capacity (more query tokens, levels or page ids than it holds, checked before planning)
is refused with ``None`` and the engine runs that step eagerly; any other error of ``plan``
propagates.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from prefix_cache import CascadePlan
from prefix_cache.attention import GraphCapacity, create_backend
from prefix_cache.planner.kv_split import MAX_SPLITS

from .model import LlamaModel

#: A padding token's (token id, position, KV slot, row to sample), the columns of ``_Bucket.host``.
PADDING = np.array([[0], [0], [-1], [0]], dtype=np.int64)


def graphs_apply(backend: str, device: torch.device) -> bool:
    """Whether decode steps can replay from CUDA graphs for an engine on ``device`` with attention
    backend ``backend``: on CUDA with "auto" or "triton" (the backends that take a capacity)."""
    return device.type == "cuda" and backend in ("auto", "triton")


def fits(plan: CascadePlan, capacity: GraphCapacity) -> bool:
    """Whether ``plan``'s query tokens, levels and page ids (over all levels) are within
    ``capacity``: a fixed-capacity backend plans exactly those (it takes fewer, longer KV splits
    when its split buffers are short)."""
    return (
        plan.num_query_tokens <= capacity.max_query_tokens
        and len(plan.levels) <= capacity.max_levels
        and sum(len(level.kv_indices) for level in plan.levels) <= capacity.max_pages
    )


def bucket_capacity(size: int, max_levels: int, max_pages_per_seq: int) -> GraphCapacity:
    """The fixed sizes of the bucket of ``size`` decodes: ``size`` query tokens, ``max_levels``
    levels, ``size * max_pages_per_seq`` page ids, and partial rows and work items for every KV
    split a step can ask for (at most ``MAX_SPLITS`` per query token per level: one request over a
    long context still splits fully), capped at ``GraphCapacity``'s defaults (room for 4096 split
    rows, sized for large batches, which split less). A small bucket so holds small buffers: 1
    decode over 4 levels, 256 partial rows, not 4100."""
    capacity = GraphCapacity(max_query_tokens=size, max_pages=size * max_pages_per_seq, max_levels=max_levels)
    splits = size * max_levels * MAX_SPLITS
    return dataclasses.replace(
        capacity,
        max_work_items=min(capacity.work_items, splits),
        max_partial_rows=min(capacity.partial_rows, splits),
    )


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself: [1, 2, 4, ..., max_batch]."""
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


class _Bucket:
    """One batch size: its backend, static inputs, and a graph per ``graph_key`` it has run."""

    def __init__(self, model: LlamaModel, backend: str, size: int, capacity: GraphCapacity) -> None:
        self.backend = create_backend(backend, device=model.device, capacity=capacity)
        # Rows: token ids, positions, KV slots, rows to sample; one upload per step.
        self.inputs = torch.zeros(4, size, dtype=torch.int64, device=model.device)
        self.host = np.zeros((4, size), dtype=np.int64)
        # graph key -> (the graph, its output: [size, vocab] float32 logits)
        self.graphs: dict[str, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}


class DecodeGraphs:
    """CUDA graphs of the decode step of ``model`` over ``kv_pool``.

    backend: the attention backend's name, "auto" or "triton".
    max_batch: the largest batch (the scheduler's ``max_num_seqs``); the largest bucket.
    max_levels: levels of the engine's plans (its planner's ``max_levels``).
    max_pages_per_seq: page ids a plan may list, per query token of the bucket, over all its levels;
        a bucket of B holds plans of up to ``B * max_pages_per_seq`` page ids.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: list[torch.Tensor],
        backend: str,
        max_batch: int,
        max_levels: int,
        max_pages_per_seq: int,
    ) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on CUDA, got {model.device}")
        self.model, self.kv_pool, self.backend = model, kv_pool, backend
        self.sizes = bucket_sizes(max_batch)
        self.max_levels, self.max_pages_per_seq = max_levels, max_pages_per_seq
        self._buckets: dict[int, _Bucket] = {}
        # One memory pool for every bucket's graph: replays never overlap, and a graph's logits are
        # read before the next replay.
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> list[int]:
        """The bucket sizes with at least one captured graph."""
        return sorted(size for size, b in self._buckets.items() if b.graphs)

    def bucket(self, batch: int) -> int | None:
        """The bucket size for ``batch`` decodes, or None when it is larger than every bucket."""
        return next((s for s in self.sizes if s >= batch), None)

    def _get(self, size: int) -> _Bucket:
        if size not in self._buckets:
            capacity = bucket_capacity(size, self.max_levels, self.max_pages_per_seq)
            self._buckets[size] = _Bucket(self.model, self.backend, size, capacity)
        return self._buckets[size]

    def run(
        self,
        plan: CascadePlan,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
    ) -> torch.Tensor | None:
        """Logits of ``rows`` (float32 [len(rows), vocab]) for a batch of single-token chunks, or None
        when the batch has no bucket or ``plan`` does not fit its bucket (run it eagerly then).

        tokens, positions, slots: int [T], one per sample of the batch in the engine's order;
        rows: the indices in [0, T) whose logits are wanted (the samples that get a next token).
        """
        size = self.bucket(len(tokens))
        if size is None:
            return None
        b = self._get(size)
        if not fits(plan, b.backend.capacity):
            return None
        b.backend.plan(plan, **self.model.attention_shape(self.kv_pool[0].dtype))
        n = len(tokens)
        b.host[:] = PADDING  # token 0 at position 0, no KV slot, row 0 (never read)
        b.host[0, :n], b.host[1, :n], b.host[2, :n] = tokens, positions, slots
        b.host[3, : len(rows)] = rows
        b.inputs.copy_(torch.from_numpy(b.host))
        key = b.backend.graph_key
        if key in b.graphs:
            graph, logits = b.graphs[key]
            graph.replay()
            return logits[: len(rows)]
        logits = self._forward(b)  # compiles the kernels of this bucket and key; this step's result
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.graphs[key] = (graph, self._forward(b))
        return logits[: len(rows)]

    def _forward(self, b: _Bucket) -> torch.Tensor:
        tokens, positions, slots, rows = b.inputs
        return self.model.forward(tokens, positions, slots, self.kv_pool, b.backend, rows)

"""A rank's compute: the model (or its tensor-parallel shard), its KV pool, the attention backend and
the CUDA graphs; ``execute`` runs one step already planned by the engine.

The engine owns the bookkeeping (``PrefixCache``, scheduler, planner) and hands each step to a
runner as plain arrays; with tensor parallelism every rank runs the same arrays through its own
runner (``tensor_parallel.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from prefix_cache import CascadePlan
from prefix_cache.attention import create_backend

from .cuda_graphs import DecodeGraphs, graphs_apply
from .model import LlamaModel

if TYPE_CHECKING:
    from .engine import EngineConfig

#: ``EngineConfig.kv_cache_dtype`` names: the KV pool's dtype (None: the model's).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}


class ModelRunner:
    """The model's forward over a KV pool of ``config.num_pages`` pages, eagerly or from CUDA graphs.

    max_levels: the most levels of the engine's plans (its planner's ``max_levels``), for the graphs.
    """

    def __init__(self, model: LlamaModel, config: EngineConfig, max_levels: int) -> None:
        self.model = model
        self.kv_pool = model.new_kv_pool(
            config.num_pages, config.page_size, KV_CACHE_DTYPES[config.kv_cache_dtype]
        )
        self.backend = create_backend(config.backend, device=model.device)
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and graphs_apply(config.backend, model.device):
            self.graphs = DecodeGraphs(
                model,
                self.kv_pool,
                config.backend,
                max_batch=config.scheduler.max_num_seqs,
                max_levels=max_levels,
                max_pages_per_seq=config.graph_max_pages_per_seq or config.num_pages,
            )

    def execute(
        self,
        plan: CascadePlan,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
    ) -> tuple[torch.Tensor, bool]:
        """Logits of ``rows`` (float32 [len(rows), vocab]) and whether a CUDA graph gave them.

        tokens, positions, slots: int [T] in the engine's order (see ``LlamaModel.forward``);
        rows: int [R], the batch rows whose next-token logits are wanted. A batch of single-token
        chunks is replayed from a CUDA graph when there are graphs and the plan fits its bucket.
        """
        if self.graphs is not None and bool((np.diff(plan.levels[-1].qo_indptr) == 1).all()):
            logits = self.graphs.run(plan, tokens, positions, slots, rows)
            if logits is not None:
                return logits, True
        # With the dtype the backend finishes planning here (Triton binds its launches, FlashInfer
        # plans, "auto" may take the FlashInfer route) rather than in the first layer's run.
        self.backend.plan(plan, **self.model.attention_shape(self.kv_pool[0].dtype))
        device = self.model.device

        def to_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        logits = self.model.forward(
            to_device(tokens.astype(np.int64)),
            to_device(positions.astype(np.int64)),
            to_device(slots.astype(np.int64)),
            self.kv_pool,
            self.backend,
            to_device(rows.astype(np.int64)),
        )
        return logits, False

    def close(self) -> None:
        """Release what the runner holds beyond its tensors (nothing for one process)."""

"""A calibrated estimate of a cascade plan's attention time, for choosing cascade or one level.

The planner knows token counts, not heads or kernels, so the model is linear in what it knows about a
plan (per layer, GPU time of our Triton kernels replayed in a CUDA graph):

    time_us = base_us + launch_us * (launches - 1) + level_us * (levels - 1)
              + kv_token_us * kv_tokens + pair_us * pairs

kv_tokens: KV tokens read, each group's segment once (memory traffic); pairs: query tokens x KV tokens
summed over groups (tensor-core work, which dominates when many queries share a long prefix);
launches: 1, or 2 when a shared level runs in a launch of its own; levels - 1: the shared levels, whose
states the merge adds.

The Triton backend runs a small shared level in the decode tokens' launch
(``triton_backend.SHARED_ON_NARROW_ROWS``) and any others together in a second one. In tokens, a
shared level joins when its largest group fits one decode tile (``tile_queries`` query tokens), or
when that group has at most ``join_queries`` query tokens and the level's decode tiles read at most
``join_tile_tokens`` KV tokens in all (each of a group's tiles reads the group's KV). The calibration
derives the three from the backend's limits at its model shape; the backend's third limit, one wave
of programs, is not modelled.

The coefficients are fitted to times measured by ``benchmarks/calibrate_planner.py`` (one model
shape: Llama-3-8B heads, 32 query / 8 KV heads of 128) and kept as data in ``prefix_cache/data/``;
rerun it to calibrate another GPU or shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefix_cache.cascade import CascadePlan

_DATA = Path(__file__).resolve().parent / "data"
DEFAULT_PATH = _DATA / "cost_model_h200.json"
_FIELDS = (
    "base_us",
    "launch_us",
    "level_us",
    "kv_token_us",
    "pair_us",
    "join_queries",
    "tile_queries",
    "join_tile_tokens",
)


@dataclass(frozen=True)
class PlanFeatures:
    """What the cost model reads off a plan (see the module docstring)."""

    levels: int
    launches: int
    kv_tokens: float
    pairs: float


@dataclass(frozen=True)
class CostModel:
    """Coefficients in microseconds and the join limits in tokens; see the module docstring.
    ``source`` says where they came from."""

    base_us: float
    launch_us: float
    level_us: float
    kv_token_us: float
    pair_us: float
    join_queries: int = 0
    tile_queries: int = 1
    join_tile_tokens: int = 0
    source: str = ""

    def time_us(self, features: PlanFeatures) -> float:
        """Estimated GPU time of a plan with these features, per layer."""
        return (
            self.base_us
            + self.launch_us * (features.launches - 1)
            + self.level_us * (features.levels - 1)
            + self.kv_token_us * features.kv_tokens
            + self.pair_us * features.pairs
        )

    def tiles(self, queries: np.ndarray | int) -> np.ndarray | int:
        """Decode tiles of groups of ``queries`` query tokens."""
        return -(-queries // self.tile_queries)

    def joins(self, widest_queries: int, tile_tokens: int) -> bool:
        """Whether a shared level whose largest group has ``widest_queries`` query tokens, and whose
        groups' decode tiles read ``tile_tokens`` KV tokens in all, runs in the decode tokens'
        launch."""
        if widest_queries <= self.tile_queries:
            return True
        return widest_queries <= self.join_queries and tile_tokens <= self.join_tile_tokens

    def features(self, plan: CascadePlan) -> PlanFeatures:
        """The features of a plan made by the planner (every group's KV tokens and query tokens)."""
        kv_tokens = pairs = 0.0
        apart = False
        for i, level in enumerate(plan.levels):
            pages = np.diff(level.kv_indptr.astype(np.int64))
            kv_len = np.where(pages > 0, (pages - 1) * plan.page_size + level.kv_last_page_len, 0)
            q_len = np.diff(level.qo_indptr.astype(np.int64))
            kv_tokens += float(kv_len[q_len > 0].sum())
            pairs += float((kv_len * q_len).sum())
            if i < len(plan.levels) - 1:
                widest = int(q_len[kv_len > 0].max(initial=0))
                apart |= not self.joins(widest, int(self.tiles(q_len) @ kv_len))
        return PlanFeatures(len(plan.levels), 1 + apart, kv_tokens, pairs)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> CostModel:
        """The model stored at ``path`` (JSON written by benchmarks/calibrate_planner.py)."""
        data = json.loads(Path(path).read_text())
        return cls(**{k: data[k] for k in _FIELDS}, source=str(path))


def default_cost_model() -> CostModel:
    """The packaged calibration (an H200)."""
    return CostModel.load(DEFAULT_PATH)

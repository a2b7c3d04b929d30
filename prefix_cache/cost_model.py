"""A calibrated estimate of a cascade plan's attention time, for choosing cascade or one level.

The planner knows token counts, not heads or kernels, so the model is linear in what it knows about a
plan (per layer, GPU time of our Triton kernels replayed in a CUDA graph):

    time_us = base_us + level_us * (levels - 1) + kv_token_us * kv_tokens + pair_us * pairs

kv_tokens: KV tokens read, each group's segment once (memory traffic); pairs: query tokens x KV tokens
summed over groups (tensor-core work, which dominates when many queries share a long prefix);
levels - 1: the extra launches and the merge of a cascade. The coefficients are fitted to measured
times by ``benchmarks/calibrate_planner.py`` from a ``benchmarks/bench_attention.py`` run (one model
shape: Llama-3-8B heads, 32 query / 8 KV heads of 128, page 16) and kept as data in
``prefix_cache/data/``; rerun both scripts to calibrate another GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefix_cache.cascade import CascadePlan

_DATA = Path(__file__).resolve().parent / "data"
DEFAULT_PATH = _DATA / "cost_model_h200.json"


@dataclass(frozen=True)
class PlanFeatures:
    """What the cost model reads off a plan (see the module docstring)."""

    levels: int
    kv_tokens: float
    pairs: float


@dataclass(frozen=True)
class CostModel:
    """Coefficients in microseconds; see the module docstring. ``source`` says where they came from."""

    base_us: float
    level_us: float
    kv_token_us: float
    pair_us: float
    source: str = ""

    def time_us(self, features: PlanFeatures) -> float:
        """Estimated GPU time of a plan with these features, per layer."""
        return (
            self.base_us
            + self.level_us * (features.levels - 1)
            + self.kv_token_us * features.kv_tokens
            + self.pair_us * features.pairs
        )

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> CostModel:
        """The model stored at ``path`` (JSON written by benchmarks/calibrate_planner.py)."""
        data = json.loads(Path(path).read_text())
        return cls(
            **{k: data[k] for k in ("base_us", "level_us", "kv_token_us", "pair_us")}, source=str(path)
        )


def plan_features(plan: CascadePlan) -> PlanFeatures:
    """The features of a plan made by the planner (every group's KV tokens and query tokens)."""
    kv_tokens = pairs = 0.0
    for level in plan.levels:
        pages = np.diff(level.kv_indptr.astype(np.int64))
        kv_len = np.where(pages > 0, (pages - 1) * plan.page_size + level.kv_last_page_len, 0)
        q_len = np.diff(level.qo_indptr.astype(np.int64))
        used = q_len > 0
        kv_tokens += float(kv_len[used].sum())
        pairs += float((kv_len * q_len).sum())
    return PlanFeatures(len(plan.levels), kv_tokens, pairs)


def default_cost_model() -> CostModel:
    """The packaged calibration (an H200)."""
    return CostModel.load(DEFAULT_PATH)

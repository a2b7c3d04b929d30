"""A calibrated estimate of a cascade plan's attention time, for choosing cascade or one level.

The planner knows token counts, not kernels, so the model is linear in what it knows about a plan
(per layer, GPU time of our Triton kernels, an exact plan replayed in a CUDA graph):

    time_us = base_us + launch_us * (launches - 1) + level_us * (levels - 1)
              + kv_token_us * kv_tokens + pair_us * pairs

kv_tokens: KV tokens read, each group's segment once (memory traffic); pairs: query tokens x KV tokens
summed over groups (tensor-core work, which dominates when many queries share a long prefix);
levels - 1: the shared levels, whose states the merge adds; launches: the attention launches, 1 or 2.

Launches follow the Triton backend's tile choice (``TritonBackend._level_tiles``), replayed here in
tokens for the calibrated model shape: a level's own tile holds its largest group's rows (query
tokens x ``group_size``, a power of two from ``min_rows`` to ``max_rows``); a plan runs the narrowest
and the widest of its levels' tiles, each level on the narrower that holds it; and a shared level
joins the narrow launch when it has at most ``join_rows`` rows, its narrow tiles read at most
``join_tile_tokens`` KV tokens (each of a group's tiles reads the group's KV), and the launch's tiles
still fit one wave (``sms_per_kv_head`` x programs resident per SM). A test holds the two to the
same counts.

The numbers are fitted to times measured by ``benchmarks/calibrate_planner.py`` (one model shape:
Llama-3-8B heads, 32 query / 8 KV heads of 128) and kept as data in ``prefix_cache/data/``; rerun it
to calibrate another GPU or shape.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefix_cache.cascade import CascadePlan

_DATA = Path(__file__).resolve().parent / "data"
DEFAULT_PATH = _DATA / "cost_model_h200.json"
_FIELDS = (
    "base_us", "launch_us", "level_us", "kv_token_us", "pair_us",
    "group_size", "min_rows", "max_rows", "join_rows", "join_tile_tokens", "sms_per_kv_head",
)  # fmt: skip


@dataclass(frozen=True)
class PlanFeatures:
    """What the cost model reads off a plan (see the module docstring)."""

    levels: int
    launches: int
    kv_tokens: float
    pairs: float


#: A level as the launch count sees it: per group, its query tokens and its KV tokens (int64
#: arrays), and whether the level is causal.
LevelShape = tuple[np.ndarray, np.ndarray, bool]


@dataclass(frozen=True)
class CostModel:
    """Coefficients in microseconds, and the tile rule of the calibrated shape (see the module
    docstring). ``source`` says where they came from."""

    base_us: float
    launch_us: float
    level_us: float
    kv_token_us: float
    pair_us: float
    group_size: int
    min_rows: int
    max_rows: int
    join_rows: int
    join_tile_tokens: int
    sms_per_kv_head: float
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

    def _tile_rows(self, rows: int) -> int:
        # tile_config's rows (next_pow2, clamped): kernels/ needs torch, the cost model only numpy.
        return max(self.min_rows, min(1 << max(rows - 1, 0).bit_length(), self.max_rows))

    def launches(self, levels: Sequence[LevelShape]) -> int:
        """The attention launches of a plan with these levels (see the module docstring)."""
        # The levels' groups end to end, each level closed by a group without queries or KV: a sum
        # or maximum per level is one reduceat (numpy's per-call cost, not the data, is the cost).
        closing = np.zeros(1, dtype=np.int64)
        q = np.concatenate([a for q, _, _ in levels for a in (q, closing)] or [closing[:0]])
        kv = np.concatenate([a for _, kv, _ in levels for a in (kv, closing)] or [closing[:0]])
        starts = list(itertools.accumulate((s[0].shape[0] + 1 for s in levels), initial=0))[:-1]
        q_with_kv = q * (kv > 0)
        rows = [r * self.group_size for r in np.maximum.reduceat(q_with_kv, starts).tolist()]
        own = [self._tile_rows(r) for r in rows]
        narrow, wide = min(own), max(own)
        on = [narrow if r <= narrow else wide for r in rows]
        tile_q = narrow // self.group_size
        tiles = -(-q_with_kv // tile_q)  # per group with KV, on the narrow tile
        level_tiles = np.add.reduceat(tiles, starts).tolist()
        level_reads = np.add.reduceat(tiles * kv, starts).tolist()  # KV tokens the level's tiles read
        programs = sum(t for t, tile in zip(level_tiles, on, strict=True) if tile == narrow)
        slots = self.sms_per_kv_head * (1 if narrow >= 128 else 2 if narrow >= 64 else 4)
        for i, ((_, _, causal), t, reads) in enumerate(zip(levels, level_tiles, level_reads, strict=True)):
            small = not causal and rows[i] <= self.join_rows and reads <= self.join_tile_tokens
            if on[i] != narrow and small and programs + t <= slots:
                on[i], programs = narrow, programs + t
        return len(set(on))

    def features(self, plan: CascadePlan) -> PlanFeatures:
        """The features of a plan made by the planner (every group's KV tokens and query tokens)."""
        kv_tokens = pairs = 0.0
        shapes = []
        for level in plan.levels:
            pages = np.diff(level.kv_indptr.astype(np.int64))
            kv_len = np.where(pages > 0, (pages - 1) * plan.page_size + level.kv_last_page_len, 0)
            q_len = np.diff(level.qo_indptr.astype(np.int64))
            kv_tokens += float(kv_len[q_len > 0].sum())
            pairs += float((kv_len * q_len).sum())
            shapes.append((q_len, kv_len, level.causal))
        return PlanFeatures(len(plan.levels), self.launches(shapes), kv_tokens, pairs)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> CostModel:
        """The model stored at ``path`` (JSON written by benchmarks/calibrate_planner.py)."""
        data = json.loads(Path(path).read_text())
        return cls(**{k: data[k] for k in _FIELDS}, source=str(path))


def default_cost_model() -> CostModel:
    """The packaged calibration (an H200)."""
    return CostModel.load(DEFAULT_PATH)

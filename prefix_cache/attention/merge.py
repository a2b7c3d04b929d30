"""Merging attention states of disjoint KV segments by their log-sum-exp (plain PyTorch).

A state of one segment is (out, lse): out is softmax(scores) @ V over the segment, lse is
logsumexp(scores) in natural log, float32, -inf for an empty segment (whose out is ignored).
Attention over the union of the segments is the lse-weighted mean of the outs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N >= 1 states of the same query tokens.

    outs: N tensors [num_tokens, num_heads, head_dim], any float dtype.
    lses: N tensors [num_tokens, num_heads], natural log.
    Returns (out float32 [num_tokens, num_heads, head_dim], lse float32 [num_tokens, num_heads]);
    a row empty in every segment gets out 0 and lse -inf.
    """
    if not outs or len(outs) != len(lses):
        raise ValueError(f"need as many lses as outs, at least one, got {len(outs)} and {len(lses)}")
    lse = torch.stack([s.float() for s in lses])
    peak = lse.amax(dim=0)
    # Rows empty everywhere: subtract 0 instead of -inf, so that their weights are exp(-inf) = 0, not NaN.
    peak = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak)
    weights = torch.exp(lse - peak)
    total = weights.sum(dim=0)
    # where(), not a product: an empty segment's out may hold anything, NaN included.
    out = sum(
        torch.where(w.unsqueeze(-1) > 0, w.unsqueeze(-1) * o.float(), 0.0)
        for w, o in zip(weights, outs, strict=True)
    )
    out = out / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return out, peak + torch.log(total)

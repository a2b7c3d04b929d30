"""Float64 attention of a batch computed request by request from the page tables, never through a plan."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: Sequence[Sequence[int] | np.ndarray],
    kv_lens: Sequence[int],
    qo_lens: Sequence[int],
    sm_scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] (engine order), kv_cache [pages, 2, page_size, Hkv, D] -> float64 [T, Hq, D].

    Request i's queries are its last qo_lens[i] KV tokens: its query j (0-based) sees KV positions
    0 .. kv_lens[i] - qo_lens[i] + j. Query head h reads KV head h // (Hq // Hkv)."""
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for table, kv_len, qo_len in zip(block_tables, kv_lens, qo_lens, strict=True):
        kv_len, qo_len = int(kv_len), int(qo_len)
        if qo_len == 0:
            continue
        pages = torch.as_tensor(np.asarray(table)[: -(-kv_len // page_size)], dtype=torch.int64)
        kv = kv_cache[pages.to(kv_cache.device)].double()  # [pages, 2, page_size, Hkv, D]
        k = kv[:, 0].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = kv[:, 1].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        queries = q[start : start + qo_len].double()
        scores = torch.einsum("qhd,khd->hqk", queries, k) * sm_scale
        position = torch.arange(kv_len, device=q.device)
        visible = position[None, :] <= (kv_len - qo_len + torch.arange(qo_len, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + qo_len] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        start += qo_len
    return out

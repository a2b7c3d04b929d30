"""Writing new tokens' K and V into the paged KV cache (any layout the attention backends accept)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefix_cache.kernels._common import check_runnable, next_pow2

from prefix_cache.attention.kv_layout import KVCache, split_kv_cache


@triton.jit
def _kv_append_kernel(
    k_ptr,  # [N, Hkv, D]
    v_ptr,  # [N, Hkv, D]
    slots_ptr,  # [N] int64: page_id * page_size + offset, or -1
    k_cache_ptr,  # page p, slot s, head h at p * stride_kc_page + s * stride_kc_slot + h * stride_kc_head
    v_cache_ptr,  # same for V
    page_size,
    num_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_page,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_page,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # slot -1 marks a token whose KV is not stored (padding, or a page another request already wrote).
    if slot >= 0:
        mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
        page = slot // page_size
        within = slot - page * page_size
        k = tl.load(k_ptr + t * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
        k_dst = k_cache_ptr + page * stride_kc_page + within * stride_kc_slot
        v_dst = v_cache_ptr + page * stride_vc_page + within * stride_vc_slot
        tl.store(k_dst + offs_h[:, None].to(tl.int64) * stride_kc_head + offs_d[None, :], k, mask=mask)
        tl.store(v_dst + offs_h[:, None].to(tl.int64) * stride_vc_head + offs_d[None, :], v, mask=mask)


def append_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V into the paged cache in place.

    kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (K at index 0 of dim 1, V at 1; NHD),
        or a (k_cache, v_cache) pair of [num_pages, page_size, num_kv_heads, head_dim] tensors of any
        strides (see ``prefix_cache.attention.kv_layout``).
    k, v: [num_new_tokens, num_kv_heads, head_dim], the cache's dtype.
    slot_mapping: int64 [num_new_tokens]; token i goes to page ``slot // page_size``, offset
        ``slot % page_size``. A slot of -1 skips the token. Slots are not range-checked (that would
        need a device-to-host sync): they must be below ``num_pages * page_size``.
    """
    k_cache, v_cache = split_kv_cache(kv_cache)
    n, h, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (h, d) or slot_mapping.shape != (n,):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}, kv_cache pages {tuple(k_cache.shape[1:])}"
        )
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache's {k_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of k and v must be contiguous")
    check_runnable(k_cache, v_cache, k, v, slot_mapping)
    if n == 0:
        return
    block_d = next_pow2(d)
    block_h = min(next_pow2(h), max(1, 4096 // block_d))
    _kv_append_kernel[(n, triton.cdiv(h, block_h))](
        k, v, slot_mapping, k_cache, v_cache,
        k_cache.shape[1], h,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip

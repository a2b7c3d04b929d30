"""Writing new tokens' K and V into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefix_cache.kernels._common import check_runnable, next_pow2


@triton.jit
def _kv_append_kernel(
    k_ptr,  # [N, Hkv, D]
    v_ptr,  # [N, Hkv, D]
    slots_ptr,  # [N] int64: page_id * page_size + offset, or -1
    cache_ptr,  # [P, 2, page_size, Hkv, D]
    page_size,
    num_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_page,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
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
        dst = cache_ptr + page * stride_c_page + (slot - page * page_size) * stride_c_slot
        dst += offs_h[:, None] * stride_c_head + offs_d[None, :]
        k = tl.load(k_ptr + t * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_c_kv, v, mask=mask)


def append_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V into the paged cache in place.

    kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (K at index 0 of dim 1, V at 1; NHD).
    k, v: [num_new_tokens, num_kv_heads, head_dim], the cache's dtype.
    slot_mapping: int64 [num_new_tokens]; token i goes to page ``slot // page_size``, offset
        ``slot % page_size``. A slot of -1 skips the token. Slots are not range-checked (that would
        need a device-to-host sync): they must be below ``num_pages * page_size``.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_pages, 2, page_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    n, h, d = k.shape
    if v.shape != k.shape or kv_cache.shape[3:] != (h, d) or slot_mapping.shape != (n,):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}, kv_cache {tuple(kv_cache.shape)}"
        )
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache's {kv_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if kv_cache.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of kv_cache, k and v must be contiguous")
    check_runnable(kv_cache, k, v, slot_mapping)
    if n == 0:
        return
    block_d = next_pow2(d)
    block_h = min(next_pow2(h), max(1, 4096 // block_d))
    _kv_append_kernel[(n, triton.cdiv(h, block_h))](
        k, v, slot_mapping, kv_cache,
        kv_cache.shape[2], h,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip

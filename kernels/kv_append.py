"""Writing new tokens' K and V into the paged KV cache (any layout the attention backends accept),
quantizing them where the cache is fp8 (``FP8_KV_DTYPE``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefix_cache.kernels._common import check_runnable, next_pow2

from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, FP8_MAX, KVCache, check_kv_scales, split_kv_cache


@triton.jit
def _fp8_grid(x, FP8_MAX: tl.constexpr):
    """fp32 ``x`` saturated at +-FP8_MAX and rounded to the nearest e4m3 value (ties to even), still
    in fp32: the conversion to fp8 that follows is then exact. Rounding here rather than in the
    conversion gives the same bits on the GPU and in Triton's interpreter, whose conversion rounds
    some values up a binade wrong (7.98 to 4)."""
    # NaN stays NaN, as in torch's conversion (a compiled min/max would return the bound instead).
    x = tl.minimum(
        tl.maximum(x, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL
    )
    # Normal e4m3 values keep 3 of fp32's 23 mantissa bits: round the other 20 away in the integer bits.
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2**-6 (subnormal e4m3) the step is 2**-9: the fp32 sum with 1.5 * 2**14 rounds |x| there;
    # x's sign bit goes back on (a negative value that rounds to zero is -0, as in torch).
    magnitude = tl.abs(x)
    tiny = ((magnitude + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)
    return tl.where(magnitude < 0.015625, tiny.to(tl.float32, bitcast=True), normal)


@triton.jit
def _kv_append_kernel(
    k_ptr,  # [N, Hkv, D]
    v_ptr,  # [N, Hkv, D]
    slots_ptr,  # [N] int64: page_id * page_size + offset, or -1
    k_cache_ptr,  # page p, slot s, head h at p * stride_kc_page + s * stride_kc_slot + h * stride_kc_head
    v_cache_ptr,  # same for V
    k_inv_scale,  # fp32: 1 / k_scale (an fp8 cache; unused otherwise)
    v_inv_scale,
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
    QUANTIZE: tl.constexpr,  # an fp8 cache: x * inv_scale, saturated at +-FP8_MAX, rounded to nearest
    FP8_MAX: tl.constexpr,
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
        if QUANTIZE:
            k = _fp8_grid(k.to(tl.float32) * k_inv_scale, FP8_MAX)
            v = _fp8_grid(v.to(tl.float32) * v_inv_scale, FP8_MAX)
        k_dst = k_cache_ptr + page * stride_kc_page + within * stride_kc_slot
        v_dst = v_cache_ptr + page * stride_vc_page + within * stride_vc_slot
        k_offs = offs_h[:, None].to(tl.int64) * stride_kc_head + offs_d[None, :]
        v_offs = offs_h[:, None].to(tl.int64) * stride_vc_head + offs_d[None, :]
        tl.store(k_dst + k_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + v_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def append_kv(
    kv_cache: KVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Write new K/V into the paged cache in place.

    kv_cache: [num_pages, 2, page_size, num_kv_heads, head_dim] (K at index 0 of dim 1, V at 1; NHD),
        or a (k_cache, v_cache) pair of [num_pages, page_size, num_kv_heads, head_dim] tensors of any
        strides (see ``prefix_cache.attention.kv_layout``).
    k, v: [num_new_tokens, num_kv_heads, head_dim], the cache's dtype; for an fp8 cache
        (``torch.float8_e4m3fn``) fp16, bf16 or fp32, stored as ``x / scale`` rounded to the nearest
        fp8 value and saturated at +-448 (computed as ``x * float32(1 / scale)``).
    slot_mapping: int64 [num_new_tokens]; token i goes to page ``slot // page_size``, offset
        ``slot % page_size``. A slot of -1 skips the token. Slots are not range-checked (that would
        need a device-to-host sync): they must be below ``num_pages * page_size``.
    k_scale, v_scale: the layer's dequantization scales of an fp8 cache (stored value x scale = the
        value attention sees), positive and finite; default 1. Only for an fp8 cache.
    """
    k_cache, v_cache = split_kv_cache(kv_cache)
    n, h, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (h, d) or slot_mapping.shape != (n,):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}, kv_cache pages {tuple(k_cache.shape[1:])}"
        )
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    quantize = k_cache.dtype == FP8_KV_DTYPE
    if quantize:
        if k.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v.dtype != k.dtype:
            raise ValueError(f"k/v for an fp8 cache must be fp16, bf16 or fp32, got {k.dtype}/{v.dtype}")
    elif k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
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
        k, v, slot_mapping, k_cache, v_cache, 1.0 / k_scale, 1.0 / v_scale,
        k_cache.shape[1], h,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, QUANTIZE=quantize, FP8_MAX=FP8_MAX,
    )  # fmt: skip

"""The KV-cache layouts the backends accept, reduced to one K view and one V view (torch only).

Every backend addresses K and V through strides, so any layout whose last axis (head_dim) is
contiguous works; ``split_kv_cache`` says which forms are accepted and returns the two views.
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: A KV cache: one ``[num_pages, 2, page_size, H, D]`` tensor or a ``(k_cache, v_cache)`` pair.
KVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: The 8-bit KV dtype (e4m3, no infinities): each layer's K and V are stored as ``x / scale``, one
#: scale per layer for K and one for V, and read back as ``stored * scale``.
FP8_KV_DTYPE = torch.float8_e4m3fn
#: Its largest finite value: quantizing saturates there.
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (any float dtype) as stored in an fp8 cache with dequantization scale ``scale``:
    ``x * float32(1 / scale)`` in float32, saturated at +-``FP8_MAX``, rounded to the nearest e4m3
    value (ties to even). The torch form of what ``append_kv`` writes, bit for bit."""
    inverse = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def check_kv_scales(
    kv_dtype: torch.dtype, k_scale: float | None, v_scale: float | None
) -> tuple[float, float]:
    """(k_scale, v_scale) as floats for a KV cache of ``kv_dtype``: for an fp8 cache each is 1 when
    not given, else must be positive and finite; another cache takes none (1, 1). ValueError
    naming the bad argument otherwise."""
    if kv_dtype != FP8_KV_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale are for an fp8 KV cache, this one is {kv_dtype}")
        return 1.0, 1.0
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        value = 1.0 if scale is None else float(scale)
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"{name} must be a positive finite number, got {scale}")
        scales.append(value)
    return scales[0], scales[1]


def flashinfer_paged(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> KVCache:
    """The KV cache as FlashInfer's paged wrappers take it: the 5-D NHD tensor as given, else the
    ``(k, v)`` views of ``split_kv_cache`` (FlashInfer reads their page strides)."""
    return kv_cache if isinstance(kv_cache, torch.Tensor) else (k, v)


def flashinfer_page_ids(indices: np.ndarray, device: torch.device) -> torch.Tensor:
    """Page ids for a FlashInfer wrapper's ``plan``, int32, uploaded without a host sync. On the
    device already: FlashInfer's CUDA-graph mode copies host page ids into its buffer with a
    blocking copy (a host sync in every plan), device ones without."""
    return torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int32)).to(device, non_blocking=True)


def split_kv_cache(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as two ``[num_pages, page_size, num_kv_heads, head_dim]`` views (no copy).

    kv_cache: a ``[num_pages, 2, page_size, H, D]`` tensor (K at index 0 of dim 1, FlashInfer's NHD),
    or a ``(k_cache, v_cache)`` pair of ``[num_pages, page_size, H, D]`` tensors of any strides:
    vLLM's ``[2, num_pages, page_size, H, D]`` is passed as ``(kv[0], kv[1])``, an HND pool
    ``[num_pages, H, page_size, D]`` as its ``.transpose(1, 2)`` views. head_dim must be contiguous.
    """
    if isinstance(kv_cache, torch.Tensor):
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_pages, 2, page_size, num_kv_heads, head_dim] or a (k, v) pair, "
                f"got shape {tuple(kv_cache.shape)}"
            )
        if kv_cache.stride(-1) != 1:
            raise ValueError("the head_dim axis of the KV cache must be contiguous")
        k, v = kv_cache.unbind(1)
        return k, v
    elif isinstance(kv_cache, tuple | list) and len(kv_cache) == 2:
        k, v = kv_cache
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError("a (k_cache, v_cache) pair must hold two tensors")
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                "k_cache and v_cache must both be [num_pages, page_size, num_kv_heads, head_dim], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"k_cache and v_cache differ: {k.dtype} on {k.device}, {v.dtype} on {v.device}")
    else:
        raise ValueError(f"kv_cache must be a tensor or a (k_cache, v_cache) pair, got {type(kv_cache)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of the KV cache must be contiguous")
    return k, v

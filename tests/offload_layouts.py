"""KV pools in every layout the backends accept, filled with random bytes, for the mover's tests."""

from __future__ import annotations

import numpy as np
import torch

from prefix_cache.attention.kv_layout import KVCache, split_kv_cache

#: Each layout: one layer's pool of ``[num_pages, page_size, H, D]`` K and V as the engine passes it.
LAYOUTS = ("nhd5", "pair", "vllm", "hnd_pair", "hnd5")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def random_bits(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str
) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes are random (NaN payloads included), built on the CPU."""
    count = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def make_layer(
    layout: str, pages: int, page_size: int, heads: int, dim: int, dtype: torch.dtype, gen, device="cpu"
) -> KVCache:
    """One layer's KV cache in ``layout``, random bytes throughout."""
    if layout == "nhd5":  # FlashInfer's NHD [pages, 2, page_size, H, D]
        return random_bits((pages, 2, page_size, heads, dim), dtype, gen, device)
    if layout == "pair":  # two contiguous [pages, page_size, H, D]
        return tuple(random_bits((pages, page_size, heads, dim), dtype, gen, device) for _ in range(2))
    if layout == "vllm":  # vLLM's [2, pages, page_size, H, D] passed as (kv[0], kv[1])
        kv = random_bits((2, pages, page_size, heads, dim), dtype, gen, device)
        return (kv[0], kv[1])
    if layout == "hnd_pair":  # [pages, H, page_size, D] each, passed transposed
        k, v = (random_bits((pages, heads, page_size, dim), dtype, gen, device) for _ in range(2))
        return (k.transpose(1, 2), v.transpose(1, 2))
    if layout == "hnd5":  # [pages, 2, H, page_size, D]: K and V interleaved per page, HND
        kv = random_bits((pages, 2, heads, page_size, dim), dtype, gen, device)
        return (kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2))
    raise ValueError(layout)


def page_bytes(kv_caches: list[KVCache], page: int) -> bytes:
    """GPU page ``page`` of every layer as bytes: per layer K then V, each NHD ``[page_size, H, D]``
    contiguous: the documented layout of one host page."""
    parts = []
    for kv_cache in kv_caches:
        for half in split_kv_cache(kv_cache):
            raw = half[page].contiguous().view(_BITS[half.dtype.itemsize]).cpu()
            parts.append(raw.numpy().tobytes())
    return b"".join(parts)


def host_page_bytes(pages: torch.Tensor, page: int) -> bytes:
    """Host page ``page`` of a ``HostKVPool.pages`` tensor as bytes."""
    return pages[page].view(_BITS[pages.dtype.itemsize]).numpy().tobytes()

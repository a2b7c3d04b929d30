"""KV pools in every layout the backends accept, filled with random bytes, for the mover's tests."""

from __future__ import annotations

import numpy as np
import torch

from prefix_cache.attention.kv_layout import KVCache, split_kv_cache
from prefix_cache.offload import HostKVPool, KVMover

#: Each layout: the per-layer KV caches as an engine passes them (see ``make_pool``).
LAYOUTS = ("nhd5", "pair", "vllm", "hnd_pair", "hnd5", "one_nhd5", "one_vllm", "page_major", "mixed")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

#: The test pools: layers, GPU pages, page size, KV heads, head dim, host pages.
LAYERS, PAGES, PAGE, HEADS, DIM, HOST = 3, 12, 4, 2, 8, 10

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


def make_pool(
    layout: str, layers: int, pages: int, page_size: int, heads: int, dim: int, dtype, gen, device="cpu"
) -> list[KVCache]:
    """Every layer's KV cache: per-layer tensors in one of ``make_layer``'s layouts; ``one_nhd5``:
    one ``[layers, pages, 2, page_size, H, D]`` tensor passed as ``list(pool)``; ``one_vllm``: one
    ``[layers, 2, pages, page_size, H, D]`` tensor passed as ``(pool[l, 0], pool[l, 1])`` pairs;
    ``page_major``: a K and a V ``[pages, layers, page_size, H, D]`` passed as ``(k[:, l], v[:, l])``
    (a page's K of all layers contiguous, unlike in a host page); ``mixed``: layers alternately
    ``nhd5`` and ``hnd_pair``."""
    if layout == "one_nhd5":
        return list(random_bits((layers, pages, 2, page_size, heads, dim), dtype, gen, device))
    if layout == "one_vllm":
        pool = random_bits((layers, 2, pages, page_size, heads, dim), dtype, gen, device)
        return [(pool[layer, 0], pool[layer, 1]) for layer in range(layers)]
    if layout == "page_major":
        k, v = (random_bits((pages, layers, page_size, heads, dim), dtype, gen, device) for _ in range(2))
        return [(k[:, layer], v[:, layer]) for layer in range(layers)]
    if layout == "mixed":
        kinds = ["nhd5", "hnd_pair"]
        return [
            make_layer(kinds[i % 2], pages, page_size, heads, dim, dtype, gen, device) for i in range(layers)
        ]
    return [make_layer(layout, pages, page_size, heads, dim, dtype, gen, device) for _ in range(layers)]


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


def build(
    layout: str,
    dtype: torch.dtype,
    seed: int = 0,
    staging_pages: int | None = None,
    device: str = "cpu",
) -> tuple[list[KVCache], HostKVPool, KVMover]:
    """(kv_caches, host pool, mover) of the test sizes, both pools filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    kv_caches = make_pool(layout, LAYERS, PAGES, PAGE, HEADS, DIM, dtype, gen, device)
    pool = HostKVPool(HOST, LAYERS, PAGE, HEADS, DIM, dtype)
    pool.pages.copy_(random_bits(tuple(pool.pages.shape), dtype, gen, "cpu"))
    if device != "cpu":
        torch.cuda.synchronize()  # the uploads are done before any other stream touches the pools
    return kv_caches, pool, KVMover(kv_caches, pool, staging_pages=staging_pages)


def snapshot(kv_caches: list[KVCache], pool: HostKVPool) -> tuple[list[bytes], list[bytes]]:
    """Every GPU page's bytes and every host page's bytes."""
    return (
        [page_bytes(kv_caches, p) for p in range(PAGES)],
        [host_page_bytes(pool.pages, h) for h in range(pool.num_pages)],
    )


def check_round_trip(layout: str, dtype: torch.dtype, device: str) -> None:
    """Saves five pages (more than the staging buffer holds; host pages a run and scattered ones),
    loads them back into other pages: those hold the saved bytes, every other page is untouched."""
    kv_caches, pool, mover = build(layout, dtype, staging_pages=2, device=device)
    gpu_before, host_before = snapshot(kv_caches, pool)
    src, dst_host, dst_gpu = [1, 5, 2, 9, 0], [3, 4, 5, 0, 8], [11, 6, 4, 7, 10]
    handle = mover.save(src, dst_host)
    handle.wait()
    assert handle.ok
    gpu_mid, host_mid = snapshot(kv_caches, pool)
    assert gpu_mid == gpu_before
    for h in range(HOST):
        want = gpu_before[src[dst_host.index(h)]] if h in dst_host else host_before[h]
        assert host_mid[h] == want, h
    handle = mover.load(dst_host, dst_gpu)
    handle.wait()
    assert handle.ok
    gpu_after, host_after = snapshot(kv_caches, pool)
    assert host_after == host_mid
    for p in range(PAGES):
        want = gpu_before[src[dst_gpu.index(p)]] if p in dst_gpu else gpu_before[p]
        assert gpu_after[p] == want, p

"""Batched page copies between the engine's per-layer KV pools and the pinned host pool (torch only).

Two ways, picked once per pool layout:

- **Direct** (``page_copies``): where a page of every layer lies at a regular step in one or two
  tensors in the host page's element order (an engine that allocates its pool as one
  ``[num_layers, ...]`` tensor and passes ``list(pool)``), each page moves as one or two 2-D copies
  on the copy engine. No kernel runs on the SMs and nothing is staged.
- **Gathered**, for every other layout: a save gathers the batch's pages of every layer into a
  page-first staging buffer on the GPU (one ``index_select`` per layer and K/V tensor, K and V
  together for a 5-D layer; one for all layers when they are equal views of one tensor), then
  copies the staging buffer to the host pool with one asynchronous copy per run of consecutive host
  pages. A load is the mirror: one copy per host run into staging, then ``index_copy_`` into the
  layers. Batches larger than the staging buffer go through it in chunks.

On CUDA all of it runs on the mover's own stream, ordered against the caller's stream by events; on
CPU tensors it runs before the call returns. Every copy moves bytes (the gathers through the widest
integer view the tensors allow, 8 bytes for a head_dim of 128 in bf16), so what comes back is
bitwise what was saved, float8 and NaN payloads included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from prefix_cache.attention.kv_layout import KVCache, split_kv_cache
from prefix_cache.offload.handle import CopyHandle
from prefix_cache.offload.host_pool import HostKVPool
from prefix_cache.offload.page_copies import DirectCopies

#: Default size of the staging buffer on the KV pool's device, in bytes (at least one page).
STAGING_BYTES = 256 * 2**20

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

PageIds = Sequence[int] | np.ndarray


class KVMover:
    """Saves GPU pages to host pages and loads them back, a batch at a time.

    kv_caches: the engine's KV pool, one entry per layer, each in a layout ``split_kv_cache`` accepts
    (a ``[num_pages, 2, page_size, H, D]`` tensor or a ``(k, v)`` pair of any strides); every layer
    of the same shape, dtype and device. They must outlive the mover. host_pool: the host tier, of the
    same layers, page shape and dtype (pinned when the pool is on CUDA). staging_pages: pages the
    staging buffer on the pool's device holds (default: ``STAGING_BYTES`` worth); larger batches go
    through it in chunks. Layouts that move ``direct`` have no staging buffer.

    Ordering (CUDA): ``save`` and ``load`` return at once with a ``CopyHandle``. Their copies start
    after all work queued so far on the caller's ``stream`` (default: the current stream), so a save
    sees the KV that the forward before it wrote. They never wait for the host. Copies of all batches
    run on one stream in call order, so a load from a host page queued after the save to it reads
    the saved bytes, and a save into a host page waits for an earlier load from it. The caller
    orders what follows through the handle: ``handle.wait_on(stream)`` before the forward that
    reads loaded pages, and ``handle.done()`` (or ``wait_on``) before a saved GPU page is written
    again. See docs/offload.md.
    """

    def __init__(
        self, kv_caches: Sequence[KVCache], host_pool: HostKVPool, staging_pages: int | None = None
    ) -> None:
        if not isinstance(kv_caches, Sequence) or isinstance(kv_caches, torch.Tensor) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty list of per-layer KV caches")
        if not isinstance(host_pool, HostKVPool):
            raise ValueError(f"host_pool must be a HostKVPool, got {type(host_pool).__name__}")
        # (tensor, where its pages go in a staging page): a 5-D layer moves K and V in one op.
        parts: list[tuple[torch.Tensor, tuple[int, ...]]] = []
        first = None
        for layer, kv_cache in enumerate(kv_caches):
            try:
                k, v = split_kv_cache(kv_cache)
            except ValueError as error:
                raise ValueError(f"layer {layer}: {error}") from error
            found = (tuple(k.shape), k.dtype, k.device)
            if first is None:
                first = found
            elif found != first:
                raise ValueError(
                    f"layer {layer} is {found[0]} {found[1]} on {found[2]}, layer 0 is "
                    f"{first[0]} {first[1]} on {first[2]}: every layer must match"
                )
            if isinstance(kv_cache, torch.Tensor):
                parts.append((kv_cache, (layer,)))
            else:
                parts += [(k, (layer, 0)), (v, (layer, 1))]
        (num_pages, page_size, heads, head_dim), dtype, device = first  # type: ignore[misc]
        wanted = (len(kv_caches), 2, page_size, heads, head_dim)
        if host_pool.page_shape != wanted or host_pool.dtype != dtype:
            raise ValueError(
                f"the host pool's pages are {host_pool.page_shape} {host_pool.dtype}; the KV pool needs "
                f"{wanted} {dtype} (layers, K/V, page_size, num_kv_heads, head_dim)"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the KV pool must be on CPU or CUDA, got {device}")
        if device.type == "cuda" and not host_pool.pinned:
            raise ValueError("a KV pool on CUDA needs a pinned host pool (HostKVPool(..., pin=True))")
        if staging_pages is None:
            staging_pages = min(host_pool.num_pages, max(1, STAGING_BYTES // host_pool.page_bytes))
        if isinstance(staging_pages, bool) or not isinstance(staging_pages, int) or staging_pages < 1:
            raise ValueError(f"staging_pages must be an integer >= 1, got {staging_pages!r}")
        views = _widest_views([tensor for tensor, _ in parts] + [host_pool.pages], dtype.itemsize)
        if views is None:
            raise ValueError(f"no integer type of {dtype.itemsize} bytes to move {dtype} through")

        self.device: torch.device = device
        self.num_pages: int = num_pages
        self.host_pool: HostKVPool = host_pool
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._parts = _merge_layers([(view, slot) for view, (_, slot) in zip(views, parts, strict=False)])
        self._host = views[-1]
        self._direct = DirectCopies.plan(self._parts, self._host)
        self._staging = None
        self._tag = None
        with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
            # Allocated on the copy stream: freed memory is reused only after its copies.
            if self._direct is not None and self._stream is not None:
                self._tag = torch.empty(1, dtype=self._host.dtype, device=device)
            if self._direct is None:
                self._staging = torch.empty(
                    (staging_pages, *self._host.shape[1:]), dtype=self._host.dtype, device=device
                )
        if self._stream is not None:
            for tensor, _ in self._parts:
                tensor.record_stream(self._stream)

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream the copies run on (None on CPU: they run in the call)."""
        return self._stream

    @property
    def ops_per_chunk(self) -> int:
        """Gather (save) or scatter (load) ops per chunk of a batch: 1 or 2 when every layer is a
        view of one tensor at a regular step (an engine that allocates its pool as one
        ``[num_layers, ...]`` tensor and passes ``list(pool)``), else one or two per layer."""
        return len(self._parts)

    @property
    def direct(self) -> bool:
        """True when pages move by 2-D copies straight between the pools, on the copy engine (no
        gather kernel, no staging buffer); False when they are gathered through staging."""
        return self._direct is not None

    @property
    def staging_pages(self) -> int:
        """Pages the staging buffer holds (the chunk size of a gathered batch); 0 when ``direct``."""
        return 0 if self._staging is None else self._staging.shape[0]

    def save(
        self, gpu_pages: PageIds, host_pages: PageIds, stream: torch.cuda.Stream | None = None
    ) -> CopyHandle:
        """Copies KV page ``gpu_pages[i]`` of every layer to host page ``host_pages[i]``, for all i.

        Starts after the work queued so far on ``stream`` (CUDA; default: the current stream) and
        returns at once; the handle says when the GPU pages may be reused and whether the host
        pages hold the KV. Raises ValueError, copying nothing, for a page id out of range, unequal
        lengths or a host page named twice."""
        gpu, host = self._batch(gpu_pages, host_pages, destination="host_pages")
        return self._submit(gpu, host, saving=True, stream=stream)

    def load(
        self, host_pages: PageIds, gpu_pages: PageIds, stream: torch.cuda.Stream | None = None
    ) -> CopyHandle:
        """Copies host page ``host_pages[i]`` into KV page ``gpu_pages[i]`` of every layer, for all i.

        Starts after the work queued so far on ``stream`` (CUDA; default: the current stream: a
        kernel still reading the GPU pages' old content finishes first) and returns at once;
        ``handle.wait_on(stream)`` before the forward that reads the pages. Raises ValueError,
        copying nothing, for a page id out of range, unequal lengths or a GPU page named twice."""
        gpu, host = self._batch(gpu_pages, host_pages, destination="gpu_pages")
        return self._submit(gpu, host, saving=False, stream=stream)

    def _batch(
        self, gpu_pages: PageIds, host_pages: PageIds, destination: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Both id lists as int64 arrays, checked: equal lengths, in range, no destination twice."""
        gpu = _page_ids(gpu_pages, "gpu_pages", self.num_pages)
        host = _page_ids(host_pages, "host_pages", self.host_pool.num_pages)
        if gpu.size != host.size:
            raise ValueError(f"gpu_pages has {gpu.size} pages, host_pages {host.size}: they pair up")
        ids = gpu if destination == "gpu_pages" else host
        unique, counts = np.unique(ids, return_counts=True)
        if unique.size != ids.size:
            raise ValueError(f"{destination} names page {int(unique[counts > 1][0])} twice in one batch")
        return gpu, host

    def _submit(
        self, gpu: np.ndarray, host: np.ndarray, saving: bool, stream: torch.cuda.Stream | None
    ) -> CopyHandle:
        """Queues the checked batch (CUDA) or runs it (CPU); a torch error midway fails the handle."""
        if gpu.size == 0:
            return CopyHandle(0)
        if self._stream is None:
            try:
                self._copy(gpu, host, saving)
            except RuntimeError as error:
                return CopyHandle(gpu.size, error=error)
            return CopyHandle(gpu.size)
        compute = stream if stream is not None else torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        error = None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            try:
                self._copy(gpu, host, saving)
            except RuntimeError as caught:
                error = caught
            done = torch.cuda.Event()
            done.record(self._stream)
        return CopyHandle(gpu.size, done, self.device, error)

    def _copy(self, gpu: np.ndarray, host: np.ndarray, saving: bool) -> None:
        """The batch's copies, on the current stream: direct, or chunk by chunk through staging."""
        if self._direct is not None:
            self._direct.run(gpu, host, saving, self._stream.cuda_stream if self._stream else 0)
            if self._tag is not None:
                # A pinned copy_ of one element after the batch, on its stream: torch's pinned
                # memory allocator then holds the host pool's block until the batch is over, even if
                # the pool is dropped before (the 2-D copies bypass torch and record nothing).
                self._tag.copy_(self._host.view(-1)[:1], non_blocking=True)
            return
        ids = torch.from_numpy(gpu)
        if self._stream is not None:
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        size = self.staging_pages
        for start in range(0, gpu.size, size):
            chunk = ids[start : start + size]
            count = chunk.shape[0]
            staging = self._staging[:count]
            runs = _runs(host[start : start + size])
            if saving:
                for tensor, slot in self._parts:
                    torch.index_select(tensor, 0, chunk, out=staging[(slice(None), *slot)])
                for first, last, page in runs:
                    self._host[page : page + last - first].copy_(staging[first:last], non_blocking=True)
            else:
                for first, last, page in runs:
                    staging[first:last].copy_(self._host[page : page + last - first], non_blocking=True)
                for tensor, slot in self._parts:
                    tensor.index_copy_(0, chunk, staging[(slice(None), *slot)])


def _merge_layers(parts: list[tuple[torch.Tensor, tuple]]) -> list[tuple[torch.Tensor, tuple]]:
    """The per-layer (tensor, staging slot) parts, each group of the same kind across layers (5-D
    layers; K; V) merged into one ``[num_pages, layers, ...]`` view where its layers are consecutive
    and equal views of one storage at a regular positive step: one op then moves all of them, its
    slot a slice of the staging page's layer axis. Groups that do not line up stay per layer."""
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for tensor, slot in parts:
        groups.setdefault(slot[1:], []).append((slot[0], tensor))
    merged = []
    for rest, members in groups.items():
        layers = [layer for layer, _ in members]
        tensors = [tensor for _, tensor in members]
        first = tensors[0]
        offsets = [t.storage_offset() for t in tensors]
        step = offsets[1] - offsets[0] if len(tensors) > 1 else 0
        regular = (
            step > 0
            and layers == list(range(layers[0], layers[0] + len(layers)))
            and all(
                t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and t.shape == first.shape
                and t.stride() == first.stride()
                and offset == offsets[0] + i * step
                for i, (t, offset) in enumerate(zip(tensors, offsets, strict=True))
            )
        )
        if regular:
            size = (first.shape[0], len(tensors), *first.shape[1:])
            stride = (first.stride(0), step, *first.stride()[1:])
            span = slice(layers[0], layers[0] + len(layers))
            merged.append((first.as_strided(size, stride, offsets[0]), (span, *rest)))
        else:
            merged += [(tensor, (layer, *rest)) for layer, tensor in members]
    return merged


def _widest_views(tensors: list[torch.Tensor], itemsize: int) -> list[torch.Tensor] | None:
    """The tensors viewed as the widest integer type (up to 8 bytes, at least ``itemsize``) that
    views all of them: the gather and scatter kernels then move 8 bytes per element, not 2 or 1.
    None when no integer type has ``itemsize`` bytes."""
    for width, bits in sorted(_BITS.items(), reverse=True):
        if width < itemsize:
            break
        try:
            return [tensor.view(bits) for tensor in tensors]
        except RuntimeError:
            continue  # head_dim bytes, a stride or an offset not a multiple of width
    return None


def _page_ids(pages: PageIds, name: str, limit: int) -> np.ndarray:
    """``pages`` as a 1-D int64 array of ids in ``[0, limit)``; ValueError naming ``name`` otherwise."""
    ids = np.asarray(pages)
    if ids.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of page ids, got shape {ids.shape}")
    if ids.size == 0:
        return ids.astype(np.int64)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integer page ids, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= limit)]
    if bad.size:
        raise ValueError(f"{name} holds page {int(bad[0])}, outside the pool's pages 0..{limit - 1}")
    return ids.astype(np.int64)


def _runs(host: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first, last, host page)`` per run of consecutive host pages in one chunk: batch positions
    ``first:last`` go to host pages ``page:page + last - first``."""
    cuts = (np.flatnonzero(np.diff(host) != 1) + 1).tolist()
    starts = [0, *cuts]
    ends = [*cuts, host.size]
    return [(a, b, int(host[a])) for a, b in zip(starts, ends, strict=True)]

"""Page copies straight between a KV pool and the host pool, as 2-D memory copies (no gather kernel).

Where every layer's part of a page sits at a regular step in the KV pool (an engine that allocates
its pool as one ``[num_layers, ...]`` tensor), one page of one tensor is ``rows`` runs of ``width``
contiguous bytes ``src_pitch`` apart, and its place in a host page is the same runs ``dst_pitch``
apart. One ``cudaMemcpy2DAsync`` then moves it on the copy engine: no kernel runs on the SMs beside
the model's, and nothing is staged. The price is host time: one call per page and tensor.
On CPU tensors the same copies run as ``memmove`` per run, so the address arithmetic is the one the
tests check.

``DirectCopies.plan`` returns None for layouts whose page is not such runs on both sides (an HND
pool, whose host page is NHD) and for pools of more than ``MAX_PARTS`` tensors per page (one copy
per layer and page costs more host time than one gather per layer); the mover gathers those.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

#: Most tensors a page may span for direct copies (one 2-D copy each, per page).
MAX_PARTS = 2

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_CUDA_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch


@dataclass(frozen=True)
class _Part:
    """One tensor's share of a page: ``rows`` runs of ``width`` bytes, at ``src`` + page *
    ``src_page`` (``src_pitch`` apart) in the KV pool and at ``dst`` + host page * ``dst_page``
    (``dst_pitch`` apart) in the host pool. Addresses and sizes in bytes."""

    src: int
    src_page: int
    src_pitch: int
    dst: int
    dst_page: int
    dst_pitch: int
    rows: int
    width: int


def _common_runs(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, width, pitch in ``a``, pitch in ``b``), in bytes, when the views ``a`` and ``b`` (one
    shape, one dtype) are both ``rows`` runs of ``width`` contiguous bytes in the same element order:
    the innermost dims contiguous in both make a run, the dims above them must merge into one row
    dim in both. None when they do not."""
    dims = [(size, sa, sb) for size, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if size != 1]
    inner = 1
    while dims and dims[-1][1] == inner and dims[-1][2] == inner:
        inner *= dims.pop()[0]
    rows, pitch_a, pitch_b = 1, inner, inner
    if dims:
        rows, pitch_a, pitch_b = dims.pop()
        for size, sa, sb in reversed(dims):  # outer dims must continue the row dim's steps
            if sa != pitch_a * rows or sb != pitch_b * rows:
                return None
            rows *= size
    size = a.element_size()
    return rows, inner * size, pitch_a * size, pitch_b * size


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses of ``tensor``'s storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class DirectCopies:
    """The 2-D copies that move a page between the KV pool's tensors and the host pool, and their
    launcher (``cudaMemcpy2DAsync`` on CUDA, ``memmove`` on CPU)."""

    def __init__(self, parts: list[_Part], cuda: bool) -> None:
        self._parts = parts
        self._copy2d = _cuda_memcpy2d_async() if cuda else None

    @classmethod
    def plan(cls, parts: list[tuple[torch.Tensor, tuple]], host: torch.Tensor) -> DirectCopies | None:
        """The copies for ``parts`` (the mover's ``(tensor [num_pages, ...], slot in a host page)``)
        and ``host`` (``[host_pages, ...]``, one dtype with the parts), or None where the layout needs
        a gather: more than ``MAX_PARTS`` tensors, a page that is not runs of the same bytes on both
        sides (rows that overlap included), or on CUDA no CUDA runtime library to call or a pitch
        past the device's ``cudaDevAttrMaxPitch`` (a layer step larger than that)."""
        if len(parts) > MAX_PARTS:
            return None
        device = parts[0][0].device
        cuda = device.type == "cuda"
        max_pitch = None
        if cuda:
            if _cuda_memcpy2d_async() is None:
                return None
            max_pitch = _max_pitch(device.index if device.index is not None else torch.cuda.current_device())
            if max_pitch is None:
                return None
        planned = []
        for tensor, slot in parts:
            region = host[0][slot]
            runs = _common_runs(tensor[0], region)
            if runs is None:
                return None
            rows, width, src_pitch, dst_pitch = runs
            if rows > 1 and min(src_pitch, dst_pitch) < width:
                return None
            if cuda and max(src_pitch, dst_pitch) > max_pitch:
                return None
            part = _Part(
                src=tensor.data_ptr(),
                src_page=tensor.stride(0) * tensor.element_size(),
                src_pitch=src_pitch,
                dst=region.data_ptr(),
                dst_page=host.stride(0) * host.element_size(),
                dst_pitch=dst_pitch,
                rows=rows,
                width=width,
            )
            # every byte a copy may touch lies inside the two storages (memmove on CPU trusts it)
            for base, step, pitch, pages, owner in (
                (part.src, part.src_page, src_pitch, tensor.shape[0], tensor),
                (part.dst, part.dst_page, dst_pitch, host.shape[0], host),
            ):
                first, end = _span(owner)
                highest = base + step * (pages - 1) + pitch * (rows - 1) + width
                if min(step, pitch) < 0 or base < first or highest > end:
                    return None
            planned.append(part)
        return cls(planned, cuda)

    def run(self, gpu: np.ndarray, host: np.ndarray, saving: bool, stream: int = 0) -> None:
        """Copies KV page ``gpu[i]`` to host page ``host[i]`` (``saving``) or back, for all i: one
        2-D copy per page and part, queued on the CUDA ``stream`` (a handle) or run now (CPU).
        Raises RuntimeError when the CUDA runtime refuses a copy (those before it are queued)."""
        copy2d = self._copy2d
        for part in self._parts:
            pool = ((part.src + gpu * part.src_page).tolist(), part.src_pitch)
            pinned = ((part.dst + host * part.dst_page).tolist(), part.dst_pitch)
            (src, src_pitch), (dst, dst_pitch) = (pool, pinned) if saving else (pinned, pool)
            width, rows = part.width, part.rows
            for s, d in zip(src, dst, strict=True):
                if copy2d is None:
                    for row in range(rows):
                        ctypes.memmove(d + row * dst_pitch, s + row * src_pitch, width)
                    continue
                status = copy2d(d, dst_pitch, s, src_pitch, width, rows, _CUDA_MEMCPY_DEFAULT, stream)
                if status:
                    raise RuntimeError(f"cudaMemcpy2DAsync failed: {_cuda_error(status)}")


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (by its soname), or None (also on ROCm)."""
    if torch.version.hip:
        return None
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.cache
def _cuda_memcpy2d_async():
    """``cudaMemcpy2DAsync`` with its argument types, or None without a CUDA runtime library."""
    library = _cudart()
    if library is None:
        return None
    function = library.cudaMemcpy2DAsync
    size = ctypes.c_size_t
    pointer = ctypes.c_void_p
    function.argtypes = [pointer, size, pointer, size, size, size, ctypes.c_int, pointer]
    function.restype = ctypes.c_int
    return function


@functools.cache
def _max_pitch(device: int) -> int | None:
    """The largest pitch a 2-D copy on CUDA ``device`` takes, in bytes (``cudaDevAttrMaxPitch``)."""
    value = ctypes.c_int()
    status = _cudart().cudaDeviceGetAttribute(ctypes.byref(value), _CUDA_DEV_ATTR_MAX_PITCH, device)
    if status:
        _cuda_error(status)  # clears the refusal
        return None
    return value.value


def _cuda_error(status: int) -> str:
    """The CUDA runtime's name for error ``status``; clears the thread's last error, which a
    refused call sets (torch's next kernel launch check would report it as its own)."""
    library = _cudart()
    library.cudaGetLastError()
    library.cudaGetErrorString.restype = ctypes.c_char_p
    return f"{library.cudaGetErrorString(status).decode()} ({status})"

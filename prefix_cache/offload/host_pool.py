"""The host tier's storage: a pinned CPU tensor of KV pages laid out page-first (torch only).

One host page holds a page of every layer, K and V: ``[num_layers, 2, page_size, num_kv_heads,
head_dim]``, contiguous. Moving a run of consecutive host pages is then one copy of one contiguous
chunk, whatever the number of layers; a layer-first layout would cost one copy per layer per run.
"""

from __future__ import annotations

import os

import torch

from prefix_cache.cache.errors import PrefixCacheError


class PinningError(PrefixCacheError):
    """The host pool's memory could not be allocated pinned (page-locked). Nothing was allocated."""


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class HostKVPool:
    """``host_pages`` KV pages in host memory, page-first, pinned when asked (the default with CUDA).

    ``pages`` is the ``[host_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` tensor: host
    page ``h`` is ``pages[h]``, K of layer ``l`` is ``pages[h, l, 0]`` and V ``pages[h, l, 1]``, each
    ``[page_size, num_kv_heads, head_dim]`` (NHD, whatever layout the GPU pool has). Pinned memory is
    what lets the copies to and from the GPU run asynchronously at full bus speed.

    Raises ValueError for a size out of range (``host_pages`` < 1, or more bytes than the machine has),
    and ``PinningError`` when the pinned allocation fails (or ``pin`` is asked for without CUDA).
    """

    def __init__(
        self,
        host_pages: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin: bool | None = None,
    ) -> None:
        sizes = dict(
            host_pages=host_pages,
            num_layers=num_layers,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = (host_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        page_bytes = num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize
        total = host_pages * page_bytes
        available = physical_memory_bytes()
        if available is not None and total > available:
            raise ValueError(
                f"host_pages={host_pages} needs {total / 2**30:.1f} GiB ({page_bytes} bytes a page), "
                f"more than this machine's {available / 2**30:.1f} GiB of memory"
            )
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise PinningError("a pinned host pool needs CUDA (pin=True without a CUDA device)")
        try:
            pages = torch.empty(shape, dtype=dtype, pin_memory=pin)
        except RuntimeError as error:
            kind = "pinned " if pin else ""
            raise PinningError(
                f"could not allocate {total / 2**30:.2f} GiB of {kind}host memory for host_pages="
                f"{host_pages}: {error}"
            ) from error
        if pin and not pages.is_pinned():
            raise PinningError(f"the host pool of host_pages={host_pages} was allocated but is not pinned")
        self.pages: torch.Tensor = pages
        self.page_bytes: int = page_bytes
        self.pinned: bool = bool(pin)

    @property
    def num_pages(self) -> int:
        """Host pages in the pool."""
        return self.pages.shape[0]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One host page: ``(num_layers, 2, page_size, num_kv_heads, head_dim)``."""
        return tuple(self.pages.shape[1:])  # type: ignore[return-value]

    @property
    def dtype(self) -> torch.dtype:
        """The KV dtype the pool holds."""
        return self.pages.dtype

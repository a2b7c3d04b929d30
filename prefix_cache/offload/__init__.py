"""The host tier's data path (torch only): a pinned, page-first host pool of KV pages and a mover that
saves GPU pages to it and loads them back in batches, on a side CUDA stream ordered by events.

Imported only by who uses it: ``import prefix_cache`` never loads torch.
"""

from __future__ import annotations

from prefix_cache.offload.handle import CopyHandle
from prefix_cache.offload.host_pool import HostKVPool, PinningError
from prefix_cache.offload.mover import KVMover

__all__ = ["CopyHandle", "HostKVPool", "KVMover", "PinningError"]

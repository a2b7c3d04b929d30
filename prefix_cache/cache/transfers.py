"""The copies between the GPU pool and the host tier that the cache asks an engine to make."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class Transfers:
    """One batch of copies, from ``PrefixCache.take_transfers``; hand it back to
    ``PrefixCache.transfers_done`` once the copies are made.

    saves: int32 ``[n, 2]``, rows ``(gpu_page, host_page)``: copy the KV of GPU page ``gpu_page``
        (every layer, K and V) into host page ``host_page``. Runs evicted from the GPU (write-back)
        or just cached on it (write-through).
    loads: int32 ``[m, 2]``, rows ``(host_page, gpu_page)``: copy host page ``host_page`` into GPU
        page ``gpu_page``. Prefixes found on the host by ``open`` / ``admit``.
    ticket: the batch's number, counting from 1 in the order batches were taken.

    Order: the saves before the loads (a GPU page a save reads may be a page a load of the same
    batch writes), batches in the order they were taken, all before any kernel enqueued after
    the batch was taken that writes a saved GPU page or reads a loaded one, and after every
    kernel enqueued before it (a page just handed out may still be read by one). Copies on one
    stream in that order, with the compute stream waiting on them, meet all of it.
    """

    saves: np.ndarray
    loads: np.ndarray
    ticket: int

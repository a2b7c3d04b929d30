"""``PrefixCache``'s calls for its host tier (``prefix_cache.cache.host_tier``), kept apart from the
per-step calls of every cache: the copy batches (``take_transfers`` / ``transfers_done``), the
two-tier match, the counts, and the tier's parts of ``open`` and ``reset``. ``PrefixCache`` inherits
them; they use its lock, store and counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prefix_cache.cache.hashing import ExtraKey, Namespace, check_namespace, page_extras
from prefix_cache.cache.tokens import as_token_array
from prefix_cache.cache.transfers import Transfers

if TYPE_CHECKING:
    from prefix_cache.cache.sequence import Sequence


class HostTierCalls:
    """The host tier's part of ``PrefixCache`` (a base class: it has no state of its own)."""

    @property
    def num_host_pages(self) -> int:
        """Pages of the host tier (0 without one)."""
        return 0 if self._tier is None else self._tier.num_pages

    @property
    def num_host_cached_pages(self) -> int:
        """Host pages holding KV: runs evicted from the GPU, and with write-through copies of runs
        still on it; a copy whose save is not done yet counts, but is matched only once it is."""
        return 0 if self._tier is None else self._tier.num_cached

    def take_transfers(self) -> Transfers | None:
        """The copies between the GPU pool and the host tier queued since the last call, as one
        batch (``Transfers``: saves of evicted runs, or with write-through of newly cached ones;
        loads of prefixes ``open`` / ``admit`` found on the host), or None when there are none (and
        always without a host tier). Call it once per step, after the step's ``open`` / ``admit`` /
        ``allocate`` calls and before its forward, and make the copies in the order ``Transfers``
        states; then ``transfers_done``.
        """
        if self._tier is None:
            return None
        self._enter()
        try:
            return self._tier.take_batch()
        finally:
            self._baton.append(None)

    def transfers_done(self, batch: Transfers, ok: bool = True) -> None:
        """The copies of ``batch`` are made (``ok``), or failed or were never made (``ok=False``).

        Done: the loading sequences' tokens count as computed (``num_loading_tokens`` drops to
        0) and their pages become cached. Failed: those sequences fall back to their GPU prefix
        (``num_cached_tokens`` and ``num_tokens`` drop to it, tokens committed after the loaded
        ones included; the block table keeps its pages, to be computed again), and the runs the
        batch's saves wrote leave the host tier. Either way the host pages its loads read are
        released. Raises ValueError, changing nothing, for a batch that is not in flight. An
        error of a caller's ``hash_fn`` while caching the loaded pages makes that sequence fall
        back as for a failed load, and is raised once the whole batch is done.
        """
        if not isinstance(batch, Transfers):
            raise TypeError(f"expected Transfers from take_transfers, got {type(batch).__name__}")
        if type(ok) is not bool:
            raise TypeError(f"ok must be a bool, got {type(ok).__name__}")
        self._enter()
        try:
            tier = self._tier
            if tier is None or not tier.in_flight_batch(batch):
                raise ValueError(
                    f"transfer batch {batch.ticket} is not in flight (done twice, or not this cache's)"
                )
            failed: BaseException | None = None
            waiting = tier.finish(batch, ok)
            for seq in waiting:
                loaded = seq._loading
                seq._loading = 0
                if ok:
                    try:
                        self._store.store_full_pages(seq, seq._num_tokens)
                        tier.loaded_pages += loaded // self._page_size
                        continue
                    except Exception as error:  # a caller's hash_fn: this sequence recomputes
                        failed = failed or error
                seq._num_cached_tokens -= loaded
                seq._num_tokens = seq._num_cached_tokens
                self._hit_tokens -= loaded
                self._host_hit_tokens -= loaded
            if failed is not None:
                raise failed
        finally:
            self._baton.append(None)

    def match_tiers(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> tuple[int, int]:
        """``(gpu_tokens, host_tokens)``: the cached prefix ``open`` would find now, its tokens on
        the GPU (``match``) and the further tokens on the host tier it would load (at most what
        the GPU pool can take). Changes nothing."""
        arr = as_token_array(tokens)
        check_namespace(namespace)
        extras = page_extras(extra_keys, len(arr), self._page_size)
        self._enter()
        try:
            walk = self._prefix_walk(arr, namespace, extras)
            page_size = self._page_size
            gpu = walk.pages * page_size
            tier = self._tier
            if tier is None or not self._tree.num_host_nodes or walk.partial:
                return gpu, 0
            num_pages = (len(arr) - 1) // page_size
            start = walk.last(self._tree.roots.get(namespace))
            if start is None or walk.pages >= num_pages:
                return gpu, 0
            page_extras_list = [extras.get(i, b"") for i in range(num_pages)] if extras else None
            found = tier.walk(start, arr.tobytes(), walk.pages, num_pages, page_extras_list)
            locked = sum(len(node.pages) for node in walk.nodes if not node.ref)
            room = len(self._pool.free) + self._tree.num_unreferenced - locked
            return gpu, max(0, min(found.pages, room)) * page_size
        finally:
            self._baton.append(None)

    def _clear_tiers(self) -> None:
        """``reset`` with a host tier: every run leaves the tree, both tiers' pages are free."""
        tree = self._tree
        gpu = [node.pages for node in tree.nodes() if node.pages is not None]
        for pages in gpu:
            self._pool.free += pages
        self._store.evicted_pages += tree.num_pages
        tree.roots.clear()
        tree.recent.clear()
        tree.num_pages = tree.num_unreferenced = tree.num_lru = tree.num_host_nodes = 0
        tree.version += 1
        self._tier.evicted_pages += self._tier.num_cached
        self._tier.clear()

    def _open_host(self, seq: Sequence, arr: np.ndarray, extras: dict[int, bytes]) -> int:
        """The part of ``_open`` for the host tier: the host runs that continue the prompt after
        the sequence's GPU prefix (as many pages as the GPU pool can supply) get GPU pages, their
        loads are queued and their host pages pinned. Returns the tokens to load."""
        tier = self._tier
        page_size = self._page_size
        start = seq._num_pages
        num_pages = (len(arr) - 1) // page_size
        if start >= num_pages:
            return 0
        page_extras = [extras.get(i, b"") for i in range(num_pages)] if extras else None
        found = tier.walk(seq._node, arr.tobytes(), start, num_pages, page_extras)
        count = min(found.pages, len(self._pool.free) + self._tree.num_unreferenced)
        if not count:
            return 0
        # Pinned before the GPU pages are taken: making room on the host for what that evicts
        # from the GPU cannot then reuse a page these loads read.
        host = tier.pin(found, count)
        end = (start + count) * page_size
        self._store.allocate(seq, end)
        tier.queue_load(seq, host, seq._pages[start : start + count])
        seq._tokens[start * page_size : end] = arr[start * page_size : end]
        seq._loading = count * page_size
        return seq._loading

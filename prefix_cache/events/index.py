"""``BlockIndex``: which replica holds which blocks, from the replicas' KV events (a router's view).

Fed with each replica's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, it answers
"for these prompt tokens, in this namespace, how many leading tokens does each replica hold" by
computing the prompt's chained block hashes exactly as ``PrefixCache`` does (through
:mod:`prefix_cache.cache.hashing`) and looking each one up. A cache evicts a page only after the pages that
follow it, so a replica holding a block also holds the blocks before it; the count is the run of
leading blocks the replica holds. Hashes are not confirmed against tokens here: a collision can
overstate a replica's prefix, which costs a routing choice, never correctness (the replica's own
cache compares tokens).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from prefix_cache.cache import events as cache_events
from prefix_cache.cache.hashing import ExtraKey, Namespace, default_hash_fn, namespace_seed, page_extras
from prefix_cache.cache.tokens import as_token_array

_LE_INT32 = np.dtype("<i4")


def block_hashes(
    tokens: object,
    page_size: int,
    namespace: Namespace = None,
    num_pages: int | None = None,
    *,
    extra_keys: list[ExtraKey] | None = None,
) -> list[int]:
    """The chained keys of the full pages of ``tokens`` (1-D non-negative ints), first page first:
    the ``block_hashes`` a ``PrefixCache(page_size=page_size)`` with the default hash publishes for
    them, opened with the same ``namespace`` and ``extra_keys``. ``num_pages`` caps how many
    (default: every full page)."""
    arr = as_token_array(tokens)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    full = len(arr) // page_size
    count = full if num_pages is None else min(full, num_pages)
    return list(_chain(arr, page_size, namespace, extra_keys, count))


def _chain(
    arr: np.ndarray, page_size: int, namespace: Namespace, extra_keys: list[ExtraKey] | None, count: int
) -> Iterator[int]:
    """The keys of the first ``count`` pages of ``arr``, lazily (a lookup stops at its first miss)."""
    extras = page_extras(extra_keys, len(arr), page_size)
    data = arr.astype(_LE_INT32, copy=False).tobytes()
    step = 4 * page_size
    key = namespace_seed(namespace)
    for page in range(count):
        identity = data[page * step : (page + 1) * step]
        if page in extras:
            identity += extras[page]
        key = default_hash_fn(identity, key)
        yield key


class BlockIndex:
    """The blocks each of ``num_replicas`` replicas holds, keyed by block hash.

    ``apply(replica, events)`` takes a replica's events in the order it emitted them;
    ``match(tokens, namespace)`` returns cached tokens per replica. Replicas are numbered
    ``0 .. num_replicas - 1``; all use pages of ``page_size`` tokens and the default block hash.
    """

    def __init__(self, num_replicas: int, page_size: int) -> None:
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.num_replicas = num_replicas
        self.page_size = page_size
        # Block hash -> bit mask of the replicas holding it; and each replica's hashes, for clear().
        self._owners: dict[int, int] = {}
        self._blocks: list[set[int]] = [set() for _ in range(num_replicas)]

    def num_blocks(self, replica: int) -> int:
        """Blocks ``replica`` holds."""
        return len(self._blocks[self._check_replica(replica)])

    def apply(self, replica: int, events: list[cache_events.KVCacheEvent]) -> None:
        """Apply ``replica``'s events, oldest first. A ``BlockStored`` of another page size raises
        ValueError before anything is applied."""
        self._check_replica(replica)
        for event in events:
            if type(event) is cache_events.BlockStored and event.block_size != self.page_size:
                raise ValueError(
                    f"replica {replica} stored blocks of {event.block_size} tokens; "
                    f"the index uses {self.page_size}"
                )
        bit = 1 << replica
        owners, mine = self._owners, self._blocks[replica]
        for event in events:
            kind = type(event)
            if kind is cache_events.BlockStored:
                for key in event.block_hashes:
                    if key not in mine:
                        mine.add(key)
                        owners[key] = owners.get(key, 0) | bit
            elif kind is cache_events.BlockRemoved:
                for key in event.block_hashes:
                    if key in mine:
                        mine.discard(key)
                        self._drop_owner(key, bit)
            elif kind is cache_events.AllBlocksCleared:
                self.clear(replica)
            else:
                raise TypeError(f"unknown event type {kind.__name__}")

    def clear(self, replica: int) -> None:
        """Forget every block of ``replica`` (on ``AllBlocksCleared``, or to resynchronise)."""
        bit = 1 << self._check_replica(replica)
        for key in self._blocks[replica]:
            self._drop_owner(key, bit)
        self._blocks[replica] = set()

    def match(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> list[int]:
        """Leading tokens of ``tokens`` each replica holds (whole pages, at most ``len(tokens) - 1``,
        like ``PrefixCache.match`` with the same ``namespace`` and ``extra_keys``), as a list
        indexed by replica."""
        arr = as_token_array(tokens)
        ps = self.page_size
        counts = [0] * self.num_replicas
        num_pages = (len(arr) - 1) // ps if len(arr) else 0
        if num_pages == 0 or not self._owners:
            return counts
        alive = (1 << self.num_replicas) - 1
        owners = self._owners
        for page, key in enumerate(_chain(arr, ps, namespace, extra_keys, num_pages)):
            alive &= owners.get(key, 0)
            if not alive:
                break
            mask, replica = alive, 0
            while mask:
                if mask & 1:
                    counts[replica] = (page + 1) * ps
                mask >>= 1
                replica += 1
        return counts

    def _drop_owner(self, key: int, bit: int) -> None:
        left = self._owners[key] & ~bit
        if left:
            self._owners[key] = left
        else:
            del self._owners[key]

    def _check_replica(self, replica: int) -> int:
        if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be an int in [0, {self.num_replicas - 1}], got {replica!r}")
        return replica

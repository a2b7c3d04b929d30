"""``BlockIndex``: which replica holds which blocks, from the replicas' KV events (a router's view).

Fed with each replica's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, it answers
"for these prompt tokens, in this namespace, how many leading tokens does each replica hold" by
computing the prompt's chained block keys the way each replica's engine does (its
:mod:`hash scheme <prefix_cache.events.schemes>`: this library's by default, or a vLLM engine's) and
looking each one up. A cache evicts a page only after the pages that follow it, so a replica holding
a block also holds the blocks before it; the count is the run of leading blocks the replica holds.
Hashes are not confirmed against tokens here: a collision can overstate a replica's prefix, which
costs a routing choice, never correctness (the replica's own cache compares tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_cache.cache import events as cache_events
from prefix_cache.cache.hashing import ExtraKey, Namespace, check_namespace, page_extras
from prefix_cache.cache.tokens import as_token_array
from prefix_cache.events.schemes import HashScheme, PrefixCacheHash, VllmHash


def block_hashes(
    tokens: object,
    page_size: int,
    namespace: Namespace = None,
    num_pages: int | None = None,
    *,
    extra_keys: list[ExtraKey] | None = None,
    scheme: HashScheme | None = None,
) -> list[int]:
    """The chained keys of the full pages of ``tokens`` (1-D non-negative ints), first page first:
    the ``block_hashes`` a ``PrefixCache(page_size=page_size)`` with the default hash publishes for
    them, opened with the same ``namespace`` and ``extra_keys`` (or, with ``scheme``, those an
    engine hashing with it publishes). ``num_pages`` caps how many (default: every full page)."""
    arr = as_token_array(tokens)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    full = len(arr) // page_size
    count = full if num_pages is None else min(full, num_pages)
    return list((scheme or PrefixCacheHash()).keys(arr, page_size, namespace, extra_keys, count))


class BlockIndex:
    """The blocks each of ``num_replicas`` replicas holds, keyed by block hash.

    ``apply(replica, events)`` takes a replica's events in the order it emitted them;
    ``match(tokens, namespace)`` returns cached tokens per replica. Replicas are numbered
    ``0 .. num_replicas - 1``; all use pages of ``page_size`` tokens. ``schemes`` gives each
    replica's block hash (default: ``PrefixCacheHash()`` for all; a :class:`VllmHash` for a vLLM
    replica); replicas with equal schemes share one key computation per ``match``.
    """

    def __init__(
        self, num_replicas: int, page_size: int, schemes: Sequence[HashScheme] | None = None
    ) -> None:
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if schemes is None:
            schemes = [PrefixCacheHash()] * num_replicas
        schemes = list(schemes)
        if len(schemes) != num_replicas:
            raise ValueError(f"schemes must hold one scheme per replica ({num_replicas}), got {len(schemes)}")
        for scheme in schemes:
            if not isinstance(scheme, (PrefixCacheHash, VllmHash)):
                raise TypeError(f"schemes must hold PrefixCacheHash or VllmHash, got {type(scheme).__name__}")
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.schemes: tuple[HashScheme, ...] = tuple(schemes)
        # One key space per distinct scheme: (scheme, bit mask of its replicas, key -> owner mask).
        groups: dict[HashScheme, int] = {}
        for replica, scheme in enumerate(schemes):
            groups[scheme] = groups.get(scheme, 0) | 1 << replica
        self._groups: list[tuple[HashScheme, int, dict[int, int]]] = [
            (scheme, mask, {}) for scheme, mask in groups.items()
        ]
        self._owners_of = [next(g[2] for g in self._groups if g[1] >> r & 1) for r in range(num_replicas)]
        self._blocks: list[set[int]] = [set() for _ in range(num_replicas)]

    def num_blocks(self, replica: int) -> int:
        """Blocks ``replica`` holds."""
        return len(self._blocks[self._check_replica(replica)])

    def num_keys(self) -> int:
        """Distinct (scheme, key) entries held by any replica: the index's size."""
        return sum(len(owners) for _, _, owners in self._groups)

    def apply(self, replica: int, events: list[cache_events.KVCacheEvent]) -> None:
        """Apply ``replica``'s events, oldest first. A ``BlockStored`` of another page size or an
        unknown event raises before anything is applied."""
        self._check_replica(replica)
        for event in events:
            kind = type(event)
            if kind is cache_events.BlockStored:
                if event.block_size != self.page_size:
                    raise ValueError(
                        f"replica {replica} stored blocks of {event.block_size} tokens; "
                        f"the index uses {self.page_size}"
                    )
            elif kind is not cache_events.BlockRemoved and kind is not cache_events.AllBlocksCleared:
                raise TypeError(f"unknown event type {kind.__name__}")
        bit = 1 << replica
        owners, mine = self._owners_of[replica], self._blocks[replica]
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
                        _drop_owner(owners, key, bit)
            else:
                self.clear(replica)  # empties ``mine`` in place: later events of the batch apply to it

    def clear(self, replica: int) -> None:
        """Forget every block of ``replica`` (on ``AllBlocksCleared``, or to resynchronise)."""
        bit = 1 << self._check_replica(replica)
        owners, mine = self._owners_of[replica], self._blocks[replica]
        for key in mine:
            _drop_owner(owners, key, bit)
        mine.clear()

    def match(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> list[int]:
        """Leading tokens of ``tokens`` each replica holds (whole pages, at most ``len(tokens) - 1``,
        like ``PrefixCache.match`` with the same ``namespace`` and ``extra_keys``), as a list
        indexed by replica. Bad arguments raise whatever the index holds."""
        arr = as_token_array(tokens)
        check_namespace(namespace)
        page_extras(extra_keys, len(arr), self.page_size)  # checks them
        ps = self.page_size
        counts = [0] * self.num_replicas
        num_pages = (len(arr) - 1) // ps if len(arr) else 0
        if num_pages == 0:
            return counts
        for scheme, members, owners in self._groups:
            if not owners:
                continue
            alive = members
            for page, key in enumerate(scheme.keys(arr, ps, namespace, extra_keys, num_pages)):
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

    def _check_replica(self, replica: int) -> int:
        if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be an int in [0, {self.num_replicas - 1}], got {replica!r}")
        return replica


def _drop_owner(owners: dict[int, int], key: int, bit: int) -> None:
    left = owners[key] & ~bit
    if left:
        owners[key] = left
    else:
        del owners[key]

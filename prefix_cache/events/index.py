"""``BlockIndex``: which replica holds which blocks, from the replicas' KV events (a router's view).

Fed with each replica's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, it answers
"for these prompt tokens, in this namespace, how many leading tokens does each replica hold" by
computing the prompt's chained block keys the way each replica's engine does (its
:mod:`hash scheme <prefix_cache.events.schemes>`: this library's by default, or a vLLM engine's) and
looking each one up. A cache evicts a page only after the pages that follow it, so a replica holding
a block also holds the blocks before it; the count is the run of leading blocks the replica holds.
Hashes are not confirmed against tokens here: a collision can overstate a replica's prefix, which
costs a routing choice, never correctness (the replica's own cache compares tokens).

The index knows each block's tiers, from the events' ``medium``: ``"GPU"`` and ``"CPU"`` (the host
tier), one or both per block. ``match`` counts a prompt's leading blocks held on either tier (what
the replica need not recompute); ``match_tiers`` splits that count into the part on the GPU and the
part to be loaded from the host. Events of other media (vLLM's ``"STORAGE"``, say) are not counted:
an under-report, never a false hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_cache.cache import events as cache_events
from prefix_cache.cache.events import MEDIUM_CPU, MEDIUM_GPU
from prefix_cache.cache.hashing import ExtraKey, Namespace, check_namespace, page_extras
from prefix_cache.cache.tokens import as_token_array
from prefix_cache.events.schemes import HashScheme, PrefixCacheHash, VllmHash

#: The media the index follows, as the bits of a block's tiers (``BlockIndex._blocks``).
_GPU, _CPU = 1, 2
_TIERS = {MEDIUM_GPU: _GPU, MEDIUM_CPU: _CPU}


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
    ``match(tokens, namespace)`` returns cached tokens per replica, ``match_tiers`` the same split
    into the GPU part and the host part (see the module docstring). Replicas are numbered
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
        # One key space per distinct scheme: (scheme, bit mask of its replicas, key -> mask of the
        # replicas holding it on any tier, key -> mask of those holding it on the GPU).
        groups: dict[HashScheme, int] = {}
        for replica, scheme in enumerate(schemes):
            groups[scheme] = groups.get(scheme, 0) | 1 << replica
        self._groups: list[tuple[HashScheme, int, dict[int, int], dict[int, int]]] = [
            (scheme, mask, {}, {}) for scheme, mask in groups.items()
        ]
        group_of = [next(g for g in self._groups if g[1] >> r & 1) for r in range(num_replicas)]
        self._owners_of = [group[2] for group in group_of]
        self._on_gpu_of = [group[3] for group in group_of]
        #: Per replica, key -> the tiers it holds the block on (``_TIERS`` bits, never 0).
        self._blocks: list[dict[int, int]] = [{} for _ in range(num_replicas)]

    def num_blocks(self, replica: int) -> int:
        """Distinct blocks ``replica`` holds, on either tier (a block on both counts once)."""
        return len(self._blocks[self._check_replica(replica)])

    def num_keys(self) -> int:
        """Distinct (scheme, key) entries held by any replica: the index's size."""
        return sum(len(owners) for _, _, owners, _ in self._groups)

    def apply(self, replica: int, events: list[cache_events.KVCacheEvent]) -> None:
        """Apply ``replica``'s events, oldest first: ``BlockStored`` adds its ``medium`` to each
        block's tiers, ``BlockRemoved`` takes it away (the block stays while the other tier holds
        it). A ``BlockStored`` of another page size or an unknown event raises before anything is
        applied."""
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
        owners, on_gpu, mine = self._owners_of[replica], self._on_gpu_of[replica], self._blocks[replica]
        for event in events:
            kind = type(event)
            if kind is cache_events.AllBlocksCleared:
                self.clear(replica)  # empties ``mine`` in place: later events of the batch apply to it
                continue
            tier = _TIERS.get(event.medium, 0)
            if not tier:
                continue
            if kind is cache_events.BlockStored:
                for key in event.block_hashes:
                    held = mine.get(key, 0)
                    if held & tier:
                        continue
                    mine[key] = held | tier
                    if not held:
                        owners[key] = owners.get(key, 0) | bit
                    if tier == _GPU:
                        on_gpu[key] = on_gpu.get(key, 0) | bit
            else:
                for key in event.block_hashes:
                    held = mine.get(key, 0)
                    if not held & tier:
                        continue
                    if held == tier:
                        del mine[key]
                        _drop_owner(owners, key, bit)
                    else:
                        mine[key] = held & ~tier
                    if tier == _GPU:
                        _drop_owner(on_gpu, key, bit)

    def clear(self, replica: int) -> None:
        """Forget every block of ``replica`` (on ``AllBlocksCleared``, or to resynchronise)."""
        bit = 1 << self._check_replica(replica)
        owners, on_gpu, mine = self._owners_of[replica], self._on_gpu_of[replica], self._blocks[replica]
        for key, held in mine.items():
            _drop_owner(owners, key, bit)
            if held & _GPU:
                _drop_owner(on_gpu, key, bit)
        mine.clear()

    def match(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> list[int]:
        """Leading tokens of ``tokens`` each replica holds on either tier, GPU or host (whole pages,
        at most ``len(tokens) - 1``), as a list indexed by replica: the prompt's tokens the replica
        need not recompute. For a replica without a host tier this is ``PrefixCache.match`` with
        the same ``namespace`` and ``extra_keys``; ``match_tiers`` splits it by tier. Bad arguments
        raise whatever the index holds."""
        return [gpu + host for gpu, host in self.match_tiers(tokens, namespace, extra_keys=extra_keys)]

    def match_tiers(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> list[tuple[int, int]]:
        """``(gpu_tokens, host_tokens)`` per replica, as a list indexed by replica, in tokens (whole
        pages, at most ``len(tokens) - 1`` together): ``gpu_tokens`` the longest prefix of
        ``tokens`` whose blocks the replica holds on the GPU, ``host_tokens`` the further tokens
        whose blocks it holds on either tier, so on the host from the first block the GPU lacks:
        what the replica would load rather than recompute. Their sum is ``match``. A router weighs
        the two (a load from host memory costs less than a prefill, more than a GPU hit)."""
        arr = as_token_array(tokens)
        check_namespace(namespace)
        page_extras(extra_keys, len(arr), self.page_size)  # checks them
        ps = self.page_size
        gpu_pages = [0] * self.num_replicas
        held_pages = [0] * self.num_replicas
        num_pages = (len(arr) - 1) // ps if len(arr) else 0
        if num_pages:
            for scheme, members, owners, on_gpu in self._groups:
                if not owners:
                    continue
                # The replicas holding every key so far, on either tier and on the GPU.
                anywhere = on_gpu_only = members
                walked = 0
                for key in scheme.keys(arr, ps, namespace, extra_keys, num_pages):
                    still = on_gpu_only & on_gpu.get(key, 0)
                    if still != on_gpu_only:
                        _set_bits(gpu_pages, on_gpu_only & ~still, walked)
                        on_gpu_only = still
                    still = anywhere & owners.get(key, 0)
                    if still != anywhere:
                        _set_bits(held_pages, anywhere & ~still, walked)
                        anywhere = still
                        if not anywhere:
                            break
                    walked += 1
                _set_bits(gpu_pages, on_gpu_only, walked)
                _set_bits(held_pages, anywhere, walked)
        return [(ps * gpu, ps * (held - gpu)) for gpu, held in zip(gpu_pages, held_pages, strict=True)]

    def _check_replica(self, replica: int) -> int:
        if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be an int in [0, {self.num_replicas - 1}], got {replica!r}")
        return replica


def _set_bits(counts: list[int], mask: int, value: int) -> None:
    """``counts[r] = value`` for every bit ``r`` set in ``mask``."""
    replica = 0
    while mask:
        if mask & 1:
            counts[replica] = value
        mask >>= 1
        replica += 1


def _drop_owner(owners: dict[int, int], key: int, bit: int) -> None:
    left = owners[key] & ~bit
    if left:
        owners[key] = left
    else:
        del owners[key]

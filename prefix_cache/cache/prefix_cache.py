"""``PrefixCache``: the engine-facing bookkeeping of KV pages shared by common prompt prefixes.

This module is the public API: argument checks (:mod:`prefix_cache.cache.arguments`), the lock, and the
sequences' lifecycle. ``PrefixCache`` inherits its other calls from mixins beside it: prefix matching
(:mod:`prefix_cache.cache.prefix_match`), the decode step's batch calls
(:mod:`prefix_cache.cache.batch_calls`), the calls on the whole cache
(:mod:`prefix_cache.cache.whole_cache_calls`), the counts (:mod:`prefix_cache.cache.cache_counts`)
and the host tier's calls (:mod:`prefix_cache.cache.host_tier_calls`). Pages move between the pool,
sequences and the block tree in :mod:`prefix_cache.cache.page_store`; events wait in
:mod:`prefix_cache.cache.event_log`; block tables are written into callers' buffers by
:mod:`prefix_cache.cache.block_tables`. The errors it raises live in :mod:`prefix_cache.cache.errors`
(re-exported here) and its consistency check in :mod:`prefix_cache.cache.invariants`.
"""

from __future__ import annotations

import numpy as np

from prefix_cache.cache.arguments import check_hash_fn, check_int, reject
from prefix_cache.cache.batch_calls import BatchCalls
from prefix_cache.cache.block_tables import BlockTableWriter
from prefix_cache.cache.block_tree import BlockTree
from prefix_cache.cache.cache_counts import CacheCounts
from prefix_cache.cache.errors import ConcurrentUseError, InvariantError, OutOfPages, PrefixCacheError
from prefix_cache.cache.event_log import EventLog
from prefix_cache.cache.hashing import (
    ExtraKey,
    HashFn,
    Namespace,
    check_namespace,
    default_hash_fn,
    page_extras,
)
from prefix_cache.cache.host_tier import HostTier
from prefix_cache.cache.host_tier_calls import HostTierCalls
from prefix_cache.cache.page_pool import PagePool
from prefix_cache.cache.page_store import PageStore
from prefix_cache.cache.prefix_match import PrefixMatch
from prefix_cache.cache.sequence import Sequence
from prefix_cache.cache.tokens import MAX_TOKEN_ID, as_token_array
from prefix_cache.cache.tree_nodes import Root, Walk
from prefix_cache.cache.whole_cache_calls import WholeCacheCalls

MAX_PAGE_SIZE = 1024
# Page ids are int32 in block tables.
MAX_NUM_PAGES = 2**31 - 1
# Pages a new sequence reserves room for beyond its prompt, so short decodes never grow buffers.
_DECODE_HEADROOM_PAGES = 8
#: Events kept waiting for ``drain_events`` by default (see ``max_events``).
DEFAULT_MAX_EVENTS = 100_000
#: Bytes of token ids and block hashes those events may hold by default (see ``max_event_bytes``).
DEFAULT_MAX_EVENT_BYTES = 64 << 20
_INT32 = np.dtype(np.int32)
_NDARRAY = np.ndarray

__all__ = ["ConcurrentUseError", "InvariantError", "OutOfPages", "PrefixCache", "PrefixCacheError"]


class PrefixCache(PrefixMatch, BatchCalls, WholeCacheCalls, CacheCounts, HostTierCalls):
    """Pages of a paged KV pool, shared between requests whose prompts start with the same tokens.

    A page holds ``page_size`` tokens. Full pages that a sequence commits become cached under the
    chained hash of their tokens (see ``prefix_cache.cache.hashing``); a later prompt that starts with
    the same whole pages, in the same namespace, reuses them. Each page is at all times exactly one
    of: free, held by live sequences, or cached and evictable (held by none; evicted least recently
    used first, deepest pages first).

    Per request: ``open`` (locks the cached prefix), then ``allocate`` / ``commit`` for the prompt
    remainder and every decoded token, then ``close``. See the method docstrings for units.

    Arguments:
        num_pages: pages in the KV pool, ``1 .. 2**31 - 1``.
        page_size: tokens per page, ``1 .. 1024``.
        hash_fn: ``hash_fn(page_token_bytes, parent_key) -> int`` in ``[0, 2**64)``, the block key
            (default 64-bit xxh3). Matches are always confirmed against the stored tokens, so a
            weak or deliberately colliding function costs hits, never correctness. It is called
            once here on a page of zeros, so a function with the wrong signature fails now.
        record_events: keep ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events for
            ``drain_events``.
        max_events: events kept waiting for ``drain_events``, ``>= 1``. When one more would
            exceed it, the backlog is dropped and no more are kept until the next drain, which
            returns ``AllBlocksCleared`` and then ``BlockStored`` for every block cached at that
            moment (a consumer that applies events in order ends up right).
        max_event_bytes: the same for the bytes those events hold (4 per token id, 8 per block
            hash), ``>= 1``: one event of a long prefill carries its whole prompt.
        host_pages: pages of the host tier, ``0 .. 2**31 - 1`` (0: none). With a tier, eviction
            moves cached runs to host pages instead of dropping them, prompts match across both
            tiers, and the engine makes the copies the cache asks for (``take_transfers`` /
            ``transfers_done``); see ``prefix_cache.cache.host_tier`` and docs/offload.md.
        write_through: with a host tier, copy runs to it when they are cached, so that GPU eviction
            copies nothing (see ``prefix_cache.cache.write_through``); False (the default) copies
            a run when the GPU evicts it. True needs ``host_pages > 0``.

    Threading: one ``PrefixCache`` belongs to one scheduler thread; calls must not overlap. Every
    call that touches shared state (the tree, the free pages, events) takes a non-blocking lock
    and raises ``ConcurrentUseError`` if another thread is inside the cache, changing nothing.
    The per-token paths (``allocate`` within the last page, ``commit`` that fills no page or
    fills one while the sequence's earlier decoded pages still wait, see below) touch only their
    own sequence and are not checked.

    Decoded pages are cached in batches: a page that a one-token commit fills at the end of the
    sequence's own leaf run waits, with the pages the sequence fills after it, until something
    could see it (a match or admission that reaches the run, the sequence's close, counts,
    events, eviction), which caches them first. Every call therefore sees what caching each page
    at its commit gives, at one hash pass and one tree update per sequence instead of per page.

    Mixins hold the rest: ``PrefixMatch`` match, ``BatchCalls`` the batch calls, ``WholeCacheCalls``
    evict / reset / drain_events / check_invariants, ``CacheCounts`` the counts and stats,
    ``HostTierCalls`` the host tier's calls.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 16,
        *,
        hash_fn: HashFn | None = None,
        record_events: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        host_pages: int = 0,
        write_through: bool = False,
    ) -> None:
        self._num_pages = check_int("num_pages", num_pages, 1, MAX_NUM_PAGES)
        host_pages = check_int("host_pages", host_pages, 0, MAX_NUM_PAGES)
        if type(write_through) is not bool:
            raise TypeError(f"write_through must be a bool, got {type(write_through).__name__}")
        if write_through and not host_pages:
            raise ValueError("write_through needs a host tier (host_pages > 0)")
        self._page_size = check_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        max_events = check_int("max_events", max_events, 1)
        max_event_bytes = check_int("max_event_bytes", max_event_bytes, 1)
        if hash_fn is not None:
            check_hash_fn(hash_fn, self._page_size)
        self._events = EventLog(max_events, max_event_bytes) if record_events else None
        self._live: set[Sequence] = set()
        pool = PagePool(self._num_pages)
        tree = BlockTree(default_hash_fn if hash_fn is None else hash_fn, self._page_size)
        self._tier = HostTier(tree, pool, host_pages, self._events, write_through) if host_pages else None
        self._store = PageStore(pool, tree, self._events, self._tier)
        # The store's pool and tree, read by the calls that only check or release.
        self._pool = self._store.pool
        # Its free pages (the same array for the cache's life), read by the decode path.
        self._free = self._pool.free
        self._tree = self._store.tree
        self._block_tables = BlockTableWriter()
        # Held (never waited on) by every call that touches shared state, see the class docstring:
        # a one-item list that a call takes with ``pop`` (IndexError: another thread is inside)
        # and gives back with ``append``, both atomic. A try-lock like ``Lock.acquire(False)``,
        # at a quarter of its cost (which parses its arguments): at page size 1 every decode
        # step takes it.
        self._baton: list[None] = [None]
        # (root, tree version, prompt bytes, walk) of the last walk, see _walk.
        self._last_match: tuple[Root, int, bytes, Walk] | None = None
        self._next_seq_id = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._opened = 0
        self._closed = 0
        self._host_hit_tokens = 0

    # ------------------------------------------------------------------ engine API

    def open(
        self, tokens: object, namespace: Namespace = None, *, extra_keys: list[ExtraKey] | None = None
    ) -> Sequence:
        """Start a sequence for the prompt ``tokens`` (1-D ints) and lock its longest cached prefix.

        The sequence starts with ``num_tokens == num_allocated_tokens == num_cached_tokens`` and a
        block table of the cached pages; the engine then allocates and commits
        ``tokens[seq.num_cached_tokens:]``.

        extra_keys: ``(start, end, key)`` entries: ``key`` (bytes, str or an int in
            ``[0, 2**64)``, an image's content hash, say) is part of the identity of every page
            holding a token of ``start <= t < end``, so prompts with equal tokens but different
            keys share no page from the first page a key covers on (see ``prefix_cache.cache.hashing``).
        """
        arr = as_token_array(tokens)
        check_namespace(namespace)
        extras = page_extras(extra_keys, len(arr), self._page_size)
        # Everything that allocates comes before the first change, so a MemoryError changes nothing.
        seq = self._new_sequence(arr, namespace, 0)
        self._enter()
        try:
            self._open(seq, arr, namespace, extras, self._prefix_walk(arr, namespace, extras))
            return seq
        finally:
            self._baton.append(None)

    def admit(
        self,
        tokens: object,
        namespace: Namespace = None,
        *,
        extra_tokens: int = 0,
        extra_keys: list[ExtraKey] | None = None,
    ) -> Sequence:
        """``open`` the prompt and ``allocate`` slots for its uncached tokens plus ``extra_tokens``
        (say 1 for the first decode step), all or nothing: when the pool cannot supply the pages
        even by evicting, raises ``OutOfPages`` and changes nothing at all (no LRU stamp, no
        statistics), so a scheduler can try a request and move on. Pages of the cached prefix that
        are evictable now count as taken, since admitting locks them.
        """
        arr = as_token_array(tokens)
        check_namespace(namespace)
        extra_tokens = check_int("extra_tokens", extra_tokens, 0)
        extras = page_extras(extra_keys, len(arr), self._page_size)
        self._enter()
        try:
            walk = self._prefix_walk(arr, namespace, extras)
            end = len(arr) + extra_tokens
            needed = -(-end // self._page_size) - walk.pages
            # Pages of the matched runs nobody holds: admitting locks them.
            locked = 0
            nodes = walk.nodes
            if nodes:
                locked = sum(len(node.pages) for node in nodes[:-1] if not node.ref)
                if not nodes[-1].ref:
                    locked += walk.partial or len(nodes[-1].pages)
            available = len(self._pool.free) + self._tree.num_unreferenced - locked
            if needed > available:
                raise OutOfPages(needed, available)
            # Sized once the pool is known to supply the pages (``extra_tokens`` may be huge), and
            # before the first change, so a MemoryError changes nothing.
            seq = self._new_sequence(arr, namespace, extra_tokens)
            self._open(seq, arr, namespace, extras, walk)
            if end > seq._capacity:
                self._store.allocate(seq, end)
            return seq
        finally:
            self._baton.append(None)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Reserve slots for the next ``num_tokens`` tokens of ``seq`` after those already reserved,
        taking pages from the free pool and evicting cached pages when it is empty (least recently
        used first; for one more page, a decode step's worth at once: a page per ``page_size``
        open sequences, so the next sequences' pages are free). New pages are appended to
        ``seq.block_table``; its earlier entries never change.

        All or nothing: raises ``OutOfPages`` (and changes nothing) when even evicting every
        evictable page would not supply enough pages.
        """
        # The ownership check is written out in allocate, commit and close rather than shared in
        # a helper: allocate and commit run per running request per decode step, where one more
        # Python call is a measurable share of the ~1 µs a step may cost.
        try:
            owner = seq._owner
        except AttributeError:
            raise TypeError(f"expected a Sequence, got {type(seq).__name__}") from None
        if owner is not self:
            reject(self, seq)
        if type(num_tokens) is not int:
            num_tokens = check_int("num_tokens", num_tokens, 0)
        elif num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        end = seq._num_allocated + num_tokens
        if end <= seq._capacity:
            # Room left in the last page: the per-token decode path.
            seq._num_allocated = end
            return
        baton = self._baton
        try:
            baton.pop()
        except IndexError:
            self._concurrent()
        try:
            page_size = self._page_size
            if end <= seq._capacity + page_size:
                # One more page, the decode loop's case, written out: a free page onto the end of
                # the block table. From an empty pool, the decode step's pages are evicted in one
                # batch first. A full table raises IndexError before anything changes (the page
                # goes back where it was), and so does an empty pool.
                free = self._free
                if not free and self._tree.num_unreferenced:
                    self._store.evict(-(-len(self._live) // page_size))
                try:
                    page = free.pop()
                except IndexError:
                    pass
                else:
                    count = seq._num_pages
                    try:
                        seq._pages_int[count] = page
                    except IndexError:
                        free.append(page)
                    else:
                        seq._num_pages = count + 1
                        seq._capacity += page_size
                        seq._num_allocated = end
                        return
            self._store.allocate(seq, end)
        finally:
            baton.append(None)

    def commit(self, seq: Sequence, tokens: object) -> None:
        """Record that the KV of the next ``len(tokens)`` tokens of ``seq`` (after ``num_tokens``) is
        written. Pages that become full are cached; when the same block is already cached (another
        sequence computed it at the same time) the sequence keeps its own copy, private until
        ``close``, and holds the cached one, which later prompts match. The block table does not
        change.

        Raises ValueError, changing nothing, when that goes past the reserved tokens; an error
        from a caller's ``hash_fn`` also leaves everything as it was.
        """
        try:
            owner = seq._owner
        except AttributeError:
            raise TypeError(f"expected a Sequence, got {type(seq).__name__}") from None
        if owner is not self:
            reject(self, seq)
        # The per-token decode path: one token (a 1-element list of int or 1-D int32 array), room
        # reserved. Anything else, including every error, takes the general path below.
        n = seq._num_tokens
        if n < seq._num_allocated:
            token = -1
            kind = type(tokens)
            if kind is _NDARRAY:
                if tokens.dtype is _INT32 and tokens.ndim == 1:
                    try:
                        token = tokens.item()
                    except ValueError:
                        token = -1  # not one element
            elif kind is list and len(tokens) == 1:
                token = tokens[0]
                if type(token) is not int or token > MAX_TOKEN_ID:
                    token = -1
            if token >= 0:
                seq._tokens_int[n] = token
                n += 1
                if not seq._dirty and not n % self._page_size:
                    baton = self._baton
                    try:
                        baton.pop()
                    except IndexError:
                        self._concurrent()
                    try:
                        self._store.defer_page(seq, n, token)
                    finally:
                        baton.append(None)
                seq._num_tokens = n
                return
        arr = as_token_array(tokens)
        n = seq._num_tokens
        end = n + len(arr)
        if end > seq._num_allocated:
            raise ValueError(
                f"cannot commit {len(arr)} tokens: sequence {seq._id} has {seq._num_allocated - n} "
                f"reserved and uncommitted (allocate first)"
            )
        # Past ``num_tokens`` the buffer holds nothing yet: writing there changes no state.
        seq._tokens[n:end] = arr
        if end // self._page_size > seq._num_full_pages:
            self._store_locked(seq, end)
        seq._num_tokens = end

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the reserved slots of ``seq`` past its first ``num_tokens`` tokens, and the
        pages they leave empty (speculative decoding: the engine allocated slots for draft tokens,
        wrote their KV, committed the accepted ones and rolls the rest back).

        ``num_tokens`` lies in ``[seq.num_tokens, seq.num_allocated_tokens]``: committed tokens
        cannot be rolled back, so commit only accepted tokens and a rejected token never reaches a
        cached page. This is the only call that removes block table entries (those past
        ``ceil(num_tokens / page_size)``) before ``close``; the engine must not read them again.
        """
        try:
            owner = seq._owner
        except AttributeError:
            raise TypeError(f"expected a Sequence, got {type(seq).__name__}") from None
        if owner is not self:
            reject(self, seq)
        num_tokens = check_int("num_tokens", num_tokens, seq._num_tokens, seq._num_allocated)
        self._enter()
        try:
            keep = -(-num_tokens // self._page_size)
            if keep < seq._num_pages:
                self._pool.put_table(seq._pages[keep : seq._num_pages])
                seq._num_pages = keep
                seq._capacity = keep * self._page_size
                # Entries written by write_block_tables past ``keep`` are stale now.
                seq._rollbacks += 1
            seq._num_allocated = num_tokens
        finally:
            self._baton.append(None)

    def close(self, seq: Sequence) -> None:
        """Release ``seq``: its cached pages stay cached (evictable once no other sequence holds
        them), its private pages (a partial last page, unused reservations, its copies of blocks
        cached by others) return to the pool."""
        try:
            owner = seq._owner
        except AttributeError:
            raise TypeError(f"expected a Sequence, got {type(seq).__name__}") from None
        if owner is not self:
            reject(self, seq)
        self._enter()
        try:
            if seq._dirty:
                self._store.flush_seq(seq)
            if seq._loading:
                # Never loaded: not a hit after all.
                self._hit_tokens -= seq._loading
                self._host_hit_tokens -= seq._loading
                self._tier.cancel(seq)
            tree = self._tree
            root = seq._root
            if seq._node is not root:
                if seq._dups:
                    self._store.forget_copies(seq)
                orphans = tree.release(seq._node, root)
                if orphans is not None:
                    self._store.adopt(orphans)
            pool = self._pool
            pool.put_table(seq._pages[seq._num_held : seq._num_pages])
            if seq._dups:
                pool.put_many(seq._dups)
                seq._dups = ()
            tree.release_root(root)
            seq._owner = None
            seq._node = None
            seq._num_held = 0
            seq._num_pages = 0
            seq._capacity = 0
            self._live.discard(seq)
            self._closed += 1
        finally:
            self._baton.append(None)

    # ------------------------------------------------------------------ internals

    def _enter(self) -> None:
        """Take ``_baton`` (given back with ``self._baton.append(None)`` in a ``finally``), or
        raise ``ConcurrentUseError`` when another thread holds it. The per-token calls take it
        inline, sparing this call."""
        try:
            self._baton.pop()
        except IndexError:
            self._concurrent()

    def _concurrent(self) -> None:
        """Raise ``ConcurrentUseError``; called where taking ``_baton`` failed with IndexError."""
        raise ConcurrentUseError(
            "PrefixCache called from two threads at once: one cache belongs to one scheduler "
            "thread (serialise the calls); nothing was changed"
        ) from None

    def _new_sequence(self, arr: np.ndarray, namespace: Namespace, extra_tokens: int) -> Sequence:
        """A sequence for the prompt ``arr``, not yet open, with buffer room for the prompt, the
        ``extra_tokens`` after it, and some decode headroom."""
        page_size = self._page_size
        capacity = -(-(len(arr) + extra_tokens) // page_size) + _DECODE_HEADROOM_PAGES
        return Sequence(self, self._next_seq_id, namespace, None, capacity, page_size)

    def _open(
        self, seq: Sequence, arr: np.ndarray, namespace: Namespace, extras: dict[int, bytes], walk: Walk
    ) -> None:
        """The work of ``open`` on a new sequence, under the lock; ``walk`` is the prompt's
        ``_prefix_walk``, taken under the same lock."""
        live = self._live
        live.add(seq)
        try:
            root = self._tree.root(namespace)
        except BaseException:
            live.discard(seq)
            raise
        self._next_seq_id += 1
        seq._root = root
        if extras:
            seq._extras = extras
        root.ref += 1
        seq._node = root
        num_cached = 0
        if walk.pages:
            seq._node = self._tree.hold(walk, seq._pages_int)
            seq._num_held = seq._num_full_pages = seq._num_pages = walk.pages
            num_cached = walk.pages * self._page_size
            seq._capacity = num_cached
            seq._tokens[:num_cached] = arr[:num_cached]
        loaded = 0
        if self._tier is not None and self._tree.num_host_nodes and not walk.partial:
            loaded = self._open_host(seq, arr, extras)
        seq._num_tokens = seq._num_allocated = seq._num_cached_tokens = num_cached + loaded
        self._opened += 1
        self._query_tokens += len(arr)
        self._hit_tokens += num_cached + loaded
        self._host_hit_tokens += loaded

    def _store_locked(self, seq: Sequence, end: int) -> None:
        """``PageStore.store_full_pages`` under the lock: ``commit``'s path for several tokens."""
        self._enter()
        try:
            if seq._dirty:
                self._store.flush_seq(seq)
            self._store.store_full_pages(seq, end)
        finally:
            self._baton.append(None)

    def _locked_flush(self) -> None:
        """``PageStore.flush`` under the lock: the deferred pages of the decode path are cached."""
        self._enter()
        try:
            self._store.flush()
        finally:
            self._baton.append(None)

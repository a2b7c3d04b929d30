"""Random engine traffic against PrefixCache, checked step by step against independent models.

Models, none of which reads the cache's tree or a sequence's internals:
- ``cached``: per namespace, the prefixes (tuples of whole pages) that must be cached, decided from
  the operations alone: every full page a live sequence commits is cached, unless it is cached
  already (the sequence then holds that copy) or its block key is taken in the namespace by other
  tokens (a collision: it and the sequence's later pages stay private), until a ``BlockRemoved``
  event says it was evicted. The cache's tree must hold exactly these prefixes, ``match`` / ``open``
  must return the longest that prefixes the prompt, and every ``BlockStored`` event must announce
  exactly the pages the model cached.
- ``refs`` and ``tick``: which live sequences hold each cached prefix, and when it was last released
  (by ``close``). Every evicted page must be an unreferenced leaf with the oldest release among all
  unreferenced leaves (LRU), and ``num_evictable_pages`` the number of unreferenced prefixes.
- ``kv``: what the engine wrote into each page slot, as (namespace, tokens up to and including
  that slot). Every page a sequence gets from the cache must hold the KV of exactly its prompt.
- page accounting: free + evictable + in live block tables = all pages, OutOfPages only when
  the pool truly cannot supply, and an error leaves the whole state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_cache_helpers import snapshot
from xxhash import xxh3_64_intdigest

from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.cache.hashing import namespace_seed
from prefix_cache.cache.prefix_cache import OutOfPages, PrefixCache, PrefixCacheError
from prefix_cache.cache.sequence import Sequence

NAMESPACES = (None, "tenant", 3)
VOCAB = 3  # few distinct tokens, so prompts share prefixes by chance too
TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=12)

# What opening a prompt draws: where the prompt comes from, its own suffix, the namespace and the
# container type of the tokens. Shared by the machine's ``open`` and ``admit`` rules.
PROMPT = {
    "data": st.data(),
    "source": st.sampled_from(["fresh", "extend", "system", "repeat", "live"]),
    "suffix": TOKENS,
    "namespace": st.sampled_from(NAMESPACES),
    "kind": st.integers(0, 4),
    # An image over a few prompt tokens (where it starts, its length, its content hash), or none.
    "image": st.one_of(
        st.none(), st.tuples(st.integers(0, 24), st.integers(1, 6), st.sampled_from([b"a", b"b"]))
    ),
}


@dataclass
class Live:
    seq: Sequence
    namespace: object
    pending: list[int]  # prompt tokens still to commit
    tokens: list[int] = field(default_factory=list)  # committed tokens, as the engine knows them
    held: list[tuple[int, ...]] = field(default_factory=list)  # cached prefixes it holds, in order
    broken: bool = False  # a page collided: it and all later ones stay private
    images: list = field(default_factory=list)  # its prompt's extra keys
    extras: dict[int, bytes] = field(default_factory=dict)  # their identity bytes per page


def as_container(tokens: list[int], kind: int):
    """The same tokens in one of the input types the engine may use."""
    if kind == 0:
        return list(tokens)
    if kind == 1:
        return np.asarray(tokens, dtype=np.int32)
    if kind == 2:
        return np.asarray(tokens, dtype=np.int64)
    if kind == 3:
        return tuple(tokens)
    return torch.tensor(tokens, dtype=torch.int64)


class CacheMachine(RuleBasedStateMachine):
    """Engine traffic with a good hash; ``WeakHashMachine`` reruns it with constant collisions."""

    #: Whether the cache gets ``hash_fn``; without it, the cache's default (the same xxh3-64), with
    #: which the decode path defers full pages to a batch.
    custom_hash = False

    def hash_fn(self, data: bytes, parent: int) -> int:
        return xxh3_64_intdigest(data, parent)

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 5, 16]),
        tight=st.booleans(),
        pool=st.integers(1, 24),
        system=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    )
    def setup(self, page_size: int, tight: bool, pool: int, system: list[int]) -> None:
        self.ps = page_size
        self.num_pages = pool if tight else 4096
        hash_fn = self.hash_fn if self.custom_hash else None
        self.cache = PrefixCache(self.num_pages, page_size, hash_fn=hash_fn)
        self.live: list[Live] = []
        self.history: list[tuple[object, list[int]]] = []  # prompts and finished token streams
        self.system = system
        # The reference model (see the module docstring): prefix -> key, key -> prefix, per namespace.
        self.cached: dict[object, dict[tuple[int, ...], int]] = {ns: {} for ns in NAMESPACES}
        self.keys: dict[object, dict[int, tuple[int, ...]]] = {ns: {} for ns in NAMESPACES}
        self.children: dict[tuple[object, tuple[int, ...]], int] = {}
        self.refs: dict[tuple[object, tuple[int, ...]], int] = {}
        self.tick: dict[tuple[object, tuple[int, ...]], int] = {}
        self.clock = 0
        # Pages the model cached whose BlockStored event has not been seen yet.
        self.unannounced: list[tuple[object, int]] = []
        self.kv: dict[int, list[object]] = {}
        # Whether the invariant runs after each rule: it reads the whole cache, which caches every
        # decoded page that waits (see PageStore.defer_page); with it off, they wait across rules.
        self.checks = True

    # ------------------------------------------------------------------ model helpers

    def page_extras(self, images: list) -> dict[int, bytes]:
        """Extra identity bytes per page, as documented: length-prefixed keys, in order."""
        extras: dict[int, bytes] = {}
        for start, end, key in images:
            for page in range(start // self.ps, (end - 1) // self.ps + 1):
                extras[page] = extras.get(page, b"") + len(key).to_bytes(4, "little") + key
        return extras

    def ident(self, tokens: list[int], extras: dict[int, bytes]) -> tuple:
        """Tokens as a prefix of the model: each token with its page's extra identity bytes."""
        return tuple((t, extras.get(i // self.ps, b"")) for i, t in enumerate(tokens))

    @staticmethod
    def page_identity(page: tuple) -> bytes:
        """The identity bytes of one page of a model prefix."""
        return np.asarray([t for t, _ in page], dtype=np.int32).tobytes() + page[0][1]

    def expected_match(self, tokens: list[int], namespace, extras: dict[int, bytes] | None = None) -> int:
        cached = self.cached[namespace]
        pages = max(len(tokens) - 1, 0) // self.ps
        ident = self.ident(tokens, extras or {})
        k = 0
        while k < pages and ident[: (k + 1) * self.ps] in cached:
            k += 1
        return k * self.ps

    def hold(self, live: Live, prefix: tuple[int, ...]) -> None:
        live.held.append(prefix)
        self.refs[(live.namespace, prefix)] = self.refs.get((live.namespace, prefix), 0) + 1

    def model_commit(self, live: Live, stream: list[int]) -> None:
        """What committing ``stream`` must cache, decided from the tokens alone."""
        ns, ps = live.namespace, self.ps
        first = len(live.tokens) // ps
        tokens = self.ident(live.tokens + stream, live.extras)
        for index in range(first, len(tokens) // ps):
            if live.broken:
                return
            prefix = tuple(tokens[: (index + 1) * ps])
            if prefix in self.cached[ns]:
                self.hold(live, prefix)  # cached by another sequence meanwhile: hold that copy
                continue
            parent = prefix[:-ps]
            parent_key = self.cached[ns][parent] if parent else namespace_seed(ns)
            key = self.hash_fn(self.page_identity(prefix[-ps:]), parent_key)
            if key in self.keys[ns]:
                live.broken = True
                return
            self.cached[ns][prefix] = key
            self.keys[ns][key] = prefix
            if parent:
                self.children[(ns, parent)] = self.children.get((ns, parent), 0) + 1
            self.unannounced.append((ns, key))
            self.hold(live, prefix)

    def model_close(self, live: Live) -> None:
        self.clock += 1
        for prefix in live.held:
            self.refs[(live.namespace, prefix)] -= 1
            self.tick[(live.namespace, prefix)] = self.clock

    def evictable_leaves(self) -> list[tuple[object, tuple[int, ...]]]:
        return [
            (ns, prefix)
            for ns, cached in self.cached.items()
            for prefix in cached
            if not self.refs.get((ns, prefix)) and not self.children.get((ns, prefix))
        ]

    def apply_events(self) -> None:
        """Check the events against the model, and drop the pages they say were evicted."""
        for event in self.cache.drain_events():
            if isinstance(event, BlockStored):
                assert event.block_size == self.ps
                assert len(event.token_ids) == len(event.block_hashes) * self.ps
                ns = event.namespace
                parent = namespace_seed(ns) if event.parent_block_hash is None else event.parent_block_hash
                prefix = () if event.parent_block_hash is None else self.keys[ns][parent]
                for i, key in enumerate(event.block_hashes):
                    extra = (event.extra_keys[i] if event.extra_keys else None) or b""
                    page = tuple((t, extra) for t in event.token_ids[i * self.ps : (i + 1) * self.ps])
                    prefix = (*prefix, *page)
                    assert key == self.hash_fn(self.page_identity(page), parent)
                    assert self.keys[ns].get(key) == prefix, "stored a page the model did not cache"
                    self.unannounced.remove((ns, key))
                    parent = key
            elif isinstance(event, BlockRemoved):
                ns = event.namespace
                for key in event.block_hashes:
                    prefix = self.keys[ns][key]
                    leaves = self.evictable_leaves()
                    assert (ns, prefix) in leaves, "evicted a held page or one with cached children"
                    oldest = min(self.tick[leaf] for leaf in leaves)
                    assert self.tick[(ns, prefix)] == oldest, "evicted a leaf that is not the LRU one"
                    del self.keys[ns][key], self.cached[ns][prefix]
                    if len(prefix) > self.ps:
                        self.children[(ns, prefix[: -self.ps])] -= 1
            else:
                assert isinstance(event, AllBlocksCleared)
                assert not self.live
                for ns in NAMESPACES:
                    self.cached[ns].clear()
                    self.keys[ns].clear()
                self.children.clear()
                self.unannounced.clear()
        assert not self.unannounced, "cached pages were not announced"

    def write_kv(self, live: Live, tokens: list[int]) -> None:
        """What the engine does before commit: write the KV of ``tokens`` into their slots."""
        table = live.seq.block_table.tolist()
        start = len(live.tokens)
        stream = self.ident(live.tokens + tokens, live.extras)
        for pos in range(start, start + len(tokens)):
            slots = self.kv.setdefault(table[pos // self.ps], [None] * self.ps)
            slots[pos % self.ps] = (live.namespace, stream[: pos + 1])

    # ------------------------------------------------------------------ rules

    def draw_prompt(self, data, source: str, suffix: list[int], namespace, image) -> tuple:
        """(prompt, namespace, images): a prompt from ``source``, with an image over some of its
        tokens for fresh prompts; extended and repeated ones keep their base's images."""
        images = []
        if source == "live" and self.live:
            # What a live sequence committed so far, and more: its decoded pages must match at once.
            live = data.draw(st.sampled_from(self.live))
            namespace, images = live.namespace, [i for i in live.images if i[1] <= len(live.tokens)]
            return (live.tokens + suffix) or [0], namespace, images
        if source in ("extend", "repeat") and self.history:
            namespace, base, images = data.draw(st.sampled_from(self.history))
            prompt = list(base) if source == "repeat" else base + suffix
        else:
            prompt = (self.system + suffix if source == "system" else suffix) or [0]
            if image is not None:
                start = min(image[0], len(prompt) - 1)
                images = [(start, min(start + image[1], len(prompt)), image[2])]
        return prompt or [0], namespace, images

    def open_prompt(self, data, source: str, suffix: list[int], namespace, kind: int, image) -> Live:
        """Open a prompt drawn from ``source`` and check its cached prefix against the models."""
        prompt, namespace, images = self.draw_prompt(data, source, suffix, namespace, image)
        expected = self.expected_match(prompt, namespace, self.page_extras(images))
        before = snapshot(self.cache) if self.checks else None
        assert self.cache.match(as_container(prompt, kind), namespace, extra_keys=images or None) == expected
        assert before is None or snapshot(self.cache) == before
        seq = self.cache.open(as_container(prompt, kind), namespace, extra_keys=images or None)
        assert seq.num_cached_tokens == expected == seq.num_tokens == seq.num_allocated_tokens
        return self.opened(seq, prompt, namespace, expected, images)

    def opened(self, seq: Sequence, prompt: list[int], namespace, expected: int, images: list) -> Live:
        """Check a newly opened sequence's cached pages against the KV model, and track it."""
        extras = self.page_extras(images)
        ident = self.ident(prompt, extras)
        table = seq.block_table.tolist()
        for pos in range(expected):
            assert self.kv[table[pos // self.ps]][pos % self.ps] == (namespace, ident[: pos + 1])
        live = Live(seq, namespace, prompt[expected:], prompt[:expected], images=images, extras=extras)
        for k in range(1, expected // self.ps + 1):
            self.hold(live, ident[: k * self.ps])
        self.live.append(live)
        self.history.append((namespace, prompt, images))
        return live

    def try_allocate(self, live: Live, count: int) -> bool:
        """Allocate, expecting OutOfPages exactly when the pool cannot supply (state unchanged)."""
        seq, cache = live.seq, self.cache
        needed = -(-(seq.num_allocated_tokens + count) // self.ps) - len(seq.block_table)
        available = cache.num_free_pages + cache.num_evictable_pages
        if needed > available:
            before = snapshot(cache)
            with pytest.raises(OutOfPages):
                cache.allocate(seq, count)
            assert snapshot(cache) == before
            return False
        free, evictable = cache.num_free_pages, cache.num_evictable_pages
        allocated = seq.num_allocated_tokens
        cache.allocate(seq, count)
        self.apply_events()  # evictions, before the model decides what later commits find cached
        assert seq.num_allocated_tokens == allocated + count
        assert len(seq.block_table) == -(-seq.num_allocated_tokens // self.ps)
        taken = max(needed, 0)
        # What the pool lacked was evicted; for one more page, a decode step's worth at once (a
        # page per page_size open sequences), each page checked against the LRU by apply_events.
        evicted = evictable - cache.num_evictable_pages
        assert cache.num_free_pages == free - taken + evicted
        batch = -(-len(self.live) // self.ps) if needed == 1 else 1
        assert max(taken - free, 0) <= evicted <= max(taken - free, 0) + (batch - 1 if taken > free else 0)
        return True

    def do_commit(self, live: Live, stream: list[int], kind: int) -> None:
        self.write_kv(live, stream)
        table = live.seq.block_table.tolist()
        self.cache.commit(live.seq, as_container(stream, kind))
        assert live.seq.block_table.tolist() == table  # append-only
        self.model_commit(live, stream)
        live.pending = live.pending[len(stream) :]
        live.tokens += stream
        assert live.seq.tokens.tolist() == live.tokens

    # ------------------------------------------------------------------ rules

    @rule(**PROMPT)
    def open(self, data, source: str, suffix: list[int], namespace, kind: int, image) -> None:
        self.open_prompt(data, source, suffix, namespace, kind, image)

    @rule(**PROMPT)
    def admit(self, data, source: str, suffix: list[int], namespace, kind: int, image) -> None:
        """The engine's admission: open, allocate the uncached prompt, commit it."""
        live = self.open_prompt(data, source, suffix, namespace, kind, image)
        if self.try_allocate(live, len(live.pending)) and live.pending:
            self.do_commit(live, live.pending, kind)

    @rule(**PROMPT, extra=st.integers(0, 3))
    def admit_at_once(
        self, data, source: str, suffix: list[int], namespace, kind: int, image, extra: int
    ) -> None:
        """``admit``: all or nothing, judged by the model (a matched page nobody holds counts as
        taken)."""
        prompt, namespace, images = self.draw_prompt(data, source, suffix, namespace, image)
        ident = self.ident(prompt, self.page_extras(images))
        expected = self.expected_match(prompt, namespace, self.page_extras(images))
        matched = [ident[: k * self.ps] for k in range(1, expected // self.ps + 1)]
        unheld = sum(1 for prefix in matched if not self.refs.get((namespace, prefix)))
        needed = -(-(len(prompt) + extra) // self.ps) - len(matched)
        available = self.cache.num_free_pages + self.cache.num_evictable_pages - unheld
        if needed > available:
            before = snapshot(self.cache)
            with pytest.raises(OutOfPages):
                self.cache.admit(as_container(prompt, kind), namespace, extra_tokens=extra, extra_keys=images)
            assert snapshot(self.cache) == before
            return
        seq = self.cache.admit(as_container(prompt, kind), namespace, extra_tokens=extra, extra_keys=images)
        assert seq.num_cached_tokens == expected == seq.num_tokens
        assert seq.num_allocated_tokens == len(prompt) + extra
        live = self.opened(seq, prompt, namespace, expected, images)  # holds the prefix it matched
        self.apply_events()  # evictions, before the model decides what later commits find cached
        if live.pending:
            self.do_commit(live, live.pending, kind)

    @precondition(lambda self: any(live.seq.num_allocated_tokens > live.seq.num_tokens for live in self.live))
    @rule(data=st.data())
    def rollback(self, data) -> None:
        """Speculative decoding: give back reserved slots that were not committed."""
        live = data.draw(
            st.sampled_from([x for x in self.live if x.seq.num_allocated_tokens > x.seq.num_tokens])
        )
        seq = live.seq
        keep = data.draw(st.integers(seq.num_tokens, seq.num_allocated_tokens))
        table, free = seq.block_table.tolist(), self.cache.num_free_pages
        self.cache.rollback(seq, keep)
        pages = -(-keep // self.ps)
        assert seq.num_allocated_tokens == keep and seq.block_table.tolist() == table[:pages]
        assert self.cache.num_free_pages == free + len(table) - pages

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, VOCAB - 1), min_size=24, max_size=24))
    def decode_batch(self, data, tokens: list[int]) -> None:
        """One decode step of several sequences through the batch calls."""
        batch = data.draw(st.lists(st.sampled_from(self.live), min_size=1, unique_by=id))
        needed = sum(
            max(-(-(x.seq.num_allocated_tokens + 1) // self.ps) - len(x.seq.block_table), 0) for x in batch
        )
        if needed > self.cache.num_free_pages + self.cache.num_evictable_pages:
            before = snapshot(self.cache)
            with pytest.raises(OutOfPages):
                self.cache.allocate_batch([x.seq for x in batch], 1)
            assert snapshot(self.cache) == before
            return
        slots = [x.seq.num_allocated_tokens for x in batch]
        self.cache.allocate_batch([x.seq for x in batch], 1)
        self.apply_events()
        assert [x.seq.num_allocated_tokens for x in batch] == [n + 1 for n in slots]
        # Commit the next token of those whose slot is the next uncommitted one.
        ready = [x for x in batch if x.seq.num_tokens == x.seq.num_allocated_tokens - 1]
        # More than 24 sequences can be ready: the drawn tokens are reused in turn.
        streams = [(x.pending or [tokens[i % len(tokens)]])[:1] for i, x in enumerate(ready)]
        for live, stream in zip(ready, streams, strict=True):
            self.write_kv(live, stream)
        self.cache.commit_batch([x.seq for x in ready], [stream[0] for stream in streams])
        for live, stream in zip(ready, streams, strict=True):
            self.model_commit(live, stream)
            live.pending = live.pending[1:]
            live.tokens += stream
            assert live.seq.tokens.tolist() == live.tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1), as_array=st.booleans())
    def decode(self, data, token: int, as_array: bool) -> None:
        """One decode step: a slot for one token, then its KV is written."""
        live = data.draw(st.sampled_from(self.live))
        if live.seq.num_allocated_tokens == live.seq.num_tokens and not self.try_allocate(live, 1):
            return
        stream = (live.pending or [token])[:1]
        self.do_commit(live, stream, 1 if as_array else 0)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 3))
    def allocate(self, data, extra: int) -> None:
        live = data.draw(st.sampled_from(self.live))
        self.try_allocate(live, data.draw(st.integers(0, len(live.pending) + extra)))

    @precondition(lambda self: any(live.seq.num_allocated_tokens > live.seq.num_tokens for live in self.live))
    @rule(data=st.data(), kind=st.integers(0, 4), decoded=TOKENS)
    def commit(self, data, kind: int, decoded: list[int]) -> None:
        live = data.draw(
            st.sampled_from([x for x in self.live if x.seq.num_allocated_tokens > x.seq.num_tokens])
        )
        room = live.seq.num_allocated_tokens - live.seq.num_tokens
        count = data.draw(st.integers(1, room))
        # The prompt first, then decoded tokens (parallel samples of one prompt diverge here).
        self.do_commit(live, (live.pending + decoded + [0] * count)[:count], kind)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), over=st.integers(1, 3), kind=st.integers(0, 4))
    def commit_too_much(self, data, over: int, kind: int) -> None:
        live = data.draw(st.sampled_from(self.live))
        room = live.seq.num_allocated_tokens - live.seq.num_tokens
        before = snapshot(self.cache)
        with pytest.raises(ValueError):
            self.cache.commit(live.seq, as_container([1] * (room + over), kind))
        assert snapshot(self.cache) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def close(self, data) -> None:
        live = data.draw(st.sampled_from(self.live))
        self.live.remove(live)
        self.cache.close(live.seq)
        self.model_close(live)
        if live.tokens:
            # Its images that lie within what it committed (it may close before its prompt is in).
            images = [image for image in live.images if image[1] <= len(live.tokens)]
            self.history.append((live.namespace, live.tokens, images))
        before = snapshot(self.cache)
        with pytest.raises(ValueError, match="closed"):
            self.cache.close(live.seq)
        with pytest.raises(ValueError, match="closed"):
            self.cache.allocate(live.seq, 1)
        assert snapshot(self.cache) == before

    @rule(count=st.integers(0, 6))
    def evict(self, count: int) -> None:
        free, evictable = self.cache.num_free_pages, self.cache.num_evictable_pages
        freed = self.cache.evict(count)
        self.apply_events()
        assert freed == min(count, evictable)
        assert self.cache.num_free_pages == free + freed

    @rule()
    def reset(self) -> None:
        if self.live:
            before = snapshot(self.cache)
            with pytest.raises(PrefixCacheError, match="open"):
                self.cache.reset()
            assert snapshot(self.cache) == before
            return
        self.cache.reset()
        self.apply_events()
        assert self.cache.num_cached_pages == 0 and self.cache.num_free_pages == self.num_pages

    @rule(on=st.booleans())
    def check_each_step(self, on: bool) -> None:
        self.checks = on

    @rule(prompt=TOKENS, namespace=st.sampled_from(NAMESPACES))
    def match(self, prompt: list[int], namespace) -> None:
        before = snapshot(self.cache) if self.checks else None
        assert self.cache.match(prompt, namespace) == self.expected_match(prompt, namespace)
        assert before is None or snapshot(self.cache) == before

    # ------------------------------------------------------------------ invariants

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.checks = True
            self.consistent()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache") or not self.checks:
            return
        cache = self.cache
        cache.check_invariants()
        self.apply_events()
        tree_prefixes: dict[object, set[tuple[int, ...]]] = {ns: set() for ns in NAMESPACES}
        page_bytes = 4 * self.ps
        for node in cache._tree.nodes():
            # Every page of the node's run, after the pages of the runs above it.
            runs = []
            walk = node
            while walk.parent is not None:
                runs.insert(0, walk)
                walk = walk.parent
            tokens: list = []
            for run in runs:
                for i in range(len(run.pages)):
                    identity = run.identity(i, page_bytes)
                    page = np.frombuffer(identity[:page_bytes], dtype=np.int32).tolist()
                    tokens += [(t, identity[page_bytes:]) for t in page]
                    if run is node:
                        tree_prefixes[walk.namespace].add(tuple(tokens))
        assert tree_prefixes == {ns: set(cached) for ns, cached in self.cached.items()}
        unreferenced = sum(
            1 for ns, cached in self.cached.items() for prefix in cached if not self.refs.get((ns, prefix))
        )
        assert cache.num_evictable_pages == unreferenced
        # Every page is free, evictable or in a live block table: a cached page that no live block
        # table has (its sequence closed, another holds its own copy) is never lost.
        tables = {page for live in self.live for page in live.seq.block_table.tolist()}
        assert cache.num_free_pages + cache.num_evictable_pages + len(tables) == self.num_pages
        for live in self.live:
            assert live.seq.num_tokens == len(live.tokens)


class WeakHashMachine(CacheMachine):
    """The same traffic with a two-valued hash: most full pages collide, none may be served wrong."""

    custom_hash = True

    def hash_fn(self, data: bytes, parent: int) -> int:
        return (data[0] + parent) & 1


SETTINGS = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = SETTINGS
TestWeakHashMachine = WeakHashMachine.TestCase
TestWeakHashMachine.settings = settings(SETTINGS, max_examples=150)

"""Events that name their tier: the event log's host-tier records, and the resynchronisation after an
overflow when some blocks are held on the host only."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_kv_events_helpers import Engine

from prefix_cache.cache.event_log import EventLog
from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.events.index import BlockIndex, block_hashes

TOKENS = np.array([1, 2, 3, 4], dtype=np.int32).tobytes()  # two pages of 2


def test_each_recorded_shape_drains_to_its_event_and_medium() -> None:
    """GPU records keep their shapes (5 and 2 long); host-tier ones carry the medium last."""
    log = EventLog(max_events=10, max_bytes=1000)
    log.emit(([7, 8], None, TOKENS, "a", None))
    log.emit(([7, 8], "a"))
    log.emit(([7, 8], None, TOKENS, "a", [None, b"x"], "CPU"))
    log.emit(([8], "a", "CPU"))
    log.emit(([9], 8, TOKENS[8:], None, None, "GPU"))
    tree = PrefixCache(num_pages=4, page_size=2)._tree
    assert log.drain(tree) == [
        BlockStored([7, 8], None, [1, 2, 3, 4], 2, "a"),
        BlockRemoved([7, 8], "a"),
        BlockStored([7, 8], None, [1, 2, 3, 4], 2, "a", [None, b"x"], medium="CPU"),
        BlockRemoved([8], "a", medium="CPU"),
        BlockStored([9], 8, [3, 4], 2),
    ]
    assert log.drain(tree) == [] and log.num_bytes == 0


@pytest.mark.parametrize(
    ("record", "size"),
    [
        (([7, 8], "a"), 16),
        (([7, 8], "a", "CPU"), 16),  # the medium is no token bytes
        (([7, 8], None, TOKENS, "a", None), 32),
        (([7, 8], None, TOKENS, "a", None, "CPU"), 32),
    ],
)
def test_the_byte_cap_counts_hashes_and_tokens_of_every_shape(record: tuple, size: int) -> None:
    """8 bytes a hash and the token bytes: a record of exactly the cap fits, one byte less overflows."""
    for cap, overflows in ((size, False), (size - 1, True)):
        log = EventLog(max_events=10, max_bytes=cap)
        log.emit(record)
        assert log.overflowed == overflows
        assert log.num_bytes == (0 if overflows else size)


def _host_only(cache: PrefixCache, rng: random.Random, share: float) -> set[int]:
    """Mark some runs (and every run below them) held on the host only, as the host tier leaves
    them: ``pages`` None. Returns their keys."""
    moved: set[int] = set()
    for node in cache._tree.nodes():  # parents first
        if node.parent.pages is None or rng.random() < share:
            node.pages = None
            moved.update(node.keys)
    return moved


def test_a_run_whose_tail_moved_to_the_host_resyncs_as_two_events() -> None:
    """What the host tier leaves when it takes a run's end: the run split, its head on the GPU with
    the tail, host-only, as its only child. One chain of runs, two media: two events, the tail's
    extra keys with it."""
    prompt = list(range(10, 19))  # 4 full pages of 2
    image = [(5, 7, b"img")]  # pages 2 and 3
    cache = PrefixCache(num_pages=16, page_size=2, max_events=1)
    for tokens, namespace in ((prompt, None), ([1, 2, 3], "b")):  # two events: the backlog overflows
        seq = cache.admit(tokens, namespace, extra_keys=image if namespace is None else None)
        cache.commit(seq, tokens)
        cache.close(seq)
    tree = cache._tree
    (run,) = (node for node in tree.nodes() if node.root.namespace is None)
    head = tree.split(run, 2)
    assert head.child is run and head.children is None
    run.pages = None
    keys = block_hashes(prompt, 2, extra_keys=image)
    extra = (3).to_bytes(4, "little") + b"img"
    assert cache.drain_events() == [
        AllBlocksCleared(),
        BlockStored(keys[:2], None, prompt[:4], 2),
        BlockStored(keys[2:], keys[1], prompt[4:8], 2, extra_keys=[extra, extra], medium="CPU"),
        BlockStored(block_hashes([1, 2, 3], 2, "b"), None, [1, 2], 2, "b"),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_resync_after_an_overflow_names_the_tier_of_each_block(seed: int) -> None:
    """``AllBlocksCleared`` then ``BlockStored`` for every block: host-only runs as "CPU", the rest
    "GPU", one medium per event, each event after the one holding its parent. A router index fed
    with it reports each prompt's GPU prefix and host part as the tree holds them."""
    rng = random.Random(seed)
    engine = Engine(seed=seed, num_pages=60)
    engine.cache = cache = PrefixCache(num_pages=60, page_size=4, max_events=1)
    for _ in range(40):
        engine.step_without_drain()
    assert cache._events.overflowed
    moved = _host_only(cache, rng, share=0.3)
    nodes = cache._tree.nodes()
    keys = {key for node in nodes for key in node.keys}
    assert moved and moved != keys  # both tiers hold some blocks

    events = cache.drain_events()
    assert type(events[0]) is AllBlocksCleared
    stored = events[1:]
    assert all(type(event) is BlockStored for event in stored)
    published = [key for event in stored for key in event.block_hashes]
    assert sorted(published) == sorted(keys)  # every block once
    # Each event a chain of the tree on one tier, after the event holding its parent.
    parent_of = {}
    for node in nodes:
        before = [node.parent.keys[-1] if node.parent.keys else None, *node.keys[:-1]]
        parent_of.update(zip(node.keys, before, strict=True))
    seen: set[int] = set()
    for event in stored:
        assert {key in moved for key in event.block_hashes} == {event.medium == "CPU"}
        assert [parent_of[key] for key in event.block_hashes] == [
            event.parent_block_hash,
            *event.block_hashes[:-1],
        ]
        assert event.parent_block_hash is None or event.parent_block_hash in seen
        seen.update(event.block_hashes)
    # Host runs hang below GPU blocks, not only below the roots.
    assert any(event.medium == "CPU" and event.parent_block_hash not in moved | {None} for event in stored)

    index = BlockIndex(num_replicas=1, page_size=4)
    index.apply(0, events)
    assert index.num_blocks(0) == len(keys)
    for tokens, namespace in engine.probes(20):
        chain = block_hashes(tokens, 4, namespace, num_pages=(len(tokens) - 1) // 4)
        held = 0
        while held < len(chain) and chain[held] in keys:
            held += 1
        gpu = 0
        while gpu < held and chain[gpu] not in moved:
            gpu += 1
        assert index.match_tiers(tokens, namespace) == [(4 * gpu, 4 * (held - gpu))]
        assert index.match(tokens, namespace) == [4 * held]

"""The engine with a host tier: conversations evicted from a small GPU pool between turns come
back from host memory by copy, and greedy decoding gives the tokens of an ample pool, also when
the copies fail and the engine computes those tokens instead."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_helpers import one_torch_thread

from examples.engine import LLAMA_1B, EngineConfig, LlamaModel, LLMEngine, SamplingParams
from examples.engine.scheduler import SchedulerConfig

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

CONFIG = dataclasses.replace(
    LLAMA_1B, num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=300, head_dim=16
)


def conversations(engine: LLMEngine, turns: int = 3) -> list[np.ndarray]:
    """Eight conversations over a shared system prompt, ``turns`` turns each, one turn of all of
    them at a time (so later ones push earlier ones out of a small pool); every output in order."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, CONFIG.vocab_size, 40)
    prompts = [np.concatenate([system, rng.integers(0, CONFIG.vocab_size, 20 + 3 * i)]) for i in range(8)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = []
    for _ in range(turns):
        replies = [sample[0] for sample in engine.generate(prompts, params)]
        outputs += replies
        prompts = [
            np.concatenate([p, r, rng.integers(0, CONFIG.vocab_size, 5)])
            for p, r in zip(prompts, replies, strict=True)
        ]
        engine.check_invariants()
    return outputs


def new_engine(
    num_pages: int, host_pages: int, device: str = "cpu", write_through: bool = False
) -> LLMEngine:
    """The test model on a pool of ``num_pages`` pages of 4 tokens and a host tier of ``host_pages``."""
    model = LlamaModel.dummy(CONFIG, device, torch.float32, seed=2)
    config = EngineConfig(
        num_pages=num_pages,
        page_size=4,
        backend="torch",
        host_pages=host_pages,
        host_write_through=write_through,
        scheduler=SchedulerConfig(max_batched_tokens=256, max_num_seqs=4),
    )
    return LLMEngine(model, config)


def run(
    num_pages: int,
    host_pages: int,
    fail_loads: bool = False,
    device: str = "cpu",
    write_through: bool = False,
) -> tuple[list[np.ndarray], LLMEngine]:
    engine = new_engine(num_pages, host_pages, device, write_through)
    if fail_loads:
        load = engine.mover.load

        def cancelled(host_pages, gpu_pages):
            handle = load(host_pages, gpu_pages)
            handle.cancel()  # as if the copy failed, leaving garbage in the pages it was to write
            for layer in engine.kv_pool:
                layer[torch.as_tensor(np.asarray(gpu_pages, dtype=np.int64))] = float("nan")
            return handle

        engine.mover.load = cancelled
    return conversations(engine), engine


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_conversations_come_back_from_the_host_with_the_same_tokens(device: str) -> None:
    """On CUDA the copies run on the mover's stream, the forward waiting for them on the device."""
    expected, ample = run(num_pages=512, host_pages=0, device=device)
    assert ample.cache.stats.evicted_pages == 0
    got, engine = run(num_pages=48, host_pages=512, device=device)
    assert engine.mover.ops_per_chunk == 1  # the pool's layers are views of one tensor
    assert engine.mover.direct  # so its pages move by 2-D copies, no gather
    stats = engine.cache.stats
    assert stats.evicted_pages > 0 and stats.host_hit_tokens > 0 and stats.loaded_pages > 0
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    without, small = run(num_pages=48, host_pages=0, device=device)
    assert stats.hit_rate > small.cache.stats.hit_rate + 0.1  # the tier brought hits back
    for a, b in zip(without, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_write_through_gives_the_same_tokens_and_evicts_without_copies() -> None:
    expected, _ = run(num_pages=512, host_pages=0)
    back, write_back = run(num_pages=48, host_pages=512)
    got, engine = run(num_pages=48, host_pages=512, write_through=True)
    stats = engine.cache.stats
    assert stats.evicted_pages > 0 and stats.host_hit_tokens > 0 and stats.loaded_pages > 0
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    # Every page cached has its copy (the tier is ample), saved once, when cached: evictions copy
    # nothing (the last step's saves are still to be taken).
    assert stats.host_cached_pages == stats.stored_pages >= stats.saved_pages > stats.stored_pages - 8
    assert stats.host_hit_tokens >= write_back.cache.stats.host_hit_tokens
    for a, b in zip(back, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_write_through_needs_a_host_tier() -> None:
    with pytest.raises(ValueError, match="host_write_through"):
        EngineConfig(host_write_through=True)


def test_failed_loads_are_computed_instead() -> None:
    expected, _ = run(num_pages=512, host_pages=0)
    got, engine = run(num_pages=48, host_pages=512, fail_loads=True)
    stats = engine.cache.stats
    assert stats.host_hit_tokens == 0 and stats.loaded_pages == 0  # every load was refused
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_host_pages_are_checked() -> None:
    with pytest.raises(ValueError, match="host_pages"):
        EngineConfig(host_pages=-1)


def test_a_sample_sits_out_while_its_loads_run_and_the_others_go_on() -> None:
    """Loads that take several steps (a slow copy, simulated): the samples waiting for them are
    left out of those steps' batches while the others are computed, then join with the same
    greedy tokens as an ample pool's."""
    expected, _ = run(num_pages=512, host_pages=0)
    engine = new_engine(num_pages=48, host_pages=512)
    load = engine.mover.load
    waited = []

    class Slow:
        """A load handle done only after three polls."""

        def __init__(self, handle) -> None:
            self.handle, self.polls = handle, 0

        @property
        def ok(self) -> bool:
            return self.handle.ok

        def done(self) -> bool:
            self.polls += 1
            if self.polls <= 3:
                waited.append([s for s in engine.scheduler.running if s.seq.num_loading_tokens])
            return self.polls > 3 and self.handle.done()

    engine.mover.load = lambda *args, **kwargs: Slow(load(*args, **kwargs))
    overlapped = []
    run_step = engine._run

    def recording(batch):
        # No sample of a batch reads pages still loading; others run meanwhile.
        assert not any(s.seq.num_loading_tokens for s, _ in batch)
        overlapped.append(any(s.seq.num_loading_tokens for s in engine.scheduler.running))
        return run_step(batch)

    engine._run = recording
    got = conversations(engine)
    assert engine.cache.stats.host_hit_tokens > 0 and waited and any(overlapped)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("write_through", [False, True])
def test_a_forward_waits_only_for_saves_reading_pages_it_writes(write_through: bool) -> None:
    """Saves that copy only when their handle is waited on or polled twice (a slow side stream,
    simulated; loads run after the saves queued before them, as on one stream): a forward that
    wrote a page before the save reading it had copied it would send garbage to the host, and
    the turn that loads it back would decode other tokens. The engine waits for such saves and
    no others: with write-through, whose saved pages stay cached, few steps wait."""
    expected, _ = run(num_pages=512, host_pages=0)
    engine = new_engine(num_pages=48, host_pages=512, write_through=write_through)
    save, load = engine.mover.save, engine.mover.load
    pending: list = []
    waits = []

    class Deferred:
        made = 0

        def __init__(self, gpu_pages, host_pages) -> None:
            Deferred.made += 1
            self.pages, self.polls, self.copied = (np.array(gpu_pages), np.array(host_pages)), 0, False
            pending.append(self)

        def copy(self) -> None:
            while pending and not self.copied:  # in queue order, as on one stream
                first = pending.pop(0)
                save(*first.pages).wait()
                first.copied = True

        def wait_on(self) -> None:
            waits.append(self)
            self.copy()

        def done(self) -> bool:
            self.polls += 1
            if self.polls > 2:
                self.copy()
            return self.copied

        ok = True

    def ordered_load(host_pages, gpu_pages):
        if pending:
            pending[-1].copy()
        return load(host_pages, gpu_pages)

    engine.mover.save, engine.mover.load = Deferred, ordered_load
    got = conversations(engine)
    stats = engine.cache.stats
    assert stats.host_hit_tokens > 0 and stats.saved_pages > 0 and waits
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    if write_through:  # few of the batches of saves held a forward back
        assert len(waits) < Deferred.made / 4

"""Decode steps replayed from CUDA graphs give the eager engine's tokens (CUDA only), and bucket sizes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from prefix_cache.kernels.work import MAX_SPLITS

from examples.engine import LLAMA_1B, EngineConfig, LlamaModel, LLMEngine, SamplingParams, SchedulerConfig
from examples.engine.cuda_graphs import DecodeGraphs, bucket_capacity, bucket_sizes, fits
from prefix_cache import CascadePlanner
from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend

# Small thresholds so that these small batches get shared levels.
PLANNER = CascadePlanner(min_shared_tokens=32, min_saved_tokens=32)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_bucket_sizes_are_powers_of_two_up_to_the_largest_batch():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(8) == [1, 2, 4, 8]


def test_fits_checks_query_tokens_levels_and_pages():
    # Two decodes over 40 tokens sharing their first 32 (2 pages of 16): a shared level of 2 page
    # ids, then 1 page id each.
    plan = PLANNER.plan([[0, 1, 2], [0, 1, 3]], [40, 40], [1, 1], 16)
    assert len(plan.levels) == 2 and sum(len(level.kv_indices) for level in plan.levels) == 4
    assert fits(plan, GraphCapacity(max_query_tokens=2, max_pages=4, max_levels=2))
    assert not fits(plan, GraphCapacity(max_query_tokens=2, max_pages=3, max_levels=2))
    assert not fits(plan, GraphCapacity(max_query_tokens=1, max_pages=4, max_levels=2))
    assert not fits(plan, GraphCapacity(max_query_tokens=2, max_pages=4, max_levels=1))


def test_bucket_split_buffers_grow_with_the_bucket():
    small = bucket_capacity(1, 4, 100)
    assert (small.max_query_tokens, small.max_levels, small.max_pages) == (1, 4, 100)
    assert small.partial_rows == small.work_items == 4 * MAX_SPLITS
    # Large buckets keep GraphCapacity's defaults, which are smaller than a split per token maximum.
    large = bucket_capacity(64, 4, 100)
    default = GraphCapacity(max_query_tokens=64, max_pages=6400, max_levels=4)
    assert (large.partial_rows, large.work_items) == (default.partial_rows, default.work_items)


def test_one_decode_over_a_long_context_keeps_every_split_in_the_smallest_bucket():
    """The 1-decode bucket's backend plans as many KV splits as an unlimited one: MAX_SPLITS."""
    page_size, pages = 16, 1024
    plan = PLANNER.plan([list(range(pages))], [pages * page_size], [1], page_size)
    capacity = bucket_capacity(1, PLANNER.max_levels, pages)
    # KV chunks of one KV tile (16 to 128 tokens): 128 or more of them, more than MAX_SPLITS, so
    # the split count is capped there.
    backend = TritonBackend("cpu", kv_chunk_size=16, capacity=capacity)
    backend.plan(plan, num_qo_heads=4, num_kv_heads=1, head_dim=16)
    assert backend._counts[:1].tolist() == [MAX_SPLITS]


def test_graph_capacity_per_sequence_must_be_positive():
    with pytest.raises(ValueError, match="graph_max_pages_per_seq"):
        EngineConfig(graph_max_pages_per_seq=0)


def test_cpu_engine_runs_without_graphs():
    config = dataclasses.replace(
        LLAMA_1B, num_layers=1, hidden_size=64, intermediate_size=128, vocab_size=300
    )
    model = LlamaModel.dummy(dataclasses.replace(config, head_dim=16), "cpu", torch.float32)
    assert LLMEngine(model, EngineConfig(num_pages=8, backend="torch")).graphs is None


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    """Llama-3.2-1B shapes, first 2 layers, float32 (argmax ties between the two paths stay unlikely)."""
    return LlamaModel.dummy(dataclasses.replace(LLAMA_1B, num_layers=2), "cuda", torch.float32, seed=3)


def generate(
    model: LlamaModel, phases: list[list[tuple[np.ndarray, SamplingParams]]], graphs: bool, **config: object
) -> tuple[list[np.ndarray], LLMEngine, list[int]]:
    """Run each phase's requests to completion, one phase after the other, on one engine; returns
    every sample's output, the engine, and its graph steps after each phase."""
    eng = LLMEngine(
        model,
        EngineConfig(
            num_pages=512,
            backend="triton",
            planner=PLANNER,
            cuda_graphs=graphs,
            scheduler=SchedulerConfig(max_batched_tokens=512, max_num_seqs=6),
            **config,
        ),
    )
    outputs, graph_steps = [], []
    for phase in phases:
        requests = [eng.add_request(p, params) for p, params in phase]
        while eng.has_work():
            eng.step()
        eng.check_invariants()
        outputs += [s.output.copy() for r in requests for s in r.samples]
        graph_steps.append(eng.stats.graph_steps)
    return outputs, eng, graph_steps


def assert_same_outputs(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"sample {i}")


@pytest.mark.gpu
@cuda
def test_cuda_graph_decode_gives_the_eager_tokens_across_buckets(model, monkeypatch):
    """Two turns of conversations sharing a system prompt, parallel samples, replies of different
    lengths: the decode batch shrinks 6 -> 4 -> 3 -> 2 -> 1 and crosses every bucket (1, 2, 4, 6); the
    second turn, over the first turn's cached prompts, replays the graphs captured in the first."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(0, vocab, 200)
    first = [
        (
            np.concatenate([system, rng.integers(0, vocab, 20 + 7 * i)]),
            SamplingParams(max_tokens=4 + 4 * i, n=n),
        )
        for i, n in enumerate([2, 1, 1, 1, 1])
    ]
    second = [
        (np.concatenate([p, rng.integers(0, vocab, 5 + i)]), SamplingParams(max_tokens=3 + 2 * i))
        for i, (p, _) in enumerate(first)
    ]
    expected, eager, _ = generate(model, [first, second], graphs=False)
    # The levels of each plan a graph step ran (captured or replayed).
    graph_levels = []
    run = DecodeGraphs.run

    def recording_run(self, plan, *args):
        logits = run(self, plan, *args)
        if logits is not None:
            graph_levels.append(len(plan.levels))
        return logits

    monkeypatch.setattr(DecodeGraphs, "run", recording_run)
    got, eng, graph_steps = generate(model, [first, second], graphs=True)
    assert eager.graphs is None and eager.stats.graph_steps == 0
    assert_same_outputs(got, expected)
    assert eng.graphs.captured == [1, 2, 4, 6]
    assert len(graph_levels) == eng.stats.graph_steps
    assert max(graph_levels) > 1  # graph steps ran shared levels (the system prompt's), not only prefills
    assert graph_steps[1] - graph_steps[0] > 4  # the second turn replays captured graphs


@pytest.mark.gpu
@cuda
def test_cuda_graph_decode_over_the_bucket_capacity_runs_eagerly(model):
    """With room for 2 page ids per sequence, short prompts (2 pages each) replay from graphs and long
    ones (8 pages each) run eagerly, before and after a graph was captured; tokens as eager."""
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size

    def phase(prompt_len: int) -> list[tuple[np.ndarray, SamplingParams]]:
        return [(rng.integers(0, vocab, prompt_len), SamplingParams(max_tokens=8)) for _ in range(3)]

    phases = [phase(120), phase(20), phase(120), phase(20)]
    expected, _, _ = generate(model, phases, graphs=False)
    got, _, graph_steps = generate(model, phases, graphs=True, graph_max_pages_per_seq=2)
    assert_same_outputs(got, expected)
    assert graph_steps[0] == 0  # over the capacity before any graph exists
    assert graph_steps[1] > 0
    assert graph_steps[2] == graph_steps[1]  # over the capacity with a graph captured
    assert graph_steps[3] > graph_steps[2]  # and the bucket serves plans that fit again

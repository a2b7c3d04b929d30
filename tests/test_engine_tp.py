"""Tensor parallelism on the CPU (gloo, one process per rank): N ranks give the greedy tokens of one,
the cache's invariants hold through preemption and aborts, each rank holds the heads it should, a
step's arrays cross the broadcast unchanged, and a size the model cannot split is a one-line error."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from engine_helpers import ROOT, error_line, one_torch_thread, smollm2, truncated
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import PLANNER, QUESTIONS
from test_engine import chat_turns as engine_chat_turns

from examples.engine import (
    LLAMA_8B,
    SMOLLM2_135M,
    EngineConfig,
    LlamaModel,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    server,
)
from examples.engine import __main__ as engine_cli
from examples.engine.tensor_parallel import (
    model_loader,
    pack_step,
    rank_heads,
    tensor_parallel_engine,
    unpack_step,
)
from prefix_cache import CascadePlanner

# Small thresholds so that this small batch gets shared levels (real engines keep the defaults).
#: SmolLM2's first layers: the same code path at a fraction of the time (every rank loads the model).
FEW_LAYERS = 4
#: A model whose 1 KV head is replicated over 2 ranks.
TINY = ModelConfig(
    name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_qo_heads=4,
    num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    context_length=4096,
)  # fmt: skip
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def config(num_pages: int = 256) -> EngineConfig:
    return EngineConfig(num_pages=num_pages, page_size=16, backend="torch", planner=PLANNER)


@contextmanager
def engine(size: int, layers: int | None = FEW_LAYERS, num_pages: int = 256):
    """SmolLM2 (its first ``layers``) on ``size`` ranks; after the block, the other ranks must have
    stopped cleanly."""
    model, chat = smollm2()
    model = truncated(model, layers) if layers else model
    load = model_loader("smollm2", layers)
    eng = tensor_parallel_engine(model, config(num_pages), chat.stop_token_ids, size, load)
    processes = list(getattr(eng.runner, "processes", []))
    assert len(processes) == size - 1
    try:
        yield eng
    finally:
        eng.close()
    assert [p.exitcode for p in processes] == [0] * (size - 1)


def run(eng: LLMEngine, check_every_step: bool = True) -> None:
    while eng.has_work():
        eng.step()
        if check_every_step:
            eng.check_invariants()


def chat_turns(eng: LLMEngine, questions, new_tokens: int) -> list[np.ndarray]:
    """The replies of ``test_engine``'s batched multi-turn chats, turn by turn, the cache's
    invariants checked after every step."""
    turns = engine_chat_turns(eng, questions, new_tokens, check_every_step=True)
    return [output for turn in turns for _, output in turn]


def chats_then_an_abort(eng: LLMEngine) -> list[np.ndarray]:
    """Two two-turn conversations, then three requests of which the second is aborted mid-decode."""
    outputs = chat_turns(eng, QUESTIONS[:2], new_tokens=12)
    assert eng.stats.shared_levels > 0 and eng.cache.stats.hit_rate > 0.4
    _, chat = smollm2()
    prompts = [np.concatenate([chat.message("user", q[1]), chat.generation_prompt]) for q in QUESTIONS]
    requests = [eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    for _ in range(4):
        eng.step()
    eng.abort(requests[1].request_id)
    eng.check_invariants()
    run(eng)
    assert requests[1].samples[0].finish_reason == "abort" and requests[1].samples[0].num_output < 10
    assert eng.cache.num_live_sequences == 0
    return outputs + [r.samples[0].output.copy() for r in requests]


def test_three_ranks_give_the_tokens_of_one_over_chats_and_an_abort():
    with engine(1) as one:
        expected = chats_then_an_abort(one)
    with engine(3) as three:
        assert three.kv_pool[0].shape[3] == 1  # SmolLM2's 3 KV heads, one per rank
        got = chats_then_an_abort(three)
    for out, ref in zip(got, expected, strict=True):
        np.testing.assert_array_equal(out, ref)


@pytest.mark.slow
def test_three_ranks_give_the_tokens_of_one_on_the_whole_model():
    with engine(1, layers=None) as one:
        expected = chat_turns(one, QUESTIONS, new_tokens=32)
    with engine(3, layers=None) as three:
        got = chat_turns(three, QUESTIONS, new_tokens=32)
        assert three.stats.shared_levels > 0 and three.cache.stats.hit_rate > 0.4
    for out, ref in zip(got, expected, strict=True):
        np.testing.assert_array_equal(out, ref)


@pytest.mark.slow
def test_preemption_on_three_ranks_keeps_every_output_and_the_invariants():
    # ~90-token prompts, 24 new tokens each: 20 pages admit all three, then decode runs out.
    with engine(1) as one:
        expected = chat_turns(one, QUESTIONS, new_tokens=24)
    with engine(3, num_pages=20) as three:
        got = chat_turns(three, QUESTIONS, new_tokens=24)
        assert three.scheduler.num_preemptions > 0
    for out, ref in zip(got, expected, strict=True):
        np.testing.assert_array_equal(out, ref)


def test_a_kv_head_replicated_over_two_ranks_gives_the_tokens_of_one():
    model = LlamaModel.dummy(TINY, "cpu", torch.float32)
    load = functools.partial(LlamaModel.dummy, TINY, dtype=torch.float32)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, TINY.vocab_size, 40)
    prompts = [np.concatenate([shared, rng.integers(0, TINY.vocab_size, n)]) for n in (3, 17, 30)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    one = LLMEngine(model, config())
    # The first prompt alone, then the others: they find the shared prefix cached, a shared level.
    expected = one.generate(prompts[:1], params) + one.generate(prompts[1:], params)
    eng = tensor_parallel_engine(model, config(), frozenset(), 2, load)
    try:
        assert eng.kv_pool[0].shape[3] == 1 and eng.model.num_qo_heads == 2
        got = eng.generate(prompts[:1], params) + eng.generate(prompts[1:], params)
        assert eng.stats.shared_levels > 0 and one.stats.shared_levels > 0
    finally:
        eng.close()
    for out, ref in zip(got, expected, strict=True):
        np.testing.assert_array_equal(out[0], ref[0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_two_cuda_ranks_give_the_tokens_of_one(graphs):
    """NCCL, Triton attention, CUDA graphs per rank: SmolLM2's shape with 8/2 heads (its 9/3 do not
    split in two), dummy weights in float32, a shared system prompt over two turns."""
    shape = dataclasses.replace(SMOLLM2_135M, name="smollm2-8-2", num_qo_heads=8, num_kv_heads=2)
    model = LlamaModel.dummy(shape, "cuda:0", torch.float32)
    load = functools.partial(LlamaModel.dummy, shape, dtype=torch.float32)
    rng = np.random.default_rng(0)
    system = rng.integers(0, shape.vocab_size, 300)
    prompts = [np.concatenate([system, rng.integers(0, shape.vocab_size, 40 + 9 * i)]) for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    cfg = EngineConfig(num_pages=512, backend="triton", planner=PLANNER, cuda_graphs=graphs)

    def turns(eng: LLMEngine) -> list:
        first = eng.generate(prompts, params)
        follow = [np.concatenate([p, o[0], [7, 8, 9]]) for p, o in zip(prompts, first, strict=True)]
        second = eng.generate(follow, params)
        eng.check_invariants()
        return [o[0] for o in first + second]

    expected = turns(LLMEngine(model, cfg))
    eng = tensor_parallel_engine(model, cfg, frozenset(), 2, load)
    try:
        got = turns(eng)
        assert eng.stats.shared_levels > 0 and (eng.stats.graph_steps > 0) == graphs
    finally:
        eng.close()
    for out, ref in zip(got, expected, strict=True):
        np.testing.assert_array_equal(out, ref)


def test_a_rank_that_dies_fails_the_next_step_and_the_engine_still_closes():
    model = LlamaModel.dummy(TINY, "cpu", torch.float32)
    load = functools.partial(LlamaModel.dummy, TINY, dtype=torch.float32)
    eng = tensor_parallel_engine(model, config(), frozenset(), 2, load)
    try:
        request = eng.add_request(np.arange(1, 20), SamplingParams(max_tokens=4, ignore_eos=True))
        eng.step()
        eng.runner.processes[0].kill()
        eng.runner.processes[0].join()
        (sample,) = eng.step()
        assert sample.finish_reason == "error"
        assert re.search(r"tensor-parallel rank 1 has exited \(code -9\)", request.error), request.error
        eng.check_invariants()
        assert not eng.has_work() and eng.cache.num_live_sequences == 0
    finally:
        eng.close()


def test_a_rank_that_fails_to_load_is_an_error_at_start_not_a_hang():
    model = LlamaModel.dummy(TINY, "cpu", torch.float32)
    unknown = model_loader("no-such-model")  # raises ValueError in the other rank
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited at start \(code 1\)"):
        tensor_parallel_engine(model, config(), frozenset(), 2, unknown)
    assert not torch.distributed.is_initialized()
    load = functools.partial(LlamaModel.dummy, TINY, dtype=torch.float32)
    eng = tensor_parallel_engine(model, config(), frozenset(), 2, load)
    eng.close()  # a new group starts after the failed one


@pytest.mark.parametrize(
    ("model", "sizes"),
    [(SMOLLM2_135M, [1, 3]), (LLAMA_8B, [1, 2, 4, 8, 16, 32]), (TINY, [1, 2, 4])],
)
def test_each_rank_holds_its_query_heads_and_the_kv_heads_they_read(model, sizes):
    hq, hkv = model.num_qo_heads, model.num_kv_heads
    for size in sizes:
        q_all, kv_count = [], [0] * hkv
        for rank in range(size):
            q, kv = rank_heads(model, size, rank)
            q_all += list(q)
            assert len(kv) == max(1, hkv // size)
            assert {head // (hq // hkv) for head in q} == set(kv)  # grouped-query attention's map
            for head in kv:
                kv_count[head] += 1
        assert q_all == list(range(hq))
        assert kv_count == [max(1, size // hkv)] * hkv  # each KV head on size / hkv ranks, or one


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    shared = draw(st.lists(st.integers(0, 999), min_size=0, max_size=6, unique=True))
    tables, kv_lens, qo_lens = [], [], []
    for i in range(draw(st.integers(1, 5))):
        own = [1000 + 10 * i + j for j in range(draw(st.integers(1, 4)))]
        pages = shared + own
        kv = draw(st.integers((len(pages) - 1) * page_size + 1, len(pages) * page_size))
        tables.append(np.array(pages, dtype=np.int32))
        kv_lens.append(kv)
        qo_lens.append(draw(st.integers(1, min(kv, 8))))
    return tables, np.array(kv_lens), np.array(qo_lens), page_size


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 2**31))
def test_a_packed_step_unpacks_to_the_same_plan_and_arrays(batch, seed):
    tables, kv_lens, qo_lens, page_size = batch
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=1).plan(tables, kv_lens, qo_lens, page_size)
    rng = np.random.default_rng(seed)
    t = int(qo_lens.sum())
    arrays = [rng.integers(0, 2**40, t) for _ in range(3)] + [rng.integers(0, t, len(tables))]
    got_plan, *got = unpack_step(pack_step(plan, *arrays))
    for a, b in zip(got, arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_plan.page_size == plan.page_size and len(got_plan.levels) == len(plan.levels)
    for name in ("request_order", "request_inverse", "query_order"):
        a, b = getattr(got_plan, name), getattr(plan, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for got_level, level in zip(got_plan.levels, plan.levels, strict=True):
        assert got_level.causal == level.causal
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
            a, b = getattr(got_level, name), getattr(level, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size: must be an int >= 1, got 0"),
        (["--tensor-parallel-size", "two"], "argument --tensor-parallel-size: must be an int >= 1, got two"),
        (
            ["--tensor-parallel-size", "2"],
            "argument --tensor-parallel-size: the tensor-parallel size must divide smollm2-135m's 9 query "
            "heads, got 2",
        ),
        (
            ["--model", "dummy-8b", "--tensor-parallel-size", "12"],
            "must divide dummy-llama-3.1-8b's 32 query heads, got 12",
        ),
    ],
)
def test_a_size_the_model_cannot_split_is_one_line_in_every_command(capsys, argv, expected):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_serving
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for main, extra in ((engine_cli.main, ["hi"]), (server.main, []), (bench_serving.main, [])):
        assert expected in error_line(capsys, main, extra + argv)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="several CUDA devices here")
def test_more_ranks_than_cuda_devices_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = error_line(
        capsys, server.main, ["--device", "cuda", "--model", "dummy-1b", "--tensor-parallel-size", "2"]
    )
    assert "2 ranks from cuda need more CUDA devices than the 1 here" in line

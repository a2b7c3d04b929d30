"""The engine over an fp8 KV pool on SmolLM2's real weights (CPU): what fp8 costs in accuracy.

The multi-turn conversations of ``test_engine`` run through an engine whose pool is fp8 (prefix cache
and cascade on). Then every transcript (prompt and reply) is scored teacher-forced twice, its KV in
fp32 and in fp8 (per-layer scales of 1): the top-1 agreement of the next-token logits over the reply
positions and their largest difference. Measured: 185 of 192 positions agree (96.4%), the largest
logit difference 4.56 (logits of magnitude ~40); the bounds below leave a margin.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import one_torch_thread, smollm2
from test_engine import PLANNER, chat_turns

from examples.engine import EngineConfig, LLMEngine, SchedulerConfig
from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend
from prefix_cache.attention.kv_layout import FP8_KV_DTYPE

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
MIN_AGREEMENT = 0.90
MAX_LOGIT_DIFF = 7.0


def _teacher_forced_logits(model, tokens: np.ndarray, kv_dtype: torch.dtype | None) -> torch.Tensor:
    """Next-token logits at every position of ``tokens``, one forward over a fresh pool of ``kv_dtype``."""
    n, page_size = len(tokens), 16
    pages = -(-n // page_size)
    pool = model.new_kv_pool(pages, page_size, kv_dtype)
    backend = create_backend("torch")
    backend.plan(
        CascadePlanner().plan([np.arange(pages)], [n], [n], page_size), **model.attention_shape(kv_dtype)
    )
    positions = torch.arange(n)
    return model.forward(
        torch.from_numpy(tokens.astype(np.int64)), positions, positions, pool, backend, positions
    )


def test_fp8_pool_agrees_with_fp32_within_what_was_measured() -> None:
    model, chat = smollm2()
    config = EngineConfig(
        num_pages=256, page_size=16, backend="torch", planner=PLANNER, kv_cache_dtype="fp8",
        scheduler=SchedulerConfig(max_batched_tokens=512),
    )  # fmt: skip
    engine = LLMEngine(model, config, chat.stop_token_ids)
    assert all(kv.dtype == FP8_KV_DTYPE for kv in engine.kv_pool)
    turns = chat_turns(engine)
    # The second turns find the first turns' KV in the fp8 pool, and shared levels ran over it.
    assert engine.cache.stats.hit_rate > 0.4 and engine.stats.shared_levels > 0
    agree = total = 0
    largest = 0.0
    for prompt, reply in [pair for turn in turns for pair in turn]:
        tokens = np.concatenate([prompt, reply])
        rows = slice(len(prompt) - 1, len(tokens) - 1)
        exact = _teacher_forced_logits(model, tokens, None)[rows]
        fp8 = _teacher_forced_logits(model, tokens, FP8_KV_DTYPE)[rows]
        assert torch.isfinite(fp8).all()
        agree += int((exact.argmax(-1) == fp8.argmax(-1)).sum())
        total += len(reply)
        largest = max(largest, float((exact - fp8).abs().max()))
    print(f"fp8 KV vs fp32 KV: top-1 agreement {agree}/{total}, largest logit difference {largest:.3f}")
    assert agree / total >= MIN_AGREEMENT
    assert 0.0 < largest <= MAX_LOGIT_DIFF  # 0 would mean the pool was not fp8 at all


def test_engine_config_names_its_kv_cache_dtypes() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8")
    import dataclasses

    from examples.engine import LLAMA_1B, LlamaModel

    config = dataclasses.replace(
        LLAMA_1B, num_layers=1, hidden_size=64, intermediate_size=128, vocab_size=300
    )
    model = LlamaModel.dummy(dataclasses.replace(config, head_dim=16), "cpu", torch.float32)
    assert model.new_kv_pool(4, 16, FP8_KV_DTYPE)[0].dtype == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="a KV pool holds the model's dtype"):
        model.new_kv_pool(4, 16, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_engine_replays_decodes_from_cuda_graphs() -> None:
    """An fp8 engine (per-layer scales other than 1, the KV written by ``append_kv``) gives the same
    greedy tokens with its decode steps replayed from CUDA graphs as eagerly (a float32 model, as in
    ``test_engine_cuda_graphs``: argmax ties between the two paths stay unlikely)."""
    import dataclasses

    from test_engine_cuda_graphs import assert_same_outputs, generate

    from examples.engine import LLAMA_1B, LlamaModel, SamplingParams

    model = LlamaModel.dummy(dataclasses.replace(LLAMA_1B, num_layers=2), "cuda", torch.float32, seed=3)
    model.kv_scales = [(0.05, 0.02), (0.03, 0.04)]
    rng = np.random.default_rng(0)
    system = rng.integers(0, model.config.vocab_size, 200)
    prompts = [
        (
            np.concatenate([system, rng.integers(0, model.config.vocab_size, 20 + 7 * i)]),
            SamplingParams(max_tokens=6),
        )
        for i in range(5)
    ]
    expected, _, _ = generate(model, [prompts], graphs=False, kv_cache_dtype="fp8")
    got, engine, graph_steps = generate(model, [prompts], graphs=True, kv_cache_dtype="fp8")
    assert engine.kv_pool[0].dtype == FP8_KV_DTYPE and graph_steps[-1] > 0
    assert_same_outputs(got, expected)

"""The engine against Hugging Face transformers on SmolLM2's real weights, and its scheduling rules."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_helpers import ROOT, assert_matches_hf, hf_reference, one_torch_thread, smollm2, truncated

from examples.engine import LLAMA_1B, EngineConfig, LlamaModel, LLMEngine, SamplingParams, SchedulerConfig
from prefix_cache import CascadePlanner

# Small thresholds so that this small batch gets shared levels (real engines keep the defaults).
PLANNER = CascadePlanner(min_shared_tokens=32, min_saved_tokens=32)
SYSTEM = "You are a concise assistant. Answer every question in one short paragraph, plainly. " * 3
QUESTIONS = [
    ("What is the capital of France?", "And what river runs through it?"),
    ("Name three primary colors.", "Which of them is the warmest?"),
    ("How do bees make honey?", "Why do they store it?"),
]
NEW_TOKENS = 32
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def engine(
    backend: str = "torch",
    *,
    cascade: bool = True,
    caching: bool = True,
    num_pages: int = 256,
    layers: int | None = None,
    max_batched_tokens: int = 512,
) -> LLMEngine:
    model, chat = smollm2()
    if layers is not None:
        model = truncated(model, layers)
    config = EngineConfig(
        num_pages=num_pages,
        page_size=16,
        backend=backend,
        cascade=cascade,
        planner=PLANNER,
        scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens, prefix_caching=caching),
    )
    return LLMEngine(model, config, chat.stop_token_ids)


def chat_turns(
    eng: LLMEngine, questions=QUESTIONS, new_tokens: int = NEW_TOKENS, check_every_step: bool = False
):
    """All conversations batched, turn by turn; each turn's prompt carries the engine's earlier replies
    as token ids. Returns per turn, per conversation, (prompt, output)."""
    _, chat = smollm2()
    prompts = [
        np.concatenate([chat.message("system", SYSTEM), chat.message("user", q[0])]) for q in questions
    ]
    turns = []
    for t in range(len(questions[0])):
        if t:
            users = [chat.message("user", q[t]) for q in questions]
            prompts = [np.concatenate([p, u]) for p, u in zip(prompts, users, strict=True)]
        full = [np.concatenate([p, chat.generation_prompt]) for p in prompts]
        requests = [eng.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)) for p in full]
        while eng.has_work():
            eng.step()
            if check_every_step:
                eng.check_invariants()
        outputs = [r.samples[0].output.copy() for r in requests]
        turns.append(list(zip(full, outputs, strict=True)))
        prompts = [np.concatenate([p, o, chat.end_of_reply]) for p, o in zip(full, outputs, strict=True)]
    eng.check_invariants()
    return turns


@pytest.mark.parametrize(
    ("cascade", "caching"),
    [
        pytest.param(True, True, id="cache+cascade", marks=pytest.mark.slow),
        pytest.param(False, True, id="no-cascade"),
        pytest.param(True, False, id="no-cache", marks=pytest.mark.slow),
    ],
)
def test_greedy_multi_turn_chat_matches_transformers(cascade, caching):
    eng = engine(cascade=cascade, caching=caching)
    turns = chat_turns(eng)
    for prompt, output in [pair for turn in turns for pair in turn]:
        assert len(output) == NEW_TOKENS
        assert_matches_hf(prompt, output)
    stats = eng.cache.stats
    if caching:  # the second turns find the first turns' prompts and replies cached
        assert stats.hit_rate > 0.4
    else:
        assert stats.hit_tokens == 0
    # Without the cache no two sequences hold the same pages: nothing to share.
    assert (eng.stats.shared_levels > 0) == (cascade and caching)


@pytest.mark.slow
def test_triton_backend_matches_transformers_on_two_layers():
    """Triton's kernels (in the interpreter on CPU) at a small size: SmolLM2's first two layers."""
    pytest.importorskip("triton")
    hf_reference()  # loaded before timing-sensitive work, shared with the other tests
    eng = engine("triton", layers=2)
    turns = chat_turns(eng, QUESTIONS[:2], new_tokens=12)
    for prompt, output in [pair for turn in turns for pair in turn]:
        assert_matches_hf(prompt, output, num_layers=2)
    assert eng.stats.shared_levels > 0 and eng.cache.stats.hit_rate > 0.4


@pytest.mark.slow
def test_preemption_when_pages_run_out_mid_decode_keeps_every_output():
    # 3 conversations of ~90-token prompts, 32 new tokens each: ~8 pages apiece, 30 in all; 20 pages
    # admit all three, then decode runs out and the youngest is preempted and later recomputed.
    reference = chat_turns(engine(), new_tokens=24)
    eng = engine(num_pages=20)
    tight = chat_turns(eng, new_tokens=24, check_every_step=True)
    assert eng.scheduler.num_preemptions > 0
    for turn, ref_turn in zip(tight, reference, strict=True):
        for (_, out), (_, ref) in zip(turn, ref_turn, strict=True):
            np.testing.assert_array_equal(out, ref)


def test_abort_releases_pages_and_leaves_the_others_unchanged():
    _, chat = smollm2()
    prompts = [
        np.concatenate([chat.message("system", SYSTEM), chat.message("user", q[0]), chat.generation_prompt])
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = engine().generate(prompts, params)
    eng = engine()
    requests = [eng.add_request(p, params) for p in prompts]
    for _ in range(5):
        eng.step()
    eng.abort(requests[1].request_id)
    eng.check_invariants()
    while eng.has_work():
        eng.step()
    eng.check_invariants()
    assert requests[1].samples[0].finish_reason == "abort" and requests[1].samples[0].num_output < 16
    for i in (0, 2):
        np.testing.assert_array_equal(requests[i].samples[0].output, expected[i][0])
    assert eng.cache.num_live_sequences == 0


def test_prompt_larger_than_the_pool_is_rejected_and_nothing_changes():
    eng = engine(num_pages=8)
    with pytest.raises(ValueError, match=r"needs 9 pages .* the KV pool has 8"):
        eng.add_request(np.arange(120), SamplingParams(max_tokens=20))
    assert not eng.has_work() and not eng.requests
    for bad in ([], [[1, 2]], [-1, 5], [1, 10**6], np.array([1.5])):
        with pytest.raises(ValueError, match="prompt"):
            eng.add_request(bad, SamplingParams())
    eng.check_invariants()


def test_parallel_samples_share_the_prompt_and_seeded_sampling_repeats():
    _, chat = smollm2()
    prompt = np.concatenate(
        [chat.message("system", SYSTEM), chat.message("user", "Tell me a story."), chat.generation_prompt]
    )
    eng = engine()
    greedy = eng.generate([prompt], SamplingParams(max_tokens=8, n=3, ignore_eos=True))[0]
    assert all(np.array_equal(g, greedy[0]) for g in greedy)
    # Samples 1 and 2 were admitted once sample 0 had cached the prompt's full pages.
    assert eng.cache.stats.hit_tokens >= 2 * (len(prompt) // 16) * 16
    assert eng.stats.shared_levels > 0
    hot = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=7, ignore_eos=True)
    first = engine().generate([prompt], hot)[0]
    again = engine().generate([prompt], hot)[0]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len({a.tobytes() for a in first}) > 1  # different samples, different draws


def test_eager_steps_plan_with_the_models_dtype():
    """The dtype lets a backend finish planning in ``plan`` (and lets "auto" choose FlashInfer)."""
    config = dataclasses.replace(
        LLAMA_1B, num_layers=1, hidden_size=64, intermediate_size=128, vocab_size=300, head_dim=16
    )
    model = LlamaModel.dummy(config, "cpu", torch.float32)
    eng = LLMEngine(model, EngineConfig(num_pages=16, backend="torch"))
    planned = []
    plan = eng.backend.plan

    def record(*args: object, **kwargs: object) -> None:
        planned.append(kwargs.get("q_dtype"))
        plan(*args, **kwargs)

    eng.backend.plan = record
    eng.generate([np.arange(40)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert planned == [torch.float32] * eng.stats.steps and eng.stats.steps >= 3


def test_stop_token_ends_a_reply_unless_ignore_eos():
    _, chat = smollm2()
    prompt = chat.render([{"role": "user", "content": "Say hi."}])
    eng = engine()
    request = eng.add_request(prompt, SamplingParams(max_tokens=64))
    while eng.has_work():
        eng.step()
    sample = request.samples[0]
    assert sample.finish_reason == "stop" and int(sample.output[-1]) in chat.stop_token_ids


def test_chat_framing_equals_the_models_own_template():
    _, chat = smollm2()
    messages = [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2 + 2 = ?"},
    ]
    for msgs in (messages, [{"role": "system", "content": "Be brief."}, *messages]):
        np.testing.assert_array_equal(chat.render(msgs), chat.encode(chat.render_template(msgs)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_engine_matches_the_torch_backend_on_dummy_weights():
    """On the GPU: KV-append kernel and Triton attention against the torch backend, same dummy weights
    (Llama-3.2-1B shapes, first 4 layers, float32), shared system prompt, two turns, a tight pool."""
    config = dataclasses.replace(LLAMA_1B, num_layers=4)
    model = LlamaModel.dummy(config, "cuda", torch.float32, seed=1)
    rng = np.random.default_rng(0)
    system = rng.integers(0, config.vocab_size, 300)
    prompts = [np.concatenate([system, rng.integers(0, config.vocab_size, 40 + 9 * i)]) for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, n=2)

    def run(backend: str, num_pages: int) -> tuple[list, LLMEngine]:
        eng = LLMEngine(model, EngineConfig(num_pages=num_pages, backend=backend, planner=PLANNER))
        first = eng.generate(prompts, params)
        second = eng.generate(
            [np.concatenate([p, o[0], [7, 8, 9]]) for p, o in zip(prompts, first, strict=True)], params
        )
        eng.check_invariants()
        return first + second, eng

    expected, _ = run("torch", 512)
    got, eng = run("triton", 512)
    assert eng.stats.shared_levels > 0
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.stack(a), np.stack(b))
    tight, eng = run("triton", 64)
    assert eng.scheduler.num_preemptions > 0
    for a, b in zip(tight, expected, strict=True):
        np.testing.assert_array_equal(np.stack(a), np.stack(b))


def test_command_line_answers_a_prompt(monkeypatch, capsys):
    from examples.engine import __main__ as cli

    monkeypatch.setattr(cli, "load_model", lambda name, device: smollm2())
    assert cli.main(["What is the capital of France?", "--max-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert "Paris" in printed and "prompt tokens" in printed


@pytest.mark.slow
def test_command_line_runs_without_triton_installed():
    # The engine extra brings no triton: on a CPU install the engine with the torch backend must
    # neither import triton nor our kernels. None in sys.modules makes "import triton" fail as if
    # the package were missing.
    smollm2()  # skips without the GGUF file
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from examples.engine import __main__ as cli\n"
        "assert cli.main(['Say hi.', '--max-tokens', '2', '--model', 'smollm2']) == 0\n"
        "assert not [m for m in sys.modules if m.startswith('prefix_cache.kernels')]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_tiny_temperature_samples_the_greedy_tokens():
    """Logits over a temperature of 1e-177 overflow to inf (and the softmax to NaN) unless shifted
    by their largest first; shifted, only the largest keeps any probability."""
    config = dataclasses.replace(
        LLAMA_1B, num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=300, head_dim=16
    )
    model = LlamaModel.dummy(config, "cpu", torch.float32, seed=2)

    def generate(**kwargs) -> np.ndarray:
        eng = LLMEngine(model, EngineConfig(num_pages=64, page_size=4, backend="torch"))
        params = SamplingParams(max_tokens=6, ignore_eos=True, **kwargs)
        return eng.generate([np.arange(1, 40)], params)[0][0]

    np.testing.assert_array_equal(generate(temperature=1e-177, seed=1), generate())

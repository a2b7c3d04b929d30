"""The engine fails a request whose sampling raises alone, and a batch whose forward raises, and goes on
serving: the other requests' tokens are those of a run without the failure."""

from __future__ import annotations

import pytest
from engine_helpers import one_torch_thread, smollm2, truncated

from examples.engine import EngineConfig, LLMEngine, SamplingParams, sampling

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    requests = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    while engine.has_work():
        engine.step()
    engine.check_invariants()
    return requests


@pytest.fixture(scope="module")
def model_and_chat():
    model, chat = smollm2()
    return truncated(model, 2), chat


def test_a_request_whose_sampling_raises_fails_alone(model_and_chat, monkeypatch):
    model, chat = model_and_chat
    prompts = [chat.encode(t).tolist() for t in ("Hello there", "Once upon a time", "The sky is")]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=i) for i in range(3)]
    clean = [
        r.samples[0].output.tolist()
        for r in run(LLMEngine(model, EngineConfig(num_pages=32)), prompts, params)
    ]
    draw = sampling._draw

    def poisoned(logits, s):
        if s.request.params.seed == 1 and s.num_output == 2:
            raise FloatingPointError("probabilities are NaN")
        return draw(logits, s)

    monkeypatch.setattr(sampling, "_draw", poisoned)
    engine = LLMEngine(model, EngineConfig(num_pages=32))
    requests = run(engine, prompts, params)
    bad = requests[1]
    assert bad.error == "FloatingPointError: probabilities are NaN"
    assert bad.samples[0].finish_reason == "error" and bad.samples[0].num_output == 2
    for i in (0, 2):
        assert requests[i].error is None and requests[i].samples[0].output.tolist() == clean[i]
    assert not engine.requests
    # The engine serves the next request as if nothing happened.
    again = run(engine, prompts[:1], params[:1])
    assert again[0].samples[0].output.tolist() == clean[0]


def test_a_failing_forward_fails_its_batch_and_the_engine_goes_on(model_and_chat, monkeypatch):
    model, chat = model_and_chat
    engine = LLMEngine(model, EngineConfig(num_pages=32))
    prompt = chat.encode("Hello there").tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    forward, calls = model.forward, {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step
            raise RuntimeError("kernel failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", broken)
    first = engine.add_request(prompt, params)
    assert [s.finish_reason for s in engine.step()] == [None]
    failed = engine.step()
    assert [s.finish_reason for s in failed] == ["error"] and first.error == "RuntimeError: kernel failed"
    engine.check_invariants()
    second = run(engine, [prompt], [params])[0]
    assert second.error is None and second.samples[0].num_output == 4

"""The OpenAI-compatible server, driven by the ``openai`` client over loopback."""

from __future__ import annotations

import json
import logging
import re
import time

import numpy as np
import pytest
from engine_helpers import assert_matches_hf, one_torch_thread, smollm2
from server_helpers import request, serve

from examples.engine import EngineConfig, LLMEngine, SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def server():
    """A server on a free loopback port over a fresh engine; yields (client, engine, chat, base URL)."""
    from examples.engine.server import create_app

    model, chat = smollm2()
    engine = LLMEngine(model, EngineConfig(num_pages=64), chat.stop_token_ids)
    with serve(create_app(engine, chat, "smollm2", default_max_tokens=16)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, engine, chat, url


def test_models_lists_the_served_model(server):
    client, *_ = server
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_completion_is_the_greedy_reply_and_streaming_gives_the_same_text(server):
    client, engine, chat, _ = server
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt = chat.render(messages)
    assert reply.usage.prompt_tokens == len(prompt)
    # The text is what transformers generates greedily for the same prompt.
    ids = chat.encode(choice.message.content)
    assert_matches_hf(prompt, ids[: max(1, len(ids) - 1)])
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    pieces, reasons = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == choice.message.content
    assert reasons[-1] == choice.finish_reason and all(r is None for r in reasons[:-1])
    engine.check_invariants()


def test_completion_of_token_ids_with_parallel_samples_and_ignore_eos(server):
    client, _, chat, _ = server
    prompt = chat.render([{"role": "user", "content": "Tell me a story."}]).tolist()
    reply = client.completions.create(
        model="smollm2",
        prompt=prompt,
        max_tokens=6,
        n=3,
        temperature=0.8,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 18
    again = client.completions.create(
        model="smollm2",
        prompt=prompt,
        max_tokens=6,
        n=3,
        temperature=0.8,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"model": "smollm2", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "smollm2", "temperature": -1}, 400, "temperature"),
        ({"model": "smollm2", "n": 0}, 400, "n"),
        ({"model": "smollm2", "stop": [""]}, 400, "stop"),
        ({"model": "smollm2", "seed": 2**64}, 400, "seed"),
        (
            {"model": "smollm2", "extra_body": {"response_format": {"type": "json_object"}}},
            400,
            "response_format",
        ),
        ({"model": "smollm2", "extra_body": {"logit_bias": {"5": 10}}}, 400, "logit_bias"),
        ({"model": "smollm2", "frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"model": "smollm2", "logprobs": 6}, 400, "logprobs"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"model": "smollm2", "max_tokens": 2000}, 400, "prompt"),  # 64 pages of 16 cannot hold it
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, kwargs, status, param):
    client, engine, *_ = server
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(prompt="Hello", **kwargs)
    assert info.value.status_code == status
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"]
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=2).choices[0].text is not None
    engine.check_invariants()


def test_malformed_bodies_are_400(server):
    client, *_ = server
    for body in (
        {"model": "smollm2"},
        {"model": "smollm2", "messages": []},
        {"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]},
    ):
        with pytest.raises(openai.BadRequestError):
            client.post("/chat/completions", body=body, cast_to=object)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt=[5, 10**7])  # token id outside the vocabulary


def test_a_client_that_goes_away_mid_stream_aborts_its_request(server):
    client, engine, *_ = server
    stream = client.completions.create(
        model="smollm2",
        prompt="Once upon a time",
        max_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.requests  # aborted, not run to its 40 tokens
    assert np.all([s.finished for s in engine.scheduler.running]) or not engine.scheduler.running


def test_token_ids_extension_returns_the_reply_exactly(server):
    client, _, chat, _ = server
    prompt = chat.render([{"role": "user", "content": "Count to five."}]).tolist()
    args = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(**args, extra_body=extra)
    ids = whole.choices[0].model_extra["token_ids"]
    assert len(ids) == 8 and chat.decode(ids) == whole.choices[0].text
    streamed = []
    for chunk in client.completions.create(**args, stream=True, extra_body=extra):
        streamed += chunk.choices[0].model_extra["token_ids"]
    assert streamed == ids


def metric(url: str, name: str) -> float:
    """One sample of the scraped /metrics, by its full name (labels included)."""
    status, body = request(url, "GET", "/metrics")
    assert status == 200
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line and line[0] != "#"
    }
    return values[name]


def test_metrics_show_the_cache_hits_of_a_multi_turn_conversation(server):
    client, _engine, _chat, url = server
    names = [
        "prefix_cache:prefix_cache_hits_total",
        "prefix_cache:prefix_cache_queries_total",
        "prefix_cache:generation_tokens_total",
        "prefix_cache:e2e_request_latency_seconds_count",
        'prefix_cache:request_success_total{finished_reason="length"}',
    ]
    before = {n: metric(url, n) for n in names}
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 8},
        {"role": "user", "content": "Hi!"},
    ]
    cached, prompts = [], []
    for turn in range(2):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        prompts.append(reply.usage.prompt_tokens)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"Turn {turn}"},
        ]
    after = {n: metric(url, n) for n in names}
    # The second turn finds the full pages of the first turn's prompt in the cache.
    assert prompts[0] >= 64 and cached[1] >= prompts[0] // 16 * 16 and cached[1] % 16 == 0
    assert after[names[0]] - before[names[0]] >= cached[1]
    assert after[names[1]] - before[names[1]] >= sum(prompts)
    assert after[names[2]] - before[names[2]] == 8
    assert after[names[3]] - before[names[3]] == 2 and after[names[4]] - before[names[4]] == 2
    assert metric(url, "prefix_cache:kv_pages_cached") >= prompts[1] // 16
    assert metric(url, "prefix_cache:num_requests_running") == 0


def test_stream_usage_when_asked(server):
    client, *_ = server
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings_and_stop_token_ids_end_the_text_where_they_occur(server):
    client, _, chat, _ = server
    args = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    text, ids = full.choices[0].text, full.choices[0].model_extra["token_ids"]
    # A stop string over tokens 4 and 5: token 4's text must be held back until token 5 shows
    # whether the stop string is complete.
    start = len(chat.decode(ids[:4]))
    stop = text[start : len(chat.decode(ids[:6]))]
    assert text.index(stop) == start and len(chat.decode(ids[4:5])) < len(stop), (text, stop)
    cut = client.completions.create(**args, stop=[stop, "never appears"])
    assert cut.choices[0].text == text[:start] and cut.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(**args, stop=stop, stream=True)]
    assert "".join(pieces) == text[:start]
    by_id = client.completions.create(**args, extra_body={"stop_token_ids": [ids[3]], "ignore_eos": True})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == ids.index(ids[3]) + 1
    assert by_id.choices[0].text == chat.decode(ids[: ids.index(ids[3])])


def test_logprobs_on_both_routes_are_the_models_log_softmax(server):
    client, engine, chat, _ = server
    prompt = chat.render([{"role": "user", "content": "Name a colour."}]).tolist()
    done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    # The engine alone (no server) records the same log-probabilities for the same prompt.
    solo = LLMEngine(engine.model, EngineConfig(num_pages=32), chat.stop_token_ids)
    request_ = solo.add_request(prompt, SamplingParams(max_tokens=1, logprobs=3))
    while solo.has_work():
        solo.step()
    chosen, _top_ids, top_lps = request_.samples[0].logprobs[0]
    assert lp.token_logprobs[0] == pytest.approx(chosen, abs=1e-4)
    assert list(lp.top_logprobs[0].values()) == pytest.approx(top_lps, abs=1e-4)
    assert top_lps == sorted(top_lps, reverse=True) and chosen == pytest.approx(top_lps[0])
    assert all(v <= 0 for v in top_lps) and float(np.exp(top_lps).sum()) <= 1 + 1e-5
    chat_reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat_reply.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 2
    assert content[0].logprob == pytest.approx(chosen, abs=1e-4) and content[0].token == lp.tokens[0]


def test_penalties_change_greedy_output_away_from_repeats(server):
    client, *_ = server
    args = {"model": "smollm2", "prompt": "one one one one one one", "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    plain = client.completions.create(**args, extra_body=extra).choices[0].model_extra["token_ids"]
    penalized = client.completions.create(
        **args, presence_penalty=2.0, frequency_penalty=2.0, extra_body=extra
    )
    ids = penalized.choices[0].model_extra["token_ids"]
    assert ids[0] == plain[0]  # nothing generated yet: nothing penalized
    repeats = len(plain) - len(set(plain))
    assert repeats >= 2  # greedy repeats itself here
    assert len(ids) - len(set(ids)) < repeats  # penalties of 2 per occurrence hold it back


def test_content_parts_and_the_developer_role_are_text_and_system(server):
    client, *_ = server
    parts = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}]
    as_parts = client.chat.completions.create(
        model="smollm2",
        max_tokens=4,
        temperature=0,
        messages=[{"role": "developer", "content": parts}, {"role": "user", "content": "Hi"}],
    )
    as_text = client.chat.completions.create(
        model="smollm2",
        max_tokens=4,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief.\nAnswer in English."},
            {"role": "user", "content": "Hi"},
        ],
    )
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert info.value.body["param"] == "messages.0.content.0"


def test_unsupported_tools_are_a_400_naming_them(server):
    client, *_ = server
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], tools=[tool]
        )
    assert info.value.body["param"] == "tools"
    status, body = request(
        server[3],
        "POST",
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "tools": [],
            "x_y": 1,
        },
    )
    assert status == 200, body  # an empty tool list and unknown fields change nothing
    assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")


def test_metrics_are_valid_prometheus_text_and_health_is_ok(server):
    client, _, _, url = server
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert request(url, "GET", "/health") == (200, b"ok")
    text = request(url, "GET", "/metrics")[1].decode()
    typed = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP")}
    assert set(typed) == helped and len(typed) == 16
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        float(value)
        base = name.split("{")[0]
        family = base if base in typed else re.sub(r"_(total|bucket|sum|count)$", "", base)
        assert family in typed, line
    for family in [f for f, kind in typed.items() if kind == "histogram"]:
        buckets = [
            float(v)
            for n, v in (x.rsplit(" ", 1) for x in text.splitlines())
            if n.startswith(f"{family}_bucket")
        ]
        assert buckets == sorted(buckets) and buckets[-1] == metric(url, f"{family}_count") > 0


def test_the_server_logs_its_start_and_its_throughput(caplog):
    from examples.engine.server import create_app

    model, chat = smollm2()
    engine = LLMEngine(model, EngineConfig(num_pages=32), chat.stop_token_ids)
    with (
        caplog.at_level(logging.INFO, logger="examples.engine.server"),
        serve(create_app(engine, chat, "smollm2", log_interval=1)) as url,
    ):
        assert (
            request(url, "POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 3})[0]
            == 200
        )
        deadline = time.time() + 10
        while not any("generation throughput" in r.getMessage() for r in caplog.records):
            assert time.time() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
    messages = [r.getMessage() for r in caplog.records]
    start = next(m for m in messages if m.startswith("serving smollm2"))
    assert "backend torch" in start and "32 KV pages of 16 tokens" in start and "8192 tokens" in start
    line = next(m for m in messages if "generation throughput" in m)
    assert "prefix cache hit rate" in line and "KV pages in use" in line

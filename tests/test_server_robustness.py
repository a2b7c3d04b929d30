"""No request can hurt another: a request the engine fails, bad bodies (a fuzz), huge bodies, long
prompts, clients that go away; and the server still answers a normal request after each."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time

import pytest
from engine_helpers import one_torch_thread, smollm2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import request, serve

from examples.engine import EngineConfig, LLMEngine

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

POISON_SEED = 666


@pytest.fixture(scope="module")
def server():
    """(base URL, engine, chat) of a server whose requests default to 2 new tokens."""
    from examples.engine.server import create_app

    model, chat = smollm2()
    engine = LLMEngine(model, EngineConfig(num_pages=64), chat.stop_token_ids)
    app = create_app(engine, chat, "smollm2", default_max_tokens=2, max_body_bytes=256 * 1024)
    with serve(app) as url:
        yield url, engine, chat


@pytest.fixture
def poison(monkeypatch):
    """Sampling raises for requests with seed POISON_SEED (a fault that passed the door)."""
    from examples.engine import sampling

    draw = sampling._draw

    def poisoned(logits, s):
        if s.request.params.seed == POISON_SEED:
            raise RuntimeError("poisoned sampler")
        return draw(logits, s)

    monkeypatch.setattr(sampling, "_draw", poisoned)


def completion(url: str, **fields) -> tuple[int, dict]:
    status, body = request(
        url, "POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", **fields}, timeout=60
    )
    return status, json.loads(body)


def assert_serving(url: str, engine: LLMEngine) -> None:
    status, body = completion(url, max_tokens=1)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    deadline = time.time() + 30
    while engine.requests and time.time() < deadline:
        time.sleep(0.02)
    engine.check_invariants()


@pytest.mark.parametrize(
    "fields", [{"seed": 99999999999999999999999}, {"seed": 2**64 - 1, "n": 2}, {"seed": -(2**63) - 1}]
)
def test_a_seed_outside_int64_is_a_400_and_the_engine_lives(server, fields):
    url, engine, _ = server
    status, body = completion(url, temperature=1.0, max_tokens=2, **fields)
    assert status == 400 and body["error"]["param"] == "seed", body
    assert_serving(url, engine)


def test_the_largest_seeds_sample_without_overflow(server):
    url, engine, _ = server
    for seed in (2**63 - 1, -(2**63)):
        status, body = completion(url, temperature=1.0, max_tokens=2, n=3, seed=seed)
        assert status == 200, body
    assert_serving(url, engine)


def test_a_poisoned_request_fails_alone_with_a_500_naming_the_cause(server, poison, caplog):
    url, engine, _ = server
    caplog.set_level(logging.WARNING, logger="examples.engine.server")
    results: dict[str, tuple[int, dict]] = {}

    def send(name: str, **fields) -> None:
        results[name] = completion(url, **fields)

    threads = [
        threading.Thread(target=send, args=(f"ok{i}",), kwargs={"max_tokens": 6, "ignore_eos": True})
        for i in range(3)
    ]
    threads.append(
        threading.Thread(target=send, args=("poisoned",), kwargs={"temperature": 1.0, "seed": POISON_SEED})
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    status, body = results["poisoned"]
    assert status == 500 and "poisoned sampler" in body["error"]["message"], body
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("failed in the engine: RuntimeError: poisoned sampler" in m for m in warnings), warnings
    for i in range(3):
        status, body = results[f"ok{i}"]
        assert status == 200 and len(body["choices"][0]["text"]) > 0, body
    assert_serving(url, engine)


def test_a_failing_forward_fails_its_batch_and_the_next_request_is_served(server, monkeypatch):
    url, engine, _ = server
    forward = engine.model.forward
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost its mind")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", broken)
    status, body = completion(url, max_tokens=2)
    assert status == 500 and "device lost its mind" in body["error"]["message"], body
    assert_serving(url, engine)


def test_a_request_the_engine_cannot_take_is_a_500_and_the_next_is_served(server, monkeypatch):
    url, engine, _ = server

    def refuse(*_args, **_kwargs):
        raise MemoryError("no room for the request's arrays")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "add_request", refuse)
        status, body = completion(url, max_tokens=2)
    assert status == 500 and "MemoryError: no room" in body["error"]["message"], body
    assert_serving(url, engine)


def stream_events(url: str, path: str, body: dict, keep: int | None = None) -> list[str]:
    """The SSE data lines of a streamed request; with ``keep``, the connection is dropped after that many."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    events = []
    try:
        while keep is None or len(events) < keep:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                if events[-1] == "[DONE]":
                    break
    finally:
        conn.close()
    return events


def test_concurrent_streams_with_disconnects_and_a_poisoned_one(server, poison):
    url, engine, _ = server
    base = {"model": "smollm2", "prompt": "Once upon a time", "stream": True, "ignore_eos": True}
    results: dict[str, list[str]] = {}
    jobs = {f"full{i}": ({**base, "max_tokens": 5}, None) for i in range(3)}
    jobs |= {f"gone{i}": ({**base, "max_tokens": 400}, 1) for i in range(2)}
    jobs["poisoned"] = ({**base, "temperature": 1.0, "seed": POISON_SEED}, None)

    def run(name: str) -> None:
        body, keep = jobs[name]
        results[name] = stream_events(url, "/v1/completions", body, keep)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(3):
        assert results[f"full{i}"][-1] == "[DONE]"
        assert json.loads(results[f"full{i}"][-2])["choices"][0]["finish_reason"] == "length"
    assert "poisoned sampler" in json.loads(results["poisoned"][-1])["error"]["message"]
    deadline = time.time() + 20  # the two left streams are aborted long before their 400 tokens
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.requests
    assert_serving(url, engine)


def test_a_non_streaming_client_that_goes_away_aborts_its_request(server):
    url, engine, _ = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 600, "ignore_eos": True}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.time() + 30
        while not engine.requests and time.time() < deadline:
            time.sleep(0.02)
        assert engine.requests, "the request never reached the engine"
    deadline = time.time() + 10  # 600 tokens take far longer than this on a CPU
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.requests, "the request kept generating for nobody"
    assert_serving(url, engine)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    url, engine, _ = server
    prompt = "word " * 100_000  # 500 kB > the fixture's 256 kB
    status, body = request(url, "POST", "/v1/completions", {"model": "smollm2", "prompt": prompt})
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert_serving(url, engine)


def test_a_prompt_over_the_context_length_is_a_400(server):
    url, engine, _ = server
    status, body = completion(url, prompt=[5] * 9000)  # SmolLM2's context: 8192 tokens
    assert (
        status == 400
        and body["error"]["code"] == "context_length_exceeded"
        and body["error"]["param"] == "prompt"
    )
    status, body = completion(url, prompt=[5] * 8000, max_tokens=500)
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    assert_serving(url, engine)


def test_tokenizing_and_detokenizing_run_off_the_event_loop(server, monkeypatch):
    url, _, chat = server
    on_loop: list[str] = []

    def off_loop(fn):
        def wrapped(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop.append(fn.__name__)
            except RuntimeError:
                pass
            return fn(*args, **kwargs)

        return wrapped

    for name in ("encode", "decode", "render"):
        monkeypatch.setattr(chat, name, off_loop(getattr(chat, name)))
    assert completion(url, prompt="Tell me", max_tokens=3)[0] == 200
    chat_body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
    }
    assert stream_events(url, "/v1/chat/completions", chat_body)[-1] == "[DONE]"
    assert on_loop == []


def test_health_answers_ok(server):
    url, _, _ = server
    assert request(url, "GET", "/health") == (200, b"ok")


# ------------------------------------------------------------------------------------- the fuzz

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 4)
    | st.sampled_from([2**63, -(2**63) - 1, 10**30, 50_000, 8192])
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=8)
    | st.just("smollm2")
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
# Per field, values the server takes (drawn three times as often as junk of any type), so that
# bodies reach the engine as well as the validation.
FIELDS = {
    "max_tokens": st.integers(1, 4),
    "max_completion_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "logprobs": st.integers(0, 5) | st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "tools": st.just([]),
    "response_format": st.just({"type": "text"}),
    "best_of": st.none(),
    "echo": st.just(False),
    "user": st.text(max_size=5),
    "unknown_field": junk,
}
fields = st.sampled_from(sorted(FIELDS)).flatmap(
    lambda name: st.tuples(st.just(name), st.one_of(FIELDS[name], FIELDS[name], FIELDS[name], junk))
)
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}), max_size=2
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", 3]),
            "content": st.text(max_size=12) | text_parts | junk,
        }
    ),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["smollm2", "smollm2", "smollm2", "gpt-4", 7]),
        "prompt": st.text(max_size=20)
        | st.lists(st.integers(0, 49151) | st.integers(-5, -1) | st.integers(49152, 60_000), max_size=6)
        | st.sampled_from([[7] * 9000, "word " * 9000])  # over the context length
        | junk,
        "messages": messages | junk,
    }
).flatmap(lambda fixed: st.lists(fields, max_size=5).map(lambda pairs: {**fixed, **dict(pairs)}))


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=bodies,
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    raw=st.sampled_from([False, False, False, True]),
)
def test_fuzzed_bodies_get_2xx_or_4xx_and_the_server_keeps_serving(server, body, route, raw):
    url, engine, _ = server
    data = json.dumps(body).encode()
    if raw:  # a body cut short or not JSON at all
        data = data[: len(data) // 2]
    status, answer = request(url, "POST", route, data, timeout=120)
    assert 200 <= status < 300 or 400 <= status < 500, (status, answer[:300])
    if status >= 400:
        error = json.loads(answer)
        assert "error" in error and error["error"]["message"], answer[:300]
    assert_serving(url, engine)

"""The OpenAI-compatible server, driven by the ``openai`` client over loopback."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from engine_helpers import assert_matches_hf, one_torch_thread, smollm2

from examples.engine import EngineConfig, LLMEngine

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def server():
    """A server on a free loopback port over a fresh engine; yields (client, engine, chat)."""
    from examples.engine.server import create_app

    model, chat = smollm2()
    engine = LLMEngine(model, EngineConfig(num_pages=64), chat.stop_token_ids)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        create_app(engine, chat, "smollm2"), host="127.0.0.1", port=port, log_level="error"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
    )
    yield client, engine, chat
    srv.should_exit = True
    thread.join(timeout=30)


def test_models_lists_the_served_model(server):
    client, _, _ = server
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_completion_is_the_greedy_reply_and_streaming_gives_the_same_text(server):
    client, engine, chat = server
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
    client, _, chat = server
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
        ({"model": "smollm2", "stop": ["\n"]}, 400, "stop"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"model": "smollm2", "max_tokens": 2000}, 400, "prompt"),  # 64 pages of 16 cannot hold it
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, kwargs, status, param):
    client, engine, _ = server
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(prompt="Hello", **kwargs)
    assert info.value.status_code == status
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"]
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=2).choices[0].text is not None
    engine.check_invariants()


def test_malformed_bodies_are_400(server):
    client, _, _ = server
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
    client, engine, _ = server
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
    client, _, chat = server
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

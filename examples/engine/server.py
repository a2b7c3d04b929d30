"""An OpenAI-compatible HTTP server over the engine: /v1/models, /v1/completions, /v1/chat/completions.

    python -m examples.engine.server --model smollm2 --port 8000

The engine steps in one background thread (it owns the cache and the model); HTTP handlers hand it
requests and aborts through a queue and read tokens back through per-request asyncio queues. Bad
requests get OpenAI-style errors (``{"error": {"message", "type", "param", "code"}}``, status 4xx).
With a dummy model the text is meaningless (random weights); the timings are real.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatFormat
from .engine import LLMEngine
from .request import Sample, SamplingParams

# ---------------------------------------------------------------------------------------- the worker


class EngineWorker:
    """Runs ``engine.step`` in a thread; ``submit`` and ``abort`` may be called from any thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stop = False
        # OpenMP's thread count is per thread: the engine thread takes the one set where it is created.
        self._num_threads = torch.get_num_threads()
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue, Future]:
        """Queue a request; returns its id, the queue its (sample index, token, finish reason or None)
        events arrive on, and a future that fails with the engine's ValueError if it is refused."""
        request_id, events, accepted = uuid.uuid4().hex, asyncio.Queue(), Future()
        self._commands.put(("add", request_id, prompt, params, asyncio.get_running_loop(), events, accepted))
        return request_id, events, accepted

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(("wake",))
        self._thread.join()

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)
        while not self._stop:
            block = not self.engine.has_work()
            try:
                while True:
                    self._handle(self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            samples = self.engine.step()
            for sample in samples:
                self._publish(sample)
            for sample in samples:  # after all of the step's tokens are out: several samples end at once
                if sample.request.finished:
                    self._streams.pop(sample.request.request_id, None)

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt, params, loop, events, accepted = command
            try:
                self.engine.add_request(prompt, params, request_id)
            except ValueError as error:
                accepted.set_exception(error)
                return
            self._streams[request_id] = (loop, events)
            accepted.set_result(None)
        elif command[0] == "abort":
            self.engine.abort(command[1])
            self._streams.pop(command[1], None)

    def _publish(self, sample: Sample) -> None:
        request_id = sample.request.request_id
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, events = stream
        event = (sample.index, int(sample.output[-1]), sample.finish_reason)
        loop.call_soon_threadsafe(events.put_nowait, event)


# ---------------------------------------------------------------------------------------- the API


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False  # an extension vLLM also accepts: benchmarks fix output lengths with it
    # Extension: each choice (or streamed chunk) also carries its new token ids, so that a client can
    # send a reply back in the next prompt exactly as generated (the benchmark's multi-turn chats).
    return_token_ids: bool = False
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None


class CompletionBody(_Common):
    prompt: str | list[int] = Field(min_length=1)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def _error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(
    engine: LLMEngine, chat: ChatFormat, model_name: str, default_max_tokens: int = 256
) -> FastAPI:
    """The FastAPI app; the engine thread starts with the app and stops with it."""
    worker: dict[str, EngineWorker] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker["w"] = EngineWorker(engine)
        yield
        worker.pop("w").shutdown()

    app = FastAPI(title="prefix-cache engine", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return _error(error.status, error.message, error.kind, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(
            400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error", param
        )

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "prefix-cache"}
        return {"object": "list", "data": [card]}

    def params_of(body: _Common, max_tokens: int | None) -> SamplingParams:
        if body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server has {model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.stop:
            raise APIError(400, "stop strings are not supported; use ignore_eos or max_tokens", param="stop")
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        return SamplingParams(
            max_tokens=max_tokens or default_max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            n=body.n,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )

    async def collect(events: asyncio.Queue, n: int) -> AsyncIterator[tuple[int, list[int], str | None]]:
        """(sample index, its tokens so far, finish reason) after every token, until all n finish."""
        outputs: list[list[int]] = [[] for _ in range(n)]
        finished = 0
        while finished < n:
            index, token, reason = await events.get()
            outputs[index].append(token)
            finished += reason is not None
            yield index, outputs[index], reason

    def visible(tokens: list[int], reason: str | None) -> str:
        # A reply's stop token is not part of its text.
        if reason == "stop" and tokens and tokens[-1] in chat.stop_token_ids:
            tokens = tokens[:-1]
        return chat.decode(tokens)

    async def respond(kind: str, prompt: list[int], params: SamplingParams, stream: bool, return_ids: bool):
        w = worker["w"]
        request_id, events, accepted = w.submit(prompt, params)
        try:
            await asyncio.wrap_future(accepted)
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        created = int(time.time())
        chat_kind = kind == "chat"
        base = {
            "id": ("chatcmpl-" if chat_kind else "cmpl-") + request_id,
            "created": created,
            "model": model_name,
        }
        if not stream:
            texts, reasons, count = [""] * params.n, [None] * params.n, 0
            ids: list[list[int]] = [[] for _ in range(params.n)]
            async for index, tokens, reason in collect(events, params.n):
                count += 1
                if reason is not None:
                    texts[index], reasons[index], ids[index] = visible(tokens, reason), reason, tokens
            if chat_kind:
                choices = [
                    {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r}
                    for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
                ]
            else:
                choices = [
                    {"index": i, "text": t, "logprobs": None, "finish_reason": r}
                    for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
                ]
            if return_ids:
                for choice, tokens in zip(choices, ids, strict=True):
                    choice["token_ids"] = tokens
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": count,
                "total_tokens": len(prompt) + count,
            }
            return {
                **base,
                "object": "chat.completion" if chat_kind else "text_completion",
                "choices": choices,
                "usage": usage,
            }

        async def sse() -> AsyncIterator[str]:
            sent, sent_ids = [""] * params.n, [0] * params.n
            obj = "chat.completion.chunk" if chat_kind else "text_completion"
            done = False
            try:
                if chat_kind:
                    for i in range(params.n):
                        delta = {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                        yield f"data: {json.dumps({**base, 'object': obj, 'choices': [delta]})}\n\n"
                async for index, tokens, reason in collect(events, params.n):
                    text = visible(tokens, reason)
                    if reason is None and text.endswith("\ufffd"):
                        continue  # a character cut in the middle of its bytes: wait for the rest
                    piece, sent[index] = text[len(sent[index]) :], text
                    if chat_kind:
                        choice = {"index": index, "delta": {"content": piece}, "finish_reason": reason}
                    else:
                        choice = {"index": index, "text": piece, "logprobs": None, "finish_reason": reason}
                    if return_ids:
                        choice["token_ids"], sent_ids[index] = tokens[sent_ids[index] :], len(tokens)
                    yield f"data: {json.dumps({**base, 'object': obj, 'choices': [choice]})}\n\n"
                done = True
                yield "data: [DONE]\n\n"
            finally:
                if not done:  # the client went away: stop generating for it
                    w.abort(request_id)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        params = params_of(body, body.max_tokens)
        prompt = chat.encode(body.prompt).tolist() if isinstance(body.prompt, str) else body.prompt
        return await respond("completion", prompt, params, body.stream, body.return_token_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        params = params_of(body, body.max_completion_tokens or body.max_tokens)
        prompt = chat.render([m.model_dump() for m in body.messages]).tolist()
        return await respond("chat", prompt, params, body.stream, body.return_token_ids)

    return app


def main(argv: list[str] | None = None) -> int:
    from .engine import EngineConfig
    from .loading import load_model
    from .scheduler import SchedulerConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2", help="smollm2 (real weights), dummy-8b or dummy-1b (random)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "flashinfer"])
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-cascade", action="store_true")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)

    import uvicorn

    model, chat = load_model(args.model, args.device)
    config = EngineConfig(
        num_pages=args.num_pages,
        page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype,
        backend=args.backend,
        cascade=not args.no_cascade,
        scheduler=SchedulerConfig(args.max_batched_tokens, args.max_num_seqs, not args.no_prefix_caching),
    )
    engine = LLMEngine(model, config, chat.stop_token_ids)
    if args.model != "smollm2":
        print(f"{args.model}: random weights at real shapes: text is meaningless, timings are real")
    uvicorn.run(create_app(engine, chat, args.model), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

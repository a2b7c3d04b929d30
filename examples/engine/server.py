"""An OpenAI-compatible HTTP server over the engine: /v1/models, /v1/completions, /v1/chat/completions,
/metrics (Prometheus) and /health. See docs/server.md.

    python -m examples.engine.server --model smollm2 --port 8000

The engine steps in one background thread (``worker.py``); HTTP handlers validate a request at the
door (``protocol.py``), tokenize it in a worker thread, hand it to the engine and turn its token events
into text in a worker thread (``outputs.py``). Bad requests get OpenAI-style errors
(``{"error": {"message", "type", "param", "code"}}``, status 4xx); a request the engine fails gets a
500 naming the cause, and the others go on. A client that goes away aborts its request.
With a dummy model the text is meaningless (random weights); the timings are real.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .chat import ChatFormat
from .engine import LLMEngine
from .metrics import EngineMetrics
from .outputs import RequestOutput
from .protocol import APIError, ChatBody, CompletionBody, RequestBody
from .request import SamplingParams
from .responses import BodySizeLimit, choice_of, chunk_choice
from .worker import CACHED, ERROR, EngineWorker

log = logging.getLogger("examples.engine.server")

#: How often a non-streaming handler checks that its client is still there (seconds).
DISCONNECT_POLL_S = 0.25


def create_app(
    engine: LLMEngine,
    chat: ChatFormat,
    model_name: str,
    default_max_tokens: int = 256,
    max_model_len: int | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    log_interval: float = 10.0,
) -> FastAPI:
    """The FastAPI app; the engine thread starts with the app and stops with it.

    max_model_len: the most tokens (prompt plus max_tokens) of a request; default: the model's
    context length. max_body_bytes: larger request bodies get a 413 before they are read whole.
    log_interval: seconds between throughput log lines (while anything runs)."""
    max_len = max_model_len or engine.model.config.context_length
    vocab_size = engine.model.config.vocab_size
    metrics = EngineMetrics(engine.cache.num_pages)
    worker: dict[str, EngineWorker] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker["w"] = EngineWorker(engine, metrics, log_interval)
        config = engine.config
        log.info(
            "serving %s at %s: backend %s, %d KV pages of %d tokens, prefix caching %s, cascade %s, "
            "up to %d tokens per request",
            model_name,
            getattr(app.state, "address", "(in process)"),
            config.backend,
            config.num_pages,
            config.page_size,
            "on" if config.scheduler.prefix_caching else "off",
            "on" if config.cascade else "off",
            max_len,
        )
        yield
        worker.pop("w").shutdown()

    app = FastAPI(title="prefix-cache engine", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "prefix-cache",
            "max_model_len": max_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        alive = "w" in worker and worker["w"].alive
        return PlainTextResponse(
            "ok" if alive else "engine thread stopped", status_code=200 if alive else 503
        )

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def params_of(
        body: RequestBody, prompt: list[int], max_tokens: int | None, logprobs: int | None, prompt_param: str
    ) -> SamplingParams:
        if len(prompt) >= max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt)}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and len(prompt) + max_tokens > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt)} and "
                f"max_tokens is {max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = max_tokens or min(default_max_tokens, max_len - len(prompt))
        return body.sampling_params(max_tokens, logprobs, vocab_size, chat.stop_token_ids)

    def check_door(body: RequestBody) -> tuple[str, ...]:
        if body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server has {model_name!r}",
                param="model",
                code="model_not_found",
            )
        body.check_supported()
        return body.stop_strings()

    async def respond(
        http: Request,
        kind: str,
        prompt: list[int],
        params: SamplingParams,
        body: RequestBody,
        stop: tuple[str, ...],
    ):
        w = worker.get("w")
        if w is None or not w.alive:
            raise APIError(503, "the engine is not running", kind="server_error")
        request_id, events, accepted = w.submit(prompt, params)
        try:
            await asyncio.wrap_future(accepted)
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        except Exception as error:  # the engine could not take it: not the client's fault
            message = f"the engine could not take this request: {type(error).__name__}: {error}"
            raise APIError(500, message, kind="server_error") from None
        output = RequestOutput(chat, params.n, stop, params.stop_token_ids | chat.stop_token_ids)
        chat_kind, include_usage = (
            kind == "chat",
            bool(body.stream_options and body.stream_options.include_usage),
        )
        base = {
            "id": ("chatcmpl-" if chat_kind else "cmpl-") + request_id,
            "created": int(time.time()),
            "model": model_name,
        }
        logprobs = params.logprobs is not None

        def usage() -> dict:
            completion = sum(len(s.ids) for s in output.samples)
            return {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
                "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
            }

        def consume(batch: list[tuple]) -> list[tuple]:
            """In a worker thread: take the events, return the new pieces (stop strings cut)."""
            for code, value, reason, logprob in batch:
                if code == ERROR:
                    raise APIError(500, f"the engine failed this request: {value}", kind="server_error")
                if code == CACHED:
                    output.cached_tokens = value
                elif output.add(code, value, reason, logprob):
                    w.abort(request_id, code, "stop")
            return output.pieces()

        async def batches() -> AsyncIterator[list[tuple]]:
            while not output.finished:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                yield await asyncio.to_thread(consume, batch)

        if not body.stream:
            done = False
            generate = asyncio.ensure_future(_drain(batches()))
            try:
                while not generate.done():
                    await asyncio.wait({generate}, timeout=DISCONNECT_POLL_S)
                    if not generate.done() and await http.is_disconnected():
                        generate.cancel()
                        log.info("request %s: client went away, aborted", request_id)
                        return JSONResponse({}, status_code=499)
                generate.result()
                done = True
            finally:
                if not done:
                    generate.cancel()
                    w.abort(request_id)
            choices = await asyncio.to_thread(
                lambda: [
                    choice_of(chat_kind, output, i, body.return_token_ids, logprobs) for i in range(params.n)
                ]
            )
            obj = "chat.completion" if chat_kind else "text_completion"
            return {**base, "object": obj, "choices": choices, "usage": usage()}

        async def sse() -> AsyncIterator[str]:
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
                try:
                    async for pieces in batches():
                        for piece in pieces:
                            choice = chunk_choice(chat_kind, output, piece, body.return_token_ids, logprobs)
                            if choice is not None:
                                yield f"data: {json.dumps({**base, 'object': obj, 'choices': [choice]})}\n\n"
                except APIError as error:  # the headers went out with 200: the error is the last event
                    done = True
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                if include_usage:
                    yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
                done = True
                yield "data: [DONE]\n\n"
            finally:
                if not done:  # the client went away: stop generating for it
                    w.abort(request_id)
                    log.info("request %s: client went away, aborted", request_id)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionBody):
        stop = check_door(body)
        if isinstance(body.prompt, str):
            prompt = (await asyncio.to_thread(chat.encode, body.prompt)).tolist()
        else:
            prompt = body.prompt
        params = params_of(body, prompt, body.max_tokens, body.logprobs, "prompt")
        return await respond(http, "completion", prompt, params, body, stop)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatBody):
        stop = check_door(body)
        messages = body.chat_messages()
        prompt = (await asyncio.to_thread(chat.render, messages)).tolist()
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        params = params_of(body, prompt, body.max_completion_tokens or body.max_tokens, logprobs, "messages")
        return await respond(http, "chat", prompt, params, body, stop)

    return app


async def _drain(pieces: AsyncIterator[list]) -> None:
    async for _ in pieces:
        pass


def main(argv: list[str] | None = None) -> int:
    from .options import (
        add_engine_options,
        add_model_options,
        check_device,
        check_tensor_parallel,
        engine_config,
        ranged_int,
        run_cli,
    )

    ap = argparse.ArgumentParser(
        prog="python -m examples.engine.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(ap)
    add_engine_options(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=ranged_int(0, 65535), default=8000)
    ap.add_argument(
        "--max-model-len", type=ranged_int(2), help="tokens per request (default: the model's context)"
    )
    ap.add_argument(
        "--max-tokens-default", type=ranged_int(1), default=256, help="max_tokens when a request has none"
    )
    ap.add_argument(
        "--max-body-bytes", type=ranged_int(1024), default=4 * 1024 * 1024, help="larger bodies get 413"
    )
    ap.add_argument("--log-interval", type=ranged_int(1), default=10, help="seconds between throughput lines")
    args = ap.parse_args(argv)
    check_device(ap, args)
    check_tensor_parallel(ap, args)

    def serve() -> int:
        import uvicorn

        from .loading import load_model
        from .tensor_parallel import model_loader, tensor_parallel_engine

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model, chat = load_model(args.model, args.device)
        engine = tensor_parallel_engine(
            model,
            engine_config(args),
            chat.stop_token_ids,
            args.tensor_parallel_size,
            model_loader(args.model),
        )
        if args.model != "smollm2":
            log.info("%s: random weights at real shapes: text is meaningless, timings are real", args.model)
        app = create_app(
            engine,
            chat,
            args.model,
            args.max_tokens_default,
            args.max_model_len,
            args.max_body_bytes,
            args.log_interval,
        )
        app.state.address = f"http://{args.host}:{args.port}"
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        finally:
            engine.close()
        return 0

    return run_cli(ap, serve)


if __name__ == "__main__":
    raise SystemExit(main())

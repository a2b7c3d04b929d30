"""OpenAI response pieces (choices, stream chunks, logprobs) and the request body size limit."""

from __future__ import annotations

import json

from .outputs import RequestOutput


def _chat_logprobs(output: RequestOutput, ids: list[int], entries: list[tuple]) -> dict:
    """Chat's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def item(token: int, logprob: float) -> dict:
        text = output.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**item(token, lp), "top_logprobs": [item(t, v) for t, v in zip(top_ids, top_lps, strict=True)]}
        for token, (lp, top_ids, top_lps) in zip(ids, entries, strict=False)
    ]
    return {"content": content}


def _completion_logprobs(output: RequestOutput, ids: list[int], entries: list[tuple]) -> dict:
    """Completions' legacy ``logprobs``: tokens, token_logprobs, top_logprobs (token text -> logprob)."""
    pairs = list(zip(ids, entries, strict=False))
    return {
        "tokens": [output.token_text(t) for t, _ in pairs],
        "token_logprobs": [lp for _, (lp, _, _) in pairs],
        "top_logprobs": [
            {output.token_text(t): v for t, v in zip(top_ids, top_lps, strict=True)}
            for _, (_, top_ids, top_lps) in pairs
        ],
    }


def _logprobs(chat_kind: bool, output: RequestOutput, ids: list[int], entries: list[tuple]) -> dict:
    return (_chat_logprobs if chat_kind else _completion_logprobs)(output, ids, entries)


def choice_of(chat_kind: bool, output: RequestOutput, index: int, return_ids: bool, logprobs: bool) -> dict:
    """The finished choice ``index`` of a non-streamed response."""
    s = output.samples[index]
    choice: dict = {"index": index, "finish_reason": s.finish_reason}
    lp = _logprobs(chat_kind, output, s.ids, s.logprobs) if logprobs else None
    if chat_kind:
        choice |= {"message": {"role": "assistant", "content": s.text}, "logprobs": lp}
    else:
        choice |= {"text": s.text, "logprobs": lp}
    if return_ids:
        choice["token_ids"] = s.ids
    return choice


def chunk_choice(
    chat_kind: bool, output: RequestOutput, piece: tuple, return_ids: bool, logprobs: bool
) -> dict | None:
    """A stream chunk's choice for ``piece`` (index, text, new ids, new logprob entries, finish
    reason); None when it would carry nothing the client asked for."""
    index, text, ids, entries, reason = piece
    if not text and reason is None and not return_ids and not (logprobs and entries):
        return None
    choice: dict = {"index": index, "finish_reason": reason}
    lp = _logprobs(chat_kind, output, ids, entries) if logprobs else None
    if chat_kind:
        choice |= {"delta": {"content": text}, "logprobs": lp}
    else:
        choice |= {"text": text, "logprobs": lp}
    if return_ids:
        choice["token_ids"] = ids
    return choice


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 with an OpenAI-style error, from
    its Content-Length before anything is read, or once that many bytes of a chunked body came."""

    def __init__(self, app: object, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        state = {"received": 0, "over": False, "refused": False}

        async def limited_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes:
                    state["over"] = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: dict) -> None:
            if not state["over"]:
                await send(message)
            elif not state["refused"]:  # the app answered a cut body: answer 413 instead
                state["refused"] = True
                await self._refuse(send)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, send: object) -> None:
        message = f"the request body is larger than {self.max_bytes} bytes"
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

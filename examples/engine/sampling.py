"""Choosing the next token from logits: greedy, or temperature with top-p from a seeded generator."""

from __future__ import annotations

import torch

from .request import Sample


def sample_tokens(logits: torch.Tensor, samples: list[Sample]) -> list[int]:
    """The next token of each sample. logits: float32 [len(samples), vocab], row i for samples[i]."""
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    for row, s in enumerate(samples):
        params = s.request.params
        if params.temperature == 0.0:
            continue
        if s.generator is None:
            s.generator = torch.Generator(device=logits.device)
            seed = params.seed if params.seed is not None else int(torch.seed() % 2**62)
            s.generator.manual_seed(seed + s.index)
        probs = torch.softmax(logits[row] / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always).
            drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = int(torch.multinomial(probs, 1, generator=s.generator))
    return tokens

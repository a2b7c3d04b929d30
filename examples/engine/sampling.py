"""Choosing the next token from logits: greedy, or temperature with top-p from a seeded generator.

A row that fails (a bad parameter that got past validation, a numerical error) fails only its own
sample: ``sample_tokens`` reports it instead of raising, so the engine fails that request alone.
"""

from __future__ import annotations

import torch

from .request import Sample


def sample_tokens(logits: torch.Tensor, samples: list[Sample]) -> tuple[list[int], dict[int, Exception]]:
    """The next token of each sample, and the rows whose sampling raised (row -> the exception; their
    token is meaningless). logits: float32 [len(samples), vocab], row i for samples[i]; left as is
    (penalties apply to a copy)."""
    penalized = [row for row, s in enumerate(samples) if s.request.params.penalized]
    if penalized:
        logits = logits.clone()
        for row in penalized:
            _penalize(logits[row], samples[row])
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    failures: dict[int, Exception] = {}
    for row, s in enumerate(samples):
        if s.request.params.temperature == 0.0:
            continue
        try:
            tokens[row] = _draw(logits[row], s)
        except Exception as error:  # reported per request, the batch goes on
            failures[row] = error
    return tokens, failures


def _draw(logits: torch.Tensor, s: Sample) -> int:
    """A token drawn from one row [vocab] with the sample's temperature and top-p."""
    params = s.request.params
    if s.generator is None:
        s.generator = torch.Generator(device=logits.device)
        seed = params.seed if params.seed is not None else int(torch.seed() % 2**62)
        # An int64 seed plus an index under 64 is in the range torch generators take, [-2**63, 2**64).
        s.generator.manual_seed(seed + s.index)
    # In float64 (a temperature such as 1e-177 is 0 in float32) and shifted by the row's largest
    # logit first, so a tiny temperature sends the others to -inf (their probabilities to 0) rather
    # than every logit to +-inf (and the softmax to NaN).
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always).
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=s.generator))


def _penalize(logits: torch.Tensor, s: Sample) -> None:
    """OpenAI's frequency and presence penalties, in place on one row [vocab], over the sample's output."""
    params = s.request.params
    counts = torch.bincount(torch.from_numpy(s.output.astype("int64")), minlength=logits.shape[-1])
    counts = counts[: logits.shape[-1]].to(device=logits.device, dtype=logits.dtype)
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def token_logprobs(
    logits: torch.Tensor, samples: list[Sample], tokens: list[int]
) -> list[tuple[float, list[int], list[float]] | None]:
    """Per sample, None unless it asked for logprobs; else (the log-probability of ``tokens[row]``,
    the ids of the ``params.logprobs`` most likely tokens, their log-probabilities), under the
    model's distribution (``log_softmax`` of the raw logits [len(samples), vocab])."""
    out: list[tuple[float, list[int], list[float]] | None] = [None] * len(samples)
    rows = [row for row, s in enumerate(samples) if s.request.params.logprobs is not None]
    if not rows:
        return out
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(samples[row].request.params.logprobs for row in rows)
    top_lps, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen = logprobs.gather(1, torch.tensor([[tokens[r]] for r in rows], device=logits.device))
    chosen, top_ids, top_lps = chosen[:, 0].tolist(), top_ids.tolist(), top_lps.tolist()
    for i, row in enumerate(rows):
        n = samples[row].request.params.logprobs
        out[row] = (chosen[i], top_ids[i][:n], top_lps[i][:n])
    return out

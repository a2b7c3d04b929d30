"""Requests, their parallel samples, and the sampling parameters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache import Sequence

#: The seeds a request may give: int64, as OpenAI's API and vLLM take them.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: The most alternatives a token's log-probabilities list (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy; ``seed`` makes temperature sampling repeatable
    (sample ``i`` of a request draws from a generator seeded with ``seed + i``).

    stop_token_ids: a sample also finishes ("stop") on these, ``ignore_eos`` or not.
    logprobs: None, or k: each new token comes with its log-probability and the k most likely
        tokens' (under the model's raw distribution, before penalties and temperature).
    frequency_penalty, presence_penalty: OpenAI's, in [-2, 2]: a token's logit is lowered by
        ``frequency_penalty * count + presence_penalty * (count > 0)``, count its occurrences in the
        sample's output so far.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False  # run to max_tokens whatever is generated (benchmarks)
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise ValueError(f"n must be an int in [1, 64], got {self.n!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed must be an int in [{SEED_MIN}, {SEED_MAX}] (int64), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sample:
    """One of a request's ``n`` generations: its tokens, its KV state in the cache, its timings.

    ``tokens[:num_tokens]`` is the prompt then the output so far; the KV of ``tokens[:num_computed]``
    is in the pool (``seq`` holds those pages). After a preemption ``seq`` is None and
    ``num_computed`` 0: the sample is recomputed from its tokens, the cached prefix reused.
    """

    def __init__(self, request: Request, index: int) -> None:
        params = request.params
        self.request, self.index = request, index
        self.tokens = np.zeros(len(request.prompt) + params.max_tokens, dtype=np.int32)
        self.tokens[: len(request.prompt)] = request.prompt
        self.num_tokens = len(request.prompt)
        self.num_computed = 0
        self.seq: Sequence | None = None
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.admitted_at = -1  # admission counter: the largest is the youngest, preempted first
        self.num_preemptions = 0
        self.token_times = np.zeros(params.max_tokens, dtype=np.float64)  # perf_counter per output token
        self.generator: torch.Generator | None = None
        # Per output token when params.logprobs is set: (its logprob, top ids, their logprobs).
        self.logprobs: list[tuple[float, list[int], list[float]]] = []

    @property
    def num_output(self) -> int:
        return self.num_tokens - len(self.request.prompt)

    @property
    def output(self) -> np.ndarray:
        """The generated token ids so far."""
        return self.tokens[len(self.request.prompt) : self.num_tokens]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class Request:
    """A prompt and its samples. ``arrival_time`` is ``time.perf_counter()`` at creation."""

    def __init__(self, request_id: str, prompt: np.ndarray, params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.arrival_time = time.perf_counter()
        self.samples = [Sample(self, i) for i in range(params.n)]
        self.error: str | None = None  # why the engine failed it (its samples finish with "error")
        self.cached_tokens = 0  # prompt tokens sample 0 found in the cache when first admitted
        # Sample 0 prefills the prompt; the others are admitted once it is cached.
        self.prompt_cached = params.n == 1

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

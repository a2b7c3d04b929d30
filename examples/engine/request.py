"""Requests, their parallel samples, and the sampling parameters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache import Sequence


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy; ``seed`` makes temperature sampling repeatable
    (sample ``i`` of a request draws from a generator seeded with ``seed + i``)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False  # run to max_tokens whatever is generated (benchmarks)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise ValueError(f"n must be an int in [1, 64], got {self.n!r}")


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
        # Sample 0 prefills the prompt; the others are admitted once it is cached.
        self.prompt_cached = params.n == 1

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

"""Continuous batching over the prefix cache: a token budget per step, decodes first, then prefill chunks.

Each step the scheduler picks, oldest admitted first, running samples that need one token (decode),
then running samples still prefilling (a chunk each, as the budget allows), then admits waiting
samples (``match`` to see what is cached, ``open`` to lock it) with a first chunk. Every scheduled
chunk's pages are ``allocate``-d here; the engine writes the KV and ``commit``-s it after the forward.

When pages run out, the youngest running sample is preempted: its sequence is closed (its full pages
stay cached), it goes back to the front of the queue with its tokens, and when readmitted it is
recomputed from them, the cached prefix reused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from prefix_cache import OutOfPages, PrefixCache

from .request import Request, Sample, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """max_batched_tokens: query tokens per step (the budget); max_num_seqs: samples running at once;
    prefix_caching: False gives every sequence its own namespace, so nothing is ever matched."""

    max_batched_tokens: int = 512
    max_num_seqs: int = 64
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                f"max_batched_tokens and max_num_seqs must be >= 1, got "
                f"{self.max_batched_tokens}, {self.max_num_seqs}"
            )


class Scheduler:
    """Which samples run each step, and how many of their tokens."""

    def __init__(self, cache: PrefixCache, config: SchedulerConfig) -> None:
        self.cache, self.config = cache, config
        self.waiting: deque[Sample] = deque()
        self.running: list[Sample] = []  # admission order: oldest first
        self._admissions = 0
        self._namespaces = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue the request's samples; raises ValueError, queueing nothing, when one sample could
        never fit in the pool even alone."""
        ps = self.cache.page_size
        need = -(-(len(request.prompt) + request.params.max_tokens) // ps)
        if need > self.cache.num_pages:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens plus max_tokens {request.params.max_tokens} "
                f"needs {need} pages of {ps} tokens; the KV pool has {self.cache.num_pages}"
            )
        self.waiting.extend(request.samples)

    def schedule(self) -> list[tuple[Sample, int]]:
        """This step's (sample, number of tokens to compute), in the engine's request order, with
        the pages allocated. Samples the budget leaves out this step keep their state."""
        budget = self.config.max_batched_tokens
        batch: dict[Sample, int] = {}
        # A sample whose prefix is still loading from the host tier sits out until it is there.
        ready = [s for s in self.running if not s.seq.num_loading_tokens]
        decoding = [s for s in ready if s.num_tokens - s.num_computed == 1]
        prefilling = [s for s in ready if s.num_tokens - s.num_computed > 1]
        for s in decoding + prefilling:
            if budget == 0:
                break
            if s.status is not Status.RUNNING:  # preempted below while making room
                continue
            n = min(s.num_tokens - s.num_computed, budget)
            if self._allocate_or_preempt(s, n, batch):
                batch[s] = n
                budget -= n
        while budget and self.waiting and len(self.running) < self.config.max_num_seqs:
            s = self._next_admissible()
            if s is None or not self._admit(s, budget):
                break
            batch[s] = min(s.num_tokens - s.num_computed, budget)
            budget -= batch[s]
        return list(batch.items())

    def _allocate_or_preempt(self, s: Sample, n: int, batch: dict[Sample, int]) -> bool:
        """Allocate slots for ``s``'s next ``n`` tokens (those not reserved yet: a sample that sat
        out a step kept its reservation), preempting the youngest running samples until they fit;
        False when ``s`` itself was the youngest and got preempted."""
        while True:
            try:
                self.cache.allocate(s.seq, max(0, s.num_computed + n - s.seq.num_allocated_tokens))
                return True
            except OutOfPages:
                victim = max(self.running, key=lambda r: r.admitted_at)
                batch.pop(victim, None)  # its allocated slots go back with its sequence
                self.preempt(victim)
                if victim is s:
                    return False

    def _next_admissible(self) -> Sample | None:
        """The first waiting sample that may start: a request's extra samples wait until sample 0
        has its prompt in the cache, so that they find it there."""
        for s in self.waiting:
            if s.index == 0 or s.request.prompt_cached:
                return s
        return None

    def _admit(self, s: Sample, budget: int) -> bool:
        """Open ``s``'s sequence and allocate its first chunk of at most ``budget`` tokens; False,
        changing nothing, when the pool cannot hold the rest of its prompt now."""
        cache, ps = self.cache, self.cache.page_size
        namespace = None
        if not self.config.prefix_caching:
            namespace = self._namespaces
            self._namespaces += 1
        tokens = s.tokens[: s.num_tokens]
        cached = cache.match(tokens, namespace)
        # Admit only when the whole remaining prompt fits next to what runs (no thrashing).
        pages_needed = -(-s.num_tokens // ps) - cached // ps
        if pages_needed > cache.num_free_pages + cache.num_evictable_pages:
            return False
        seq = cache.open(tokens, namespace)
        n = min(s.num_tokens - seq.num_cached_tokens, budget)
        try:
            cache.allocate(seq, n)
        except OutOfPages:
            cache.close(seq)
            return False
        self.waiting.remove(s)
        s.seq, s.num_computed, s.status = seq, seq.num_cached_tokens, Status.RUNNING
        if s.index == 0 and s.num_preemptions == 0:
            s.request.cached_tokens = seq.num_cached_tokens
        s.admitted_at = self._admissions
        self._admissions += 1
        self.running.append(s)
        return True

    def preempt(self, s: Sample) -> None:
        """Release ``s``'s pages (full ones stay cached) and requeue it first, to be recomputed."""
        self.cache.close(s.seq)
        self.running.remove(s)
        s.seq, s.num_computed, s.status = None, 0, Status.WAITING
        s.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(s)

    def finish(self, s: Sample, reason: str) -> None:
        """End ``s`` (running or waiting) for ``reason`` ("stop", "length", "abort")."""
        if s.status is Status.RUNNING:
            self.cache.close(s.seq)
            self.running.remove(s)
        elif s.status is Status.WAITING:
            self.waiting.remove(s)
        s.seq, s.status, s.finish_reason = None, Status.FINISHED, reason

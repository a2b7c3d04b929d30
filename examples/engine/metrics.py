"""The server's metrics in Prometheus' text format, and the periodic throughput log line.

Names follow vLLM's (``vllm:num_requests_running`` is ``prefix_cache:num_requests_running`` here) where
vLLM has one. The engine thread records (``on_step``, ``on_finished``); HTTP handlers render
(``render``); a lock keeps each scrape consistent.

Counters (``_total``): ``prefix_cache_queries`` and ``prefix_cache_hits`` (prompt tokens looked up in
the cache at admission, and those found cached: ``PrefixCache.stats``'s query and hit tokens, since
the cache was built),
``prompt_tokens`` (prompts prefilled), ``generation_tokens``, ``num_preemptions``,
``request_success`` (by ``finished_reason``: stop, length, abort, error). Gauges:
``num_requests_running``, ``num_requests_waiting`` (samples), ``kv_pool_pages``, ``kv_pages_in_use``
(held by live sequences), ``kv_pages_cached`` (in the cache's tree, held or not),
``kv_pages_evictable`` (cached and held by none), ``kv_cache_usage_perc`` (in use / total, 0..1).
Histograms (seconds): ``time_to_first_token_seconds`` (engine arrival to sample 0's first token),
``time_per_output_token_seconds`` (each gap between two tokens of a sample),
``e2e_request_latency_seconds`` (engine arrival to the request's end).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .request import Request

PREFIX = "prefix_cache:"

# vLLM's bucket bounds (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Histogram:
    """Cumulative-on-render bucket counts (``counts[i]``: observations in (bounds[i-1], bounds[i]],
    the last one above every bound), their sum and count."""

    bounds: tuple[float, ...]
    counts: np.ndarray = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)

    def observe(self, values: np.ndarray) -> None:
        """Add observations (seconds, any shape)."""
        values = np.asarray(values, dtype=np.float64).ravel()
        np.add.at(self.counts, np.searchsorted(self.bounds, values, side="left"), 1)
        self.total += float(values.sum())

    def lines(self, name: str) -> list[str]:
        cumulative = np.cumsum(self.counts)
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.bounds, cumulative, strict=False)]
        out += [f'{name}_bucket{{le="+Inf"}} {cumulative[-1]}', f"{name}_sum {self.total:.6f}"]
        return [*out, f"{name}_count {cumulative[-1]}"]


@dataclass
class _Snapshot:
    """What the log line compares between two of its lines."""

    at: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    queries: int = 0
    hits: int = 0


class EngineMetrics:
    """Counters, gauges and histograms of one engine, updated by its thread."""

    def __init__(self, num_pages: int) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queries = 0
        self.hits = 0
        self.preemptions = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.running = self.waiting = 0
        self.pages_total, self.pages_in_use, self.pages_cached, self.pages_evictable = num_pages, 0, 0, 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._last_log = _Snapshot(time.monotonic())

    def on_step(self, engine: object, new_tokens: int, prefilled_prompt_tokens: int) -> None:
        """After a step of ``engine`` (an LLMEngine): ``new_tokens`` sampled, prompts of
        ``prefilled_prompt_tokens`` tokens got their first token."""
        stats = engine.cache.stats
        scheduler = engine.scheduler
        with self._lock:
            self.generation_tokens += new_tokens
            self.prompt_tokens += prefilled_prompt_tokens
            self.queries, self.hits = stats.query_tokens, stats.hit_tokens
            self.preemptions = scheduler.num_preemptions
            self.running, self.waiting = len(scheduler.running), len(scheduler.waiting)
            self.pages_cached, self.pages_evictable = stats.cached_pages, stats.evictable_pages
            self.pages_in_use = stats.num_pages - stats.free_pages - stats.evictable_pages

    def on_finished(self, request: Request, now: float) -> None:
        """A request ended (``now``: ``time.perf_counter()``); its samples' reasons and timings."""
        with self._lock:
            for s in request.samples:
                self.finished[s.finish_reason] = self.finished.get(s.finish_reason, 0) + 1
                times = s.token_times[: s.num_output]
                if len(times) > 1:
                    self.tpot.observe(np.diff(times))
            first = request.samples[0]
            if first.num_output:
                self.ttft.observe(np.array([first.token_times[0] - request.arrival_time]))
            self.e2e.observe(np.array([now - request.arrival_time]))

    def render(self) -> str:
        """The metrics in Prometheus' text exposition format (version 0.0.4)."""
        p = PREFIX
        with self._lock:
            usage = self.pages_in_use / self.pages_total if self.pages_total else 0.0
            scalars = [
                (
                    "prefix_cache_queries",
                    "counter",
                    "Prompt tokens looked up in the prefix cache.",
                    self.queries,
                ),
                ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.", self.hits),
                ("prompt_tokens", "counter", "Prompt tokens prefilled.", self.prompt_tokens),
                ("generation_tokens", "counter", "Tokens generated.", self.generation_tokens),
                ("num_preemptions", "counter", "Samples preempted for lack of KV pages.", self.preemptions),
                ("num_requests_running", "gauge", "Samples running.", self.running),
                ("num_requests_waiting", "gauge", "Samples waiting.", self.waiting),
                ("kv_pool_pages", "gauge", "KV pages in the pool.", self.pages_total),
                ("kv_pages_in_use", "gauge", "KV pages held by live sequences.", self.pages_in_use),
                ("kv_pages_cached", "gauge", "KV pages in the prefix cache's tree.", self.pages_cached),
                (
                    "kv_pages_evictable",
                    "gauge",
                    "Cached KV pages no live sequence holds.",
                    self.pages_evictable,
                ),
                ("kv_cache_usage_perc", "gauge", "Fraction of KV pages in use (0..1).", round(usage, 6)),
            ]
            out = []
            for name, kind, help_text, value in scalars:
                full = f"{p}{name}_total" if kind == "counter" else f"{p}{name}"
                out += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}", f"{full} {value}"]
            out += [
                f"# HELP {p}request_success Samples finished, by reason.",
                f"# TYPE {p}request_success counter",
            ]
            out += [
                f'{p}request_success_total{{finished_reason="{r}"}} {c}' for r, c in self.finished.items()
            ]
            for name, help_text, histogram in (
                ("time_to_first_token_seconds", "Arrival to the first token.", self.ttft),
                ("time_per_output_token_seconds", "Gap between two tokens of a sample.", self.tpot),
                ("e2e_request_latency_seconds", "Arrival to the request's end.", self.e2e),
            ):
                out += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} histogram"]
                out += histogram.lines(f"{p}{name}")
        return "\n".join(out) + "\n"

    def log_line(self, interval: float) -> str | None:
        """vLLM's periodic line (throughputs over the last interval, load, KV use, hit rate) when at
        least ``interval`` seconds passed since the last one and something ran; else None."""
        now = time.monotonic()
        last = self._last_log
        if now - last.at < interval:
            return None
        with self._lock:
            snap = _Snapshot(now, self.prompt_tokens, self.generation_tokens, self.queries, self.hits)
            running, waiting = self.running, self.waiting
            usage = self.pages_in_use / self.pages_total if self.pages_total else 0.0
        self._last_log = snap
        if snap.generation_tokens == last.generation_tokens and not running and not waiting:
            return None
        seconds = now - last.at
        queries, hits = snap.queries - last.queries, snap.hits - last.hits
        return (
            f"prompt throughput {(snap.prompt_tokens - last.prompt_tokens) / seconds:.1f} tokens/s, "
            f"generation throughput {(snap.generation_tokens - last.generation_tokens) / seconds:.1f} "
            f"tokens/s, running {running}, waiting {waiting}, KV pages in use {100 * usage:.1f}%, "
            f"prefix cache hit rate {100 * hits / queries if queries else 0.0:.1f}%"
        )

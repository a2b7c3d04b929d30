"""The text report of a replay."""

from __future__ import annotations

from prefix_cache.replay.conversation import Workload
from prefix_cache.replay.simulator import ReplayResult, SchedulerConfig


def format_report(workload: Workload, config: SchedulerConfig, res: ReplayResult) -> str:
    """A short aligned report: workload, hits against the best possible, pages, time in the cache."""
    evicted = res.stats.evicted_pages if res.stats is not None else 0
    rows = [
        (
            "workload",
            f"{workload.name}: {len(workload.conversations):,} conversations "
            f"({workload.dropped:,} skipped, {workload.turns_cut:,} turns cut by the caps), "
            f"loaded in {workload.load_seconds:.1f} s",
        ),
        (
            "engine",
            f"{config.num_pages:,} pages x {config.page_size} tokens, "
            f"{config.max_running} running max, {config.clients} clients",
        ),
        ("clock", _clock(config, res)),
        ("conversations", f"{res.conversations:,} replayed, {res.conversations_cut:,} cut short"),
        (
            "requests",
            f"{res.requests:,} admitted, {res.skipped_requests:,} skipped (larger than the pool), "
            f"{res.cut_replies:,} replies cut (out of pages)",
        ),
        ("prompt tokens", f"{res.prompt_tokens:,}"),
        ("cached tokens", f"{res.cached_tokens:,}"),
        ("hit rate", f"{res.hit_rate:.2%} (best possible with unlimited pages: {res.best_hit_rate:.2%})"),
        ("decode", f"{res.decode_tokens:,} tokens in {res.steps:,} steps, peak {res.peak_running} running"),
        (
            "pages",
            f"peak {res.peak_used_pages:,} holding KV, peak {res.peak_locked_pages:,} locked by "
            f"open requests, {evicted:,} evicted",
        ),
        (
            "cache time",
            f"admission {res.admit_us:.1f} µs/request (open {res.open_us:.1f}, allocate + commit "
            f"{res.prefill_us:.1f}), decode {res.decode_us:.2f} µs/running request/step, "
            f"close {res.close_us:.1f} µs/request",
        ),
        ("replay time", f"{res.wall_seconds:.2f} s"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _clock(config: SchedulerConfig, res: ReplayResult) -> str:
    """The simulated clock: its length, step duration and think time."""
    think = (
        f"think time {config.think_time:g} s mean (exponential), {res.idle_steps:,} steps idle"
        if config.think_time
        else "no think time"
    )
    return f"{res.simulated_seconds:,.1f} s simulated at {config.step_time:g} s per step; {think}"

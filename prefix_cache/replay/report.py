"""The text reports of a replay: one run, or one row per host tier size."""

from __future__ import annotations

from collections.abc import Sequence

from prefix_cache.replay.conversation import Workload
from prefix_cache.replay.simulator import ReplayResult, SchedulerConfig


def aligned(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A plain-text table: the header ``columns`` and ``rows`` of cells, the first column aligned
    left, the others right, two spaces apart."""
    widths = [max(len(row[i]) for row in [columns, *rows]) for i in range(len(columns))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [columns, *rows]
    ]


def format_report(workload: Workload, config: SchedulerConfig, res: ReplayResult, working_set: int) -> str:
    """A short aligned report: workload, hits against the best possible, pages, time in the cache.

    ``working_set``: the workload's distinct full pages
    (:func:`prefix_cache.replay.oracle.working_set_pages`), to size the pool against.
    """
    evicted = res.stats.evicted_pages if res.stats is not None else 0
    hit_rate = f"{res.hit_rate:.2%}"
    if config.host_pages:
        hit_rate += f" = GPU {res.gpu_hit_rate:.2%} + host {res.host_hit_rate:.2%}"
    rows = [
        (
            "workload",
            f"{workload.name}: {len(workload.conversations):,} conversations "
            f"({workload.dropped:,} skipped, {workload.turns_cut:,} turns cut by the caps), "
            f"loaded in {workload.load_seconds:.1f} s",
        ),
        ("engine", _engine(config, working_set)),
        ("clock", _clock(config, res)),
        ("conversations", f"{res.conversations:,} replayed, {res.conversations_cut:,} cut short"),
        (
            "requests",
            f"{res.requests:,} admitted, {res.skipped_requests:,} skipped (larger than the pool), "
            f"{res.cut_replies:,} replies cut (out of pages)",
        ),
        ("prompt tokens", f"{res.prompt_tokens:,}"),
        ("cached tokens", f"{res.cached_tokens:,}"),
        ("hit rate", f"{hit_rate} (best possible with unlimited pages: {res.best_hit_rate:.2%})"),
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
    if config.host_pages:
        rows.insert(
            -2,
            (
                "host tier",
                f"{config.host_pages:,} pages; {res.saved_pages:,} pages saved, {res.loaded_pages:,} "
                f"loaded; take_transfers + transfers_done {res.transfer_us:.1f} µs/step",
            ),
        )
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def format_tier_table(
    workload: Workload, runs: list[tuple[str, SchedulerConfig, ReplayResult]], working_set: int
) -> str:
    """One row per host tier size: ``runs`` holds ``(label, config, result)`` of replays that differ
    only in ``config.host_pages``. A run labelled ``unlimited`` is the reference of the
    "of unlimited" column (total hit rate over its total hit rate)."""
    first_config, first = runs[0][1], runs[0][2]
    unlimited = next((res for label, _, res in runs if label == "unlimited"), None)
    head = [
        f"workload      {workload.name}: {len(workload.conversations):,} conversations, "
        f"{first.requests:,} requests, {first.prompt_tokens:,} prompt tokens",
        f"engine        {_engine(first_config, working_set)}",
        f"clock         first row: {_clock(first_config, first)}",
        f"best possible {first.best_hit_rate:.2%} hit rate (unlimited GPU pages, first row's request order)",
        "",
    ]
    columns = ["host pool", "host pages", "hit rate", "GPU", "host", "saved", "loaded", "time"]
    if unlimited is not None:
        columns.insert(5, "of unlimited")
    rows = []
    for label, config, res in runs:
        row = [
            label,
            f"{config.host_pages:,}",
            f"{res.hit_rate:.2%}",
            f"{res.gpu_hit_rate:.2%}",
            f"{res.host_hit_rate:.2%}",
            f"{res.saved_pages:,}",
            f"{res.loaded_pages:,}",
            f"{res.wall_seconds:.1f} s",
        ]
        if unlimited is not None:
            share = res.hit_rate / unlimited.hit_rate if unlimited.hit_rate else 0.0
            row.insert(5, f"{share:.1%}")
        rows.append(row)
    lines = aligned(columns, rows)
    notes = [
        "",
        "host pool: the host tier in GPU pools (its pages in host pages); hit rate: cached / prompt tokens;",
        "GPU, host: found on the GPU, found on the host and loaded; saved, loaded: pages copied by the",
        "transfer batches (GPU to host, host to GPU).",
    ]
    if unlimited is not None:
        notes.append(
            "unlimited: the working set plus the GPU pool, so the host never drops a page; of unlimited:"
        )
        notes.append("the hit rate over the unlimited host tier's.")
    return "\n".join(head + lines + notes)


def _engine(config: SchedulerConfig, working_set: int) -> str:
    """The engine's limits, and its pool against the workload's working set."""
    share = config.num_pages / working_set if working_set else 0.0
    return (
        f"{config.num_pages:,} pages x {config.page_size} tokens ({share:.0%} of the workload's working "
        f"set of {working_set:,} pages), {config.max_running} running max, {config.clients} clients"
    )


def _clock(config: SchedulerConfig, res: ReplayResult) -> str:
    """The simulated clock: its length, step duration and think time."""
    think = (
        f"think time {config.think_time:g} s mean (exponential), {res.idle_steps:,} steps idle"
        if config.think_time
        else "no think time"
    )
    return f"{res.simulated_seconds:,.1f} s simulated at {config.step_time:g} s per step; {think}"

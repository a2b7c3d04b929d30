"""Routers compared on the ShareGPT replay: 4 replicas, events over ZMQ on loopback.

Runs ``prefix-cache replay --replicas 4`` with the default engine, then with a quarter of the pages
per replica and twice the clients (so that the four pools together are the size of the default
single engine's and capacity decides), and writes both reports with the date, machine, versions
and exact commands to ``--output`` (default ``benchmarks/results/routing_sharegpt.md``). Last, the
cost of the two wire layouts side by side: the same batches encoded in each, alternately.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import msgspec
import numpy as np

from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.events.wire import LAYOUTS, to_wire

RUNS = (
    ("default engine per replica", ["--replicas", "4"]),
    (
        "a quarter of the pages per replica, twice the clients",
        ["--replicas", "4", "--num-pages", "4096", "--clients", "256"],
    ),
)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _step_batches(steps: int = 400, per_step: int = 8, seed: int = 0) -> list[list]:
    """Each step's events from one cache: chats over a 512-token system prompt (page 16), prompts of
    up to 2k tokens, a pool small enough to evict."""
    rng = np.random.default_rng(seed)
    cache = PrefixCache(num_pages=2048, page_size=16)
    system = rng.integers(0, 128_000, 512, dtype=np.int32)
    history = [system]
    batches = []
    for _ in range(steps):
        for _ in range(per_step):
            base = history[int(rng.integers(len(history)))]
            prompt = np.concatenate(
                [base, rng.integers(0, 128_000, int(rng.integers(16, 512)), dtype=np.int32)]
            )
            prompt = prompt[:2048]
            seq = cache.open(prompt)
            cache.allocate(seq, len(prompt) - seq.num_cached_tokens)
            cache.commit(seq, prompt[seq.num_cached_tokens :])
            cache.close(seq)
            history.append(prompt)
        batches.append(cache.drain_events())
    return batches


def _layout_costs(rounds: int = 5) -> list[str]:
    """Encode the same batches in each layout, alternately, ``rounds`` times; the best round each."""
    batches = _step_batches()
    encoder = msgspec.msgpack.Encoder()
    best = dict.fromkeys(LAYOUTS, float("inf"))
    size = {}
    for _ in range(rounds):
        for layout in LAYOUTS:
            start = time.perf_counter()
            payloads = [encoder.encode(to_wire(events, 0.0, 0, layout)) for events in batches]
            best[layout] = min(best[layout], time.perf_counter() - start)
            size[layout] = sum(map(len, payloads))
    events = sum(map(len, batches))
    lines = [
        "",
        "## the two wire layouts, side by side",
        "",
        f"The events of {len(batches)} steps of one cache ({events:,} events; 8 chat requests per step",
        "over a shared 512-token system prompt, page 16, prompts up to 2,048 tokens, 2,048 pages), encoded",
        f"(`to_wire` + msgpack) in each layout alternately, {rounds} rounds, the best round each:",
        "",
        "| layout | µs per batch | bytes per batch |",
        "|---|---:|---:|",
    ]
    for layout in LAYOUTS:
        lines.append(
            f"| {layout} | {best[layout] / len(batches) * 1e6:.1f} | {size[layout] / len(batches):,.0f} |"
        )
    lines.append("")
    ratio_time, ratio_bytes = best["vllm"] / best["array"], size["vllm"] / size["array"]
    lines.append(f"vllm / array: {ratio_time:.2f}x the time, {ratio_bytes:.2f}x the bytes.")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "routing_sharegpt.md"
    )
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True, check=False
    ).stdout.strip()
    versions = ", ".join(
        f"{name} {version(name)}" for name in ("numpy", "xxhash", "pyzmq", "msgspec", "tokenizers")
    )
    lines = [
        "# Routing across 4 replicas on the ShareGPT replay",
        "",
        f"- date: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}",
        f"- cpu: {_cpu()}, nproc {os.cpu_count()}; load average at start: {_load()}",
        f"- code (git describe --dirty): {commit}",
        f"- versions: Python {platform.python_version()}, {versions}",
        "- command: `python benchmarks/bench_routing.py`, which runs the commands below",
        "",
        "Each replica is the replay's scheduler with its own `PrefixCache` and pool; every replica "
        "publishes its events after each step over ZMQ on 127.0.0.1, and the `prefix` router sees "
        "the replicas only through a `BlockIndex` fed by a `KVEventSubscriber`. Times are wall "
        "clock per router on a shared machine.",
    ]
    for title, extra in RUNS:
        command = [sys.executable, "-m", "prefix_cache", "replay", "--no-progress", *extra]
        start = time.perf_counter()
        out = subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout
        elapsed = time.perf_counter() - start
        shown = "prefix-cache replay " + " ".join(extra)
        lines += ["", f"## {title}", "", f"`{shown}` ({elapsed:.0f} s in all, workload loading included)", ""]
        lines += ["```", out.rstrip(), "```"]
    lines += _layout_costs()
    lines += ["", f"- load average at end: {_load()}", ""]
    args.output.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Routers compared on the ShareGPT replay: 4 replicas, events over ZMQ on loopback.

Runs ``prefix-cache replay --replicas 4`` with the default engine, then with a quarter of the pages
per replica and twice the clients (so that the four pools together are the size of the default
single engine's and capacity decides), and writes both reports with the date, machine, versions
and exact commands to ``--output`` (default ``benchmarks/results/routing_sharegpt.md``).
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
    lines += ["", f"- load average at end: {_load()}", ""]
    args.output.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

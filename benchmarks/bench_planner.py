"""Host time of ``CascadePlanner.plan`` on a large decode batch, by the container its page tables come in.

The batch: 256 requests x 2000 pages of 16 tokens, one query token each; a 1000-page system prompt
shared by all, 16 conversations of 500 pages shared by 16 samples each, 500 pages per sample of its
own (a three-level plan). Page tables come as one 2-D int32 array, as a list of 1-D int32 arrays (an
engine's per-sequence block tables) or as lists of Python ints. Prints best and median milliseconds
and writes them, with the machine and versions, to a Markdown file.

    python benchmarks/bench_planner.py           # writes benchmarks/results/planner.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from prefix_cache import CascadePlanner

RESULTS = Path(__file__).resolve().parent / "results" / "planner.md"


def large_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tables [256, 2000] int32, kv_lens, qo_lens) of the batch described above."""
    requests = np.arange(256)[:, None]
    tables = np.empty((256, 2000), dtype=np.int32)
    tables[:, :1000] = np.arange(1000)
    tables[:, 1000:1500] = 1000 + 500 * (requests // 16) + np.arange(500)
    tables[:, 1500:] = 10_000 + 500 * requests + np.arange(500)
    return tables, np.full(256, 2000 * 16 - 5), np.ones(256, dtype=np.int64)


def time_plans(repeats: int) -> list[tuple[str, float, float, int]]:
    """Per container: (name, best ms, median ms, levels)."""
    tables, kv, qo = large_batch()
    inputs = {
        "2-D int32 array": (tables, kv, qo),
        "list of 1-D int32 arrays": (list(tables), kv, qo),
        "lists of Python ints": ([row.tolist() for row in tables], kv.tolist(), qo.tolist()),
    }
    planner = CascadePlanner()
    rows = []
    for name, (t, k, q) in inputs.items():
        plan = planner.plan(t, k, q, 16)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            planner.plan(t, k, q, 16)
            times.append((time.perf_counter() - start) * 1e3)
        rows.append((name, min(times), statistics.median(times), len(plan.levels)))
    return rows


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50, help="timed plans per container (default: 50)")
    ap.add_argument("--output", type=Path, default=RESULTS, help="Markdown results file")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"argument --repeats: must be at least 1, got {args.repeats}")
    load_start = os.getloadavg()
    rows = time_plans(args.repeats)
    code = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines = [
        "# CascadePlanner.plan: 256 requests x 2000 pages",
        "",
        f"- date: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}",
        f"- cpu: {_cpu()}, nproc {os.cpu_count()}",
        f"- load average (1, 5, 15 min) at start: {' '.join(f'{x:.2f}' for x in load_start)}",
        f"- code (git describe --dirty): {code}",
        f"- versions: Python {platform.python_version()}, numpy {np.__version__}",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        "",
        f"Wall-clock ms per `plan` call, {args.repeats} calls per container after one warm-up.",
        "",
        "| page tables | best ms | median ms | levels |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {best:.3f} | {median:.3f} | {levels} |" for name, best, median, levels in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

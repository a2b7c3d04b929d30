"""Host time of planning a large decode batch: ``CascadePlanner.plan`` by the container its page
tables come in, and the Triton backend's ``plan`` of the result.

The batch: 256 requests x 2000 pages of 16 tokens, one query token each; a 1000-page system prompt
shared by all, 16 conversations of 500 pages shared by 16 samples each, 500 pages per sample of its
own (a three-level plan). Page tables come as one 2-D int32 array, as a list of 1-D int32 arrays (an
engine's per-sequence block tables) or as lists of Python ints. Its samples decode in step (every
request has the same length); the "ragged" rows give each request 1 to 8000 tokens of its own
instead (the same tables and plan shape, other lengths), which takes the planner's general paths.
The backends plan for Llama-3-8B's
heads (32 / 8, head_dim 128, bf16 given at plan time): the exact-size Triton backend and one with a
``GraphCapacity``, on CPU tensors by default (their upload is then a CPU copy) or, with ``--device
cuda``, on the GPU as an engine's (the upload an asynchronous host-to-device copy from pinned memory,
waited for by the next plan). "in all" is the planner on the 2-D array plus the Triton backend's
plan, what an engine pays per step. Each row is timed in a loop of its own (after 5 warm-up
calls), as an engine calls it step after step; torch runs on one thread (its intra-op threads only
slow a copy this small on a shared machine). Prints best and median milliseconds and
writes them, with the machine and versions, to a Markdown file.

    python benchmarks/bench_planner.py           # writes benchmarks/results/planner.md
    python benchmarks/bench_planner.py --device cuda --output OUT.md
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
import torch

from prefix_cache import CascadePlanner
from prefix_cache.attention import create_backend
from prefix_cache.attention.triton_backend import GraphCapacity

RESULTS = Path(__file__).resolve().parent / "results" / "planner.md"


def large_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tables [256, 2000] int32, kv_lens, qo_lens) of the batch described above."""
    requests = np.arange(256)[:, None]
    tables = np.empty((256, 2000), dtype=np.int32)
    tables[:, :1000] = np.arange(1000)
    tables[:, 1000:1500] = 1000 + 500 * (requests // 16) + np.arange(500)
    tables[:, 1500:] = 10_000 + 500 * requests + np.arange(500)
    return tables, np.full(256, 2000 * 16 - 5), np.ones(256, dtype=np.int64)


def ragged_kv_lens() -> np.ndarray:
    """KV lengths of the ragged rows: the 1500 shared pages, then 1 to 8000 tokens of each request's."""
    return 1500 * 16 + np.random.default_rng(0).integers(1, 500 * 16 + 1, 256)


def time_plans(repeats: int, device: str = "cpu") -> list[tuple[str, float, float, int]]:
    """Per row: (name, best ms, median ms, levels)."""
    tables, kv, qo = large_batch()
    ragged = ragged_kv_lens()
    planner = CascadePlanner()
    plan = planner.plan(tables, kv, qo, 16)
    heads = dict(
        num_qo_heads=32, num_kv_heads=8, head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16
    )
    exact = create_backend("triton", device=device)
    pages = sum(level.kv_indices.shape[0] for level in plan.levels)
    fixed = create_backend(
        "triton", device=device, capacity=GraphCapacity(max_query_tokens=256, max_pages=pages, max_levels=4)
    )
    lists = [row.tolist() for row in tables]
    calls = {
        "planner, 2-D int32 array": lambda: planner.plan(tables, kv, qo, 16),
        "planner, list of 1-D int32 arrays": lambda: planner.plan(list(tables), kv, qo, 16),
        "planner, lists of Python ints": lambda: planner.plan(lists, kv.tolist(), qo.tolist(), 16),
        "triton backend plan": lambda: exact.plan(plan, **heads),
        "triton backend plan, GraphCapacity": lambda: fixed.plan(plan, **heads),
        "in all: planner (2-D) + triton backend plan": lambda: exact.plan(
            planner.plan(tables, kv, qo, 16), **heads
        ),
        "planner, 2-D int32 array, ragged lengths": lambda: planner.plan(tables, ragged, qo, 16),
        "in all, ragged lengths": lambda: exact.plan(planner.plan(tables, ragged, qo, 16), **heads),
    }
    rows = []
    for name, call in calls.items():
        for _ in range(5):  # warm-up
            call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
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
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per row (default: 50)")
    ap.add_argument("--output", type=Path, default=RESULTS, help="Markdown results file")
    ap.add_argument("--device", default="cpu", help="the backends' device: cpu (default) or cuda")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"argument --repeats: must be at least 1, got {args.repeats}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("argument --device: CUDA is not available here")
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    rows = time_plans(args.repeats, args.device)
    code = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines = [
        "# Planning 256 requests x 2000 pages: CascadePlanner.plan and the Triton backend's plan",
        "",
        f"- date: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}",
        f"- cpu: {_cpu()}, nproc {os.cpu_count()}",
        f"- backends' device: {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""),
        f"- load average (1, 5, 15 min) at start: {' '.join(f'{x:.2f}' for x in load_start)}",
        f"- code (git describe --dirty): {code}",
        f"- versions: Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        "",
        f"Wall-clock ms per call, {args.repeats} calls per row after 5 warm-up calls.",
        "",
        "| call | best ms | median ms | levels |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {best:.3f} | {median:.3f} | {levels} |" for name, best, median, levels in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bandwidth of the host tier's mover against a plain pinned ``copy_`` of the same bytes, side by side.

For each batch size (pages), six arms alternate for ``--rounds`` rounds; each arm's time is the wall
time from the call to the copy being over (``handle.wait()``, or ``torch.cuda.synchronize()`` after
the ``copy_``), median of the rounds, and its bandwidth is the batch's KV bytes over that time. The
"call µs" columns are the median time until ``save`` / ``load`` returned (the host's cost of
queuing the batch). The arms:

- ``copy_ save`` / ``copy_ load``: one ``copy_(non_blocking=True)`` of one contiguous GPU buffer of
  the batch's bytes to one contiguous pinned buffer, and back: the bus's bar;
- ``save`` / ``load``: ``KVMover.save`` of random GPU pages of the per-layer KV pool to consecutive
  host pages (one host run: the copy the host tier makes when its free pages come in runs), and
  ``load`` of those host pages into other random GPU pages;
- ``save, scattered`` / ``load, scattered``: the same with the host pages in random order (one copy
  per page: the worst case).

``--overlap N`` also times, per layout, a decode-step stand-in (``--layers`` matmuls of a 64-token
batch by [4096, 12288] bf16 weights, 3 GiB read per step, memory-bound as a decode step is) alone,
beside the mover's saves of N pages on its side stream (a new one whenever the host finds the last
one done, the host at most two steps ahead), and beside one pinned ``copy_`` of the same bytes issued
the same way: what the model's
step loses to background saves at the average rate they moved, and how much of that the copy
engine alone costs.

Every mover arm is checked once per size: a scattered save then a load into other pages reproduces
the saved pages bitwise ("bitwise" column). The default shapes are Llama-3-8B's (32 layers, 8 KV
heads of 128, page 16, bf16: 2 MiB a page). ``--layouts`` picks the KV pools, each measured in turn:
``nhd5``: a ``[num_pages, 2, page_size, H, D]`` tensor per layer (one gather per layer); ``one``: one
``[num_layers, num_pages, 2, page_size, H, D]`` tensor passed as ``list(pool)`` (the example
engine's: one 2-D copy per page on the copy engine, no gather); ``hnd``: per layer a K and a V
``[num_pages, H, page_size, D]`` passed transposed (two strided gathers per layer). The "how pages
move" column says which way the mover took.

    python benchmarks/bench_offload.py --out benchmarks/results          # CUDA
    python benchmarks/bench_offload.py --smoke                           # CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_cache import positive_int

from prefix_cache.attention.kv_layout import split_kv_cache
from prefix_cache.offload import HostKVPool, KVMover

ARMS = ("copy_ save", "save", "save, scattered", "copy_ load", "load", "load, scattered")


LAYOUTS = ("nhd5", "one", "hnd")


def kv_pool(layout: str, layers: int, pages: int, page_size: int, heads: int, dim: int, dtype, device):
    """The per-layer KV pool in ``layout``, random values."""
    if layout == "one":
        return list(torch.randn(layers, pages, 2, page_size, heads, dim, device=device).to(dtype))
    if layout == "nhd5":
        return [torch.randn(pages, 2, page_size, heads, dim, device=device).to(dtype) for _ in range(layers)]
    pool = []
    for _ in range(layers):
        k, v = (torch.randn(pages, heads, page_size, dim, device=device).to(dtype) for _ in range(2))
        pool.append((k.transpose(1, 2), v.transpose(1, 2)))
    return pool


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, for bitwise comparison."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def halves(kv_caches) -> list[torch.Tensor]:
    """Every layer's K and V, ``[num_pages, page_size, H, D]`` each."""
    return [half for kv_cache in kv_caches for half in split_kv_cache(kv_cache)]


def pages_equal(kv_caches, pages: torch.Tensor, expected: list[torch.Tensor]) -> bool:
    """``pages`` of every layer's K and V hold ``expected`` (``snapshot`` of other pages) bitwise."""
    return all(torch.equal(bits(h[pages]), bits(e)) for h, e in zip(halves(kv_caches), expected, strict=True))


def snapshot(kv_caches, pages: torch.Tensor) -> list[torch.Tensor]:
    """A copy of ``pages`` of every layer's K and V."""
    return [half[pages].clone() for half in halves(kv_caches)]


def timed(run: Callable[[], object], cuda: bool) -> tuple[float, float]:
    """Seconds from the call to its copies being over, and seconds until the call returned (what the
    caller's thread pays to queue the batch)."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    handle = run()
    returned = time.perf_counter()
    if handle is not None:
        handle.wait()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, returned - start


def bench_size(n: int, mover: KVMover, kv_caches, flat_gpu, flat_host, rounds: int, cuda: bool, rng) -> dict:
    """One row: the six arms at ``n`` pages."""
    page_bytes = mover.host_pool.page_bytes
    gpu_pages = mover.num_pages
    host_pages = mover.host_pool.num_pages
    nbytes = n * page_bytes
    src = rng.choice(gpu_pages, n, replace=False)
    dst = rng.choice(np.setdiff1d(np.arange(gpu_pages), src), n, replace=False)
    run_host = np.arange(n)
    scattered = rng.choice(host_pages, n, replace=False)
    # Bitwise check of the scattered path (the one with the most copies).
    device = flat_gpu.device
    expected = snapshot(kv_caches, torch.from_numpy(src).to(device))
    mover.save(src, scattered).wait()
    mover.load(scattered, dst).wait()
    bitwise = pages_equal(kv_caches, torch.from_numpy(dst).to(device), expected)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst[:nbytes].copy_(src[:nbytes], non_blocking=True)

    runs = {
        "copy_ save": lambda: copy(flat_host, flat_gpu),
        "save": lambda: mover.save(src, run_host),
        "save, scattered": lambda: mover.save(src, scattered),
        "copy_ load": lambda: copy(flat_gpu, flat_host),
        "load": lambda: mover.load(run_host, dst),
        "load, scattered": lambda: mover.load(scattered, dst),
    }
    for run in runs.values():  # warm-up: allocator, pinned index buffers
        timed(run, cuda)
    seconds: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for arm in order:
            seconds[arm].append(timed(runs[arm], cuda))
    row = {"pages": n, "mib": nbytes / 2**20, "bitwise": bitwise}
    for arm in ARMS:
        median = statistics.median(total for total, _ in seconds[arm])
        call = statistics.median(call for _, call in seconds[arm])
        row[arm] = {"ms": median * 1e3, "gb_per_s": nbytes / median / 1e9, "call_us": call * 1e6}
    for arm in ("save", "save, scattered", "load", "load, scattered"):
        bar = "copy_ save" if arm.startswith("save") else "copy_ load"
        row[arm]["of_copy"] = row[arm]["gb_per_s"] / row[bar]["gb_per_s"]
    return row


def overlap_row(mover: KVMover, pages: int, layers: int, rounds: int, rng) -> dict:
    """Median ms of a decode-step stand-in alone, beside the mover's saves of ``pages`` pages, and
    beside one pinned ``copy_`` of the same bytes on a side stream (the copy engine alone, no gather:
    the floor of any save), the three alternating over ``rounds`` rounds of 20 steps; and the GB/s
    each kind of save moved, on average over the steps. A new save is issued when the host, queuing
    a step, finds the last one done. The host queues a step only once the step two before it has
    run, as an engine that reads each step's tokens does, so a save is issued every step or two
    over the whole run (a host left to queue every step at once would issue them only while
    queuing, a fraction of the run)."""
    weights = torch.randn(layers, 4096, 12288, device="cuda").to(torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    src = rng.choice(mover.num_pages, pages, replace=False)
    dst = rng.choice(mover.host_pool.num_pages, pages, replace=False)
    nbytes = pages * mover.host_pool.page_bytes
    flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    steps = 20

    def plain_copy() -> torch.cuda.Event:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flat_host.copy_(flat_gpu, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return done

    def run(kind: str | None) -> tuple[float, int]:
        pending, saves = None, 0
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        queued: list[torch.cuda.Event] = []
        for _ in range(steps):
            if len(queued) >= 2:
                queued[-2].synchronize()  # at most two steps ahead of the GPU
            if kind and (pending is None or (pending.done() if kind == "mover" else pending.query())):
                pending, saves = (mover.save(src, dst) if kind == "mover" else plain_copy()), saves + 1
            for layer in range(layers):
                torch.matmul(x, weights[layer])
            queued.append(torch.cuda.Event())
            queued[-1].record()
        end.record()
        end.synchronize()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps, saves

    kinds = (None, "mover", "copy_")
    for kind in kinds:  # warm-up
        run(kind)
    times: dict = {kind: [] for kind in kinds}
    saved = dict.fromkeys(kinds, 0)
    for _ in range(rounds):
        for kind in kinds:
            ms, saves = run(kind)
            times[kind].append(ms)
            saved[kind] += saves
    row = {
        "pages": pages,
        "step_ms": statistics.median(times[None]),
        "step_ms_saving": statistics.median(times["mover"]),
        "step_ms_copy": statistics.median(times["copy_"]),
    }
    row["ratio"] = row["step_ms_saving"] / row["step_ms"]
    row["ratio_copy"] = row["step_ms_copy"] / row["step_ms"]
    for kind, key in (("mover", "save_gb_per_s"), ("copy_", "copy_gb_per_s")):
        row[key] = saved[kind] * nbytes / (sum(times[kind]) * steps * 1e-3) / 1e9
    return row


def how(row: dict) -> str:
    """How the mover moved a layout's pages: 2-D copies on the copy engine, or gathers per chunk."""
    return "2-D copies" if row["direct"] else f"{row['ops']} gathers"


def overlap_table(overlaps: list[dict], layers: int, rounds: int) -> str:
    """The decode-step stand-in beside each layout's saves and beside a plain ``copy_``."""
    lines = [
        f"Decode-step stand-in ({layers} matmuls of 64 x 4096 by 4096 x 12288 bf16), alone, beside the "
        f"mover's saves issued whenever the last was done (the host at most two steps ahead), and beside "
        f"one pinned copy_ of the same bytes issued so instead (the copy engine alone); medians of "
        f"{rounds} rounds of 20 steps:",
        "",
        "| layout (how pages move) | pages | step ms alone | with saves | ratio | saves GB/s "
        "| with copy_ | ratio | copy_ GB/s |",
        "|---|" + "---:|" * 8,
    ]
    for o in overlaps:
        lines.append(
            f"| {o['layout']} ({how(o)}) | {o['pages']} | {o['step_ms']:.3f} | {o['step_ms_saving']:.3f} "
            f"| {o['ratio']:.3f} | {o['save_gb_per_s']:.1f} | {o['step_ms_copy']:.3f} "
            f"| {o['ratio_copy']:.3f} | {o['copy_gb_per_s']:.1f} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    head = (
        "| layout (how pages move) | pages | MiB | copy_ save GB/s | save GB/s | save / copy_ "
        "| scattered save / copy_ | copy_ load GB/s | load GB/s | load / copy_ | scattered load / copy_ "
        "| save call µs | load call µs | bitwise |"
    )
    lines = [head, "|---|" + "---:|" * 12 + ":---:|"]
    for r in rows:
        lines.append(
            f"| {r['layout']} ({how(r)}) | {r['pages']} | {r['mib']:.3g} "
            f"| {r['copy_ save']['gb_per_s']:.1f} "
            f"| {r['save']['gb_per_s']:.1f} "
            f"| {r['save']['of_copy']:.2f} | {r['save, scattered']['of_copy']:.2f} "
            f"| {r['copy_ load']['gb_per_s']:.1f} | {r['load']['gb_per_s']:.1f} | {r['load']['of_copy']:.2f} "
            f"| {r['load, scattered']['of_copy']:.2f} "
            f"| {r['save']['call_us']:.0f} | {r['load']['call_us']:.0f} "
            f"| {'yes' if r['bitwise'] else 'NO'} |"
        )
    return "\n".join(lines)


def layout_names(text: str) -> list[str]:
    """``--layouts``: comma-separated names of ``LAYOUTS``."""
    names = text.split(",")
    for name in names:
        if name not in LAYOUTS:
            raise argparse.ArgumentTypeError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    return names


def page_counts(text: str) -> list[int]:
    """``--pages``: comma-separated batch sizes, each an integer >= 1."""
    return [positive_int(part) for part in text.split(",")]


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    found = re.search(r"model name\s*:\s*(.*)", text)
    return found.group(1).strip() if found else platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pages", type=page_counts, default="16,32,64,128,256,512", help="batch sizes, comma-separated"
    )
    parser.add_argument("--layers", type=positive_int, default=32)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument(
        "--layouts", type=layout_names, default="nhd5,one", help=f"KV pool layouts of {', '.join(LAYOUTS)}"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=15, help="timed rounds per arm (median reported)"
    )
    parser.add_argument("--staging-pages", type=positive_int, default=None, help="the mover's staging buffer")
    parser.add_argument("--out", default="benchmarks/results/local", help="folder for the JSON and markdown")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument(
        "--overlap",
        type=positive_int,
        default=None,
        help="also time a decode-step stand-in alone and with saves of this many pages in flight (CUDA)",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("bench_offload.py measures the device: it needs CUDA (or --smoke)")
    if args.smoke:
        args.pages, args.layers, args.kv_heads, args.head_dim, args.page_size = [1, 4, 8], 2, 2, 16, 4
        args.rounds = min(args.rounds, 3)
    sizes = args.pages
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    largest = max(sizes)
    torch.manual_seed(0)
    host_pool = HostKVPool(largest, args.layers, args.page_size, args.kv_heads, args.head_dim, dtype)
    flat_gpu = torch.empty(largest * host_pool.page_bytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(flat_gpu.shape, dtype=torch.uint8, pin_memory=cuda)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpu": cpu_name(),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "command": "python " + shlex.join(sys.argv),
        "shapes": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": str(dtype),
            "page_bytes": host_pool.page_bytes,
        },
        "staging_pages": args.staging_pages,
        "rounds": args.rounds,
    }
    print(json.dumps(meta), flush=True)
    rng = np.random.default_rng(0)
    rows, overlaps = [], []
    for layout in args.layouts:
        kv_caches = kv_pool(
            layout, args.layers, 2 * largest, args.page_size, args.kv_heads, args.head_dim, dtype, device
        )
        mover = KVMover(kv_caches, host_pool, staging_pages=args.staging_pages)
        movement = {"ops": mover.ops_per_chunk, "direct": mover.direct, "staging": mover.staging_pages}
        for n in sizes:
            row = bench_size(n, mover, kv_caches, flat_gpu, flat_host, args.rounds, cuda, rng)
            rows.append({"layout": layout, **movement, **row})
            print(
                f"{layout}, {n} pages: save {row['save']['of_copy']:.2f} of copy_, "
                f"load {row['load']['of_copy']:.2f}",
                flush=True,
            )
        if cuda and args.overlap:
            overlap = overlap_row(mover, min(args.overlap, largest), args.layers, args.rounds, rng)
            overlaps.append({"layout": layout, **movement, **overlap})
            print(f"overlap: {json.dumps(overlaps[-1])}", flush=True)
        del kv_caches, mover
    table = markdown(rows)
    if overlaps:
        table += "\n\n" + overlap_table(overlaps, args.layers, args.rounds)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "offload_smoke" if not cuda else "offload_" + re.sub(r"[^a-z0-9]+", "_", meta["device"].lower())
    results = {"meta": meta, "rows": rows, "overlaps": overlaps}
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(
        f"# The mover's bandwidth against a pinned copy_\n\n{json.dumps(meta)}\n\n{table}\n"
    )
    print(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()

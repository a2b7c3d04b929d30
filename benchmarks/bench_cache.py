"""Time spent in PrefixCache calls on a ShareGPT chat replay, against the targets.

Replays ShareGPT conversations (Llama 3 tokenizer, page 16, 64 running; tokens as numpy int32)
through ``prefix_cache.replay`` and reports, per admitted request, the microseconds in ``match``,
``open`` and the ``allocate`` + ``commit`` of the prompt's uncached tokens; per decode step per
running request (``allocate(seq, 1)`` + ``commit(seq, [token])``); per finished request
(``close``). Also: block hashing throughput, host memory per cached page, and the hit rate against
the best possible. Prints a table and writes it, with the machine and versions, to a Markdown file.

    python benchmarks/bench_cache.py                  # writes benchmarks/results/local/cache_sharegpt.md
    python benchmarks/bench_cache.py --output benchmarks/results/cache_sharegpt.md   # the committed one
    python benchmarks/bench_cache.py --profile        # adds the cProfile hot spots of one replay
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import xxhash

from prefix_cache.cache.hashing import Namespace, default_hash_fn
from prefix_cache.cache.prefix_cache import PrefixCache
from prefix_cache.cache.sequence import Sequence
from prefix_cache.replay.conversation import Conversation
from prefix_cache.replay.simulator import ReplayResult, SchedulerConfig, replay
from prefix_cache.replay.workloads import sharegpt_workload

# Git-ignored: a plain run never overwrites the committed results file next to it.
RESULTS = Path(__file__).resolve().parent / "results" / "local" / "cache_sharegpt.md"

#: Targets in µs per page size: admission per request, decode per running request per step, close
#: per request.
TARGETS = {
    16: {"admission": 40.0, "decode": 0.8, "close": 10.0},
    1: {"admission": 100.0, "decode": 1.0, "close": 50.0},
}


class MatchingCache(PrefixCache):
    """A cache that calls ``match`` before each ``open``, as a scheduler that peeks first would, and
    times it (``match_ns``); the replay's ``open`` time then includes it, and is corrected for it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.match_ns = 0

    def open(self, tokens: object, namespace: Namespace = None) -> Sequence:
        t0 = time.perf_counter_ns()
        self.match(tokens, namespace)
        self.match_ns += time.perf_counter_ns() - t0
        return super().open(tokens, namespace)


def run_replays(
    conversations: list[Conversation], config: SchedulerConfig, repeats: int, peek: bool = False
) -> list[tuple[ReplayResult, float]]:
    """``repeats`` replays on fresh caches (events off: nobody drains them), each with the µs per
    admitted request spent in ``match`` (0 unless ``peek``: then ``MatchingCache`` is used and the
    replay's ``open`` time includes the ``match`` time)."""
    runs = []
    for _ in range(repeats):
        gc.collect()
        cls = MatchingCache if peek else PrefixCache
        cache = cls(
            config.num_pages,
            config.page_size,
            record_events=False,
            host_pages=config.host_pages,
            write_through=config.host_write_through,
        )
        _, res = replay(conversations, config, cache=cache)
        runs.append((res, cache.match_ns / 1e3 / res.requests if peek else 0.0))
    return runs


def hash_throughput(conversations: list[Conversation], page_size: int) -> tuple[float, float]:
    """Chained block hashing as the cache does it, over every full page of every conversation's
    final context: (tokens per second, ns per page)."""
    tokens = np.concatenate(
        [
            np.concatenate([c.prefix, *(x for t in c.turns for x in (t.user, t.replies[0]))])
            for c in conversations
        ]
    )
    page_bytes = 4 * page_size
    data = tokens[: len(tokens) // page_size * page_size].tobytes()
    pages = len(data) // page_bytes
    best = float("inf")
    for _ in range(3):
        key = 0
        t0 = time.perf_counter_ns()
        for start in range(0, len(data), page_bytes):
            key = default_hash_fn(data[start : start + page_bytes], key)
        best = min(best, time.perf_counter_ns() - t0)
    return pages * page_size / (best / 1e9), best / pages


def memory_per_page(page_size: int, pages: int = 100_000, pages_per_prompt: int = 32) -> float:
    """Bytes of Python heap per cached page: tracemalloc's growth while ``pages`` distinct pages
    are cached through open / allocate / commit / close (prompts of ``pages_per_prompt`` pages plus
    one token), divided by the pages cached. The pool and its free list exist before the measurement."""
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, 128_000, size=pages_per_prompt * page_size + 1, dtype=np.int32)
        for _ in range(pages // pages_per_prompt)
    ]
    # A pool three times larger: its free list stays over half full, so it never shrinks mid-measure.
    cache = PrefixCache(3 * pages, page_size, record_events=False)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for prompt in prompts:
        seq = cache.open(prompt)
        cache.allocate(seq, len(prompt))
        cache.commit(seq, prompt)
        cache.close(seq)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown / cache.num_cached_pages


class ProfiledCache(PrefixCache):
    """A cache that profiles its calls by phase: admission (``open``, and ``allocate`` / ``commit``
    of more than one token), decode (one token) and ``close``, each in its own ``cProfile``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.profiles = {phase: cProfile.Profile() for phase in ("admission", "decode", "close")}

    def _call(self, phase: str, method: str, *args: object) -> object:
        profile, call = self.profiles[phase], getattr(super(), method)
        profile.enable()
        try:
            return call(*args)
        finally:
            profile.disable()

    def open(self, tokens: object, namespace: Namespace = None) -> Sequence:
        return self._call("admission", "open", tokens, namespace)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        self._call("decode" if num_tokens == 1 else "admission", "allocate", seq, num_tokens)

    def commit(self, seq: Sequence, tokens: object) -> None:
        self._call("decode" if len(tokens) == 1 else "admission", "commit", seq, tokens)

    def close(self, seq: Sequence) -> None:
        self._call("close", "close", seq)


def profile_replay(conversations: list[Conversation], config: SchedulerConfig, top: int = 8) -> str:
    """cProfile of one replay, per phase: the cache's functions by own time. Profiling slows every
    call several-fold; the shares, not the absolute times, are the point."""
    cache = ProfiledCache(config.num_pages, config.page_size, record_events=False)
    replay(conversations, config, cache=cache)
    sections = []
    for phase, profile in cache.profiles.items():
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(
            r"prefix_cache|\{(?!method 'disable')", top
        )
        lines = out.getvalue().splitlines()
        total = next(line.strip() for line in lines if "function calls" in line)
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        body = [line.replace(str(Path.cwd()) + "/", "") for line in lines[start:] if line.strip()]
        sections.append("\n".join([f"-- {phase}: {total}", *body]))
    return "\n".join(sections)


def machine() -> dict[str, str]:
    """Date, CPU and versions, for the results file."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    return {
        "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
        "cpu": f"{cpu}, nproc {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()}",
        "load average (1, 5, 15 min) at start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "code (git describe --dirty)": subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip(),
        "versions": f"Python {platform.python_version()}, numpy {np.__version__}, xxhash {xxhash.VERSION}",
    }


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def batch_decode_us(
    page_size: int, batch: int = 64, steps: int = 400, repeats: int = 5
) -> tuple[float, float]:
    """µs per running request per decode step for ``batch`` sequences (300-token prompts), best of
    ``repeats``: (per-sequence ``allocate(seq, 1)`` + ``commit(seq, [token])``, ``allocate_batch`` +
    ``commit_batch`` + ``write_block_tables`` into a preallocated buffer)."""
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for batched in (False, True):
            num_pages = batch * (steps + 400) // page_size + 4 * batch
            cache = PrefixCache(num_pages, page_size, record_events=False)
            seqs = []
            for i in range(batch):
                prompt = np.arange(i * 1000, i * 1000 + 300, dtype=np.int32)
                seq = cache.admit(prompt)
                cache.commit(seq, prompt)
                seqs.append(seq)
            tables = np.zeros((batch, (300 + steps) // page_size + 2), dtype=np.int32)
            tokens = np.arange(batch, dtype=np.int32)
            allocate, commit = cache.allocate, cache.commit
            gc.collect()
            t0 = time.perf_counter_ns()
            if batched:
                for _ in range(steps):
                    cache.allocate_batch(seqs, 1)
                    cache.write_block_tables(seqs, tables)
                    cache.commit_batch(seqs, tokens)
            else:
                for step in range(steps):
                    for seq in seqs:
                        allocate(seq, 1)
                        commit(seq, [step])
            best[batched] = min(best[batched], (time.perf_counter_ns() - t0) / 1e3 / (steps * batch))
    return best[0], best[1]


PEERS = ("prefix_cache", "sglang", "vllm", "prefix_cache1", "sglang1")


def host_tier_rows(
    conversations: list[Conversation], config: SchedulerConfig, host_pool: float, repeats: int, label: str
) -> list[tuple[str, ...]]:
    """The same replay with a host tier of ``host_pool`` GPU pools (write-back, then write-through),
    without one, and without one on a GPU pool of both tiers' pages (the same capacity, so about the
    same hits: what the tier's own bookkeeping costs against holding those pages on the GPU),
    alternating so all arms see the same machine load: µs per call of each phase, each tier over
    each other arm, the hit rates and the pages each tier saved."""
    host_pages = max(1, round(host_pool * config.num_pages))
    tiered = dataclasses.replace(config, host_pages=host_pages)
    configs = {
        "none": config,
        f"a GPU pool of {config.num_pages + host_pages} pages": dataclasses.replace(
            config, num_pages=config.num_pages + host_pages
        ),
        "host tier": tiered,
        "write-through tier": dataclasses.replace(tiered, host_write_through=True),
    }
    arms: dict[str, list[ReplayResult]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, arm_config in configs.items():
            arms[name] += [r for r, _ in run_replays(conversations, arm_config, 1)]
    rows = []
    for tier in ("host tier", "write-through tier"):
        on = arms[tier]
        for other in list(configs)[:2]:
            for name, metric, digits in (
                ("admission, µs/request", "admit_us", 1),
                ("decode, µs/request/step", "decode_us", 2),
                ("close, µs/request", "close_us", 1),
            ):
                best_on = min(getattr(r, metric) for r in on)
                best_other = min(getattr(r, metric) for r in arms[other])
                median = statistics.median(getattr(r, metric) for r in on)
                median /= statistics.median(getattr(r, metric) for r in arms[other])
                rows.append(
                    (
                        label + f"{tier} {host_pool:g}x vs {other}: {name}",
                        f"{best_on:.{digits}f} / {best_other:.{digits}f}",
                        f"{median:.2f}x",
                        f"best {best_on / best_other:.2f}x (target ≤ 1.10x)",
                    )
                )
            rows.append(
                (
                    label + f"{tier} {host_pool:g}x vs {other}: hit rate",
                    f"{on[0].hit_rate:.2%} / {arms[other][0].hit_rate:.2%}",
                    "",
                    f"{host_pages} host pages, {on[0].saved_pages:,} pages saved",
                )
            )
    return rows


def run_peers(harness: Path, python: str, num_pages: str, repeats: int) -> dict[str, dict]:
    """``repeats`` rounds of one ``replay.py`` run per peer of the harness in ``harness``
    (a harness that imports the peers' cache modules from their wheels, set up by its
    ``setup.sh``), ours from this checkout; the peers take turns within a round, so a slow spell
    of the shared machine falls on all of them. Returns peer -> the JSON line of its run with the
    least total time in cache calls (``s_peer_total``; the least disturbed one) with
    ``s_peer_totals``, every run's total, added; or {"skipped": why}."""
    results: dict[str, dict] = {}
    totals: dict[str, list[float]] = {peer: [] for peer in PEERS}
    env = {**os.environ, "PREFIX_CACHE_SRC": str(Path(__file__).resolve().parent.parent)}
    for _ in range(repeats):
        for peer in PEERS:
            if "skipped" in results.get(peer, {}):
                continue
            command = [python, "replay.py", "--peer", peer, "--trace", "sharegpt", "--num-pages", num_pages]
            try:
                run = subprocess.run(
                    command, cwd=harness, env=env, capture_output=True, text=True, timeout=900
                )
            except (OSError, subprocess.TimeoutExpired) as error:
                results[peer] = {"skipped": f"{type(error).__name__}: {error}"}
                continue
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            if run.returncode != 0 or not lines:
                tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
                results[peer] = {"skipped": f"exit {run.returncode}: {tail}"}
                continue
            result = json.loads(lines[-1])
            if "skipped" in result:
                print(f"peer {peer} skipped: {result['skipped']}")
                results[peer] = result
                continue
            totals[peer].append(result["s_peer_total"])
            if peer not in results or result["s_peer_total"] < results[peer]["s_peer_total"]:
                results[peer] = result
    for peer, run in results.items():
        if "skipped" not in run:
            run["s_peer_totals"] = totals[peer]
    return results


def peer_rows(results: dict[str, dict], label: str) -> list[tuple[str, ...]]:
    """Markdown rows: per peer the harness's figures, and ours / theirs at the same page size."""
    figures = ("us_admit_per_req", "us_decode_per_step_req", "us_finish_per_req", "s_peer_total")
    rows = []
    for peer in PEERS:
        run = results.get(peer, {})
        if "skipped" in run or not run:
            rows.append((label, peer, f"skipped: {run.get('skipped', 'not run')}", "", "", "", "", "", ""))
            continue
        ours = results.get("prefix_cache1" if peer.endswith("1") else "prefix_cache", {})
        ratios = []
        for key in figures:
            if peer.startswith("prefix_cache") or "skipped" in ours or not ours:
                ratios.append("")
            elif not run.get(key):
                ratios.append("n/a (theirs 0)")
            else:
                ratios.append(f"{ours.get(key, float('nan')) / run[key]:.2f}")
        rows.append(
            (
                label,
                peer,
                f"{run.get('hit_rate', 0):.4f}",
                *(f"{run.get(key, 0):.2f}" for key in figures[:3]),
                f"{run['s_peer_total']:.3f}",
                " / ".join(f"{t:.2f}" for t in run["s_peer_totals"]),
                " / ".join(ratios) if any(ratios) else "",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conversations", type=positive_int, default=1000, help="ShareGPT conversations (default 1000)"
    )
    parser.add_argument(
        "--num-pages",
        type=positive_int,
        default=16384,
        help="pages of 16 tokens in the pool (default 16384); other page sizes get the same tokens",
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="replays timed, >= 1 (default 5)")
    parser.add_argument(
        "--page-sizes", default="16,1", help="page sizes replayed, comma-separated (default 16,1)"
    )
    parser.add_argument(
        "--peers",
        type=Path,
        default=None,
        help="the peers' replay harness (a directory with replay.py and setup.sh): "
        "runs SGLang's RadixCache and vLLM's KVCacheManager side by side; skipped when absent",
    )
    parser.add_argument(
        "--peer-repeats",
        type=positive_int,
        default=3,
        help="rounds of peer runs per pool size, the best (least total time) reported (default 3)",
    )
    parser.add_argument(
        "--peers-python", default="/tmp/peers/venv/bin/python", help="the interpreter of the peers' setup.sh"
    )
    parser.add_argument(
        "--host-pool",
        type=float,
        default=0.0,
        help="also replay with a host tier of this many GPU pools, 0..64 (default 0: not run), "
        "side by side with the tier off, and report the cost of its bookkeeping",
    )
    parser.add_argument("--profile", action="store_true", help="add a cProfile of one replay")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = parser.parse_args(argv)
    try:
        page_sizes = [int(x) for x in args.page_sizes.split(",")]
        if not page_sizes or not all(1 <= x <= 16 and 16 % x == 0 for x in page_sizes):
            raise ValueError
    except ValueError:
        parser.error(f"argument --page-sizes: must be divisors of 16, got {args.page_sizes!r}")
    if not 0 <= args.host_pool <= 64:
        parser.error(f"argument --host-pool: must be in 0..64, got {args.host_pool}")
    info = machine()

    workload = sharegpt_workload(args.conversations)
    conversations = workload.conversations
    ample_tokens = sum(
        len(c.prefix) + sum(len(t.user) + len(t.replies[0]) for t in c.turns) for c in conversations
    )

    def timing(name: str, values: list[float], target: str = "", digits: int = 1) -> tuple[str, ...]:
        return (name, f"{min(values):.{digits}f}", f"{statistics.median(values):.{digits}f}", target)

    rows = []
    res = None
    for page_size in page_sizes:
        num_pages = args.num_pages * 16 // page_size
        config = SchedulerConfig(num_pages=num_pages, page_size=page_size, max_running=64)
        runs = [r for r, _ in run_replays(conversations, config, args.repeats)]
        peeks = [match for _, match in run_replays(conversations, config, args.repeats, peek=True)]
        res = runs[0] if res is None else res
        ample_config = SchedulerConfig(
            num_pages=ample_tokens // page_size + 64 * 16 // page_size, page_size=page_size, max_running=64
        )
        ample = replay(conversations, ample_config)[1]
        targets = TARGETS.get(page_size, {})
        tokens_per_s, ns_per_page = hash_throughput(conversations, page_size)
        per_seq, batched = batch_decode_us(page_size)

        def us(metric: str, runs: list[ReplayResult] = runs) -> list[float]:
            return [getattr(r, metric) for r in runs]

        def target(name: str, targets: dict[str, float] = targets) -> str:
            return f"≤ {targets[name]:g}" if name in targets else ""

        p = f"page {page_size}: "
        rows += [
            timing(
                p + "admission: open + allocate + commit, µs/request", us("admit_us"), target("admission")
            ),
            timing(p + "  of which open, µs/request", us("open_us")),
            timing(p + "  of which allocate + commit of the uncached prompt, µs/request", us("prefill_us")),
            timing(p + "match, if a scheduler calls it before open, µs/request", peeks),
            timing(
                p + "decode: allocate(1) + commit([token]), µs/request/step",
                us("decode_us"),
                target("decode"),
                2,
            ),
            (
                p + "decode, 64 sequences: per-sequence calls / batch calls, µs/request/step",
                f"{per_seq:.2f} / {batched:.2f}",
                "",
                "allocate_batch + write_block_tables + commit_batch",
            ),
            timing(p + "close, µs/request", us("close_us"), target("close")),
            (
                p + f"block hashing (chained xxh3-64, {page_size}-token pages), tokens/s",
                f"{tokens_per_s / 1e6:.1f} M",
                "",
                f"{ns_per_page:.0f} ns/page",
            ),
            (
                p + "host memory per cached page (tracemalloc), bytes",
                f"{memory_per_page(page_size):.0f}",
                "",
                "",
            ),
            (
                p + f"hit rate, {num_pages} pages (best possible)",
                f"{runs[0].hit_rate:.2%}",
                "",
                f"({runs[0].best_hit_rate:.2%})",
            ),
            (
                p + f"hit rate, {ample_config.num_pages} pages (best possible)",
                f"{ample.hit_rate:.2%}",
                "",
                f"({ample.best_hit_rate:.2%})",
            ),
        ]
        if args.host_pool:
            rows += host_tier_rows(conversations, config, args.host_pool, args.repeats, p)
    header = ("metric", f"best of {args.repeats}", "median", "target / note")
    width = max(len(r[0]) for r in rows)
    table = "\n".join(f"{r[0]:<{width}}  {r[1]:>10}  {r[2]:>8}  {r[3]}" for r in [header, *rows])
    workload_line = (
        f"{len(conversations)} ShareGPT conversations, {res.requests} requests, {res.prompt_tokens:,} prompt "
        f"tokens, {res.decode_tokens:,} decode steps x running requests; {args.num_pages} pages x 16 tokens "
        f"(the same tokens at other page sizes), 64 running, 128 clients; tokenization "
        f"{workload.load_seconds:.1f} s"
    )
    print(workload_line)
    print(table)
    peers_md: list[str] = []
    if args.peers is None or not (args.peers / "replay.py").is_file():
        print(f"peers: skipped (no replay harness at {args.peers}; see --peers)")
        peers_md = ["Peers: not run (no `--peers` harness given or found)."]
    elif not Path(args.peers_python).is_file():
        print(f"peers: skipped (no interpreter {args.peers_python}: run the harness's setup.sh)")
        peers_md = [f"Peers: not run (no interpreter `{args.peers_python}`)."]
    else:
        peer_header = ("pages", "peer", "hit rate", "admission µs/req", "decode µs/step/req", "finish µs/req")
        peer_header += ("total s in cache calls", "totals of all rounds, s")
        peer_header += ("ours / theirs (admission / decode / finish / total)",)
        peer_table = []
        for pages in ("ample", "0.25"):
            results = run_peers(args.peers, args.peers_python, pages, args.peer_repeats)
            peer_table += peer_rows(results, pages)
        for row in [peer_header, *peer_table]:
            print("  ".join(row))
        peers_md = [
            f"Peers, side by side in this run: the harness `{args.peers}/replay.py --trace sharegpt` (its "
            "own ShareGPT trace, scheduler and timers, identical for every peer; `prefix_cache` is this "
            "checkout at page 16, `prefix_cache1` at page 1 with 16x the pages; `sglang` is SGLang's "
            "`RadixCache` at page 16, `sglang1` at page 1; `vllm` is vLLM's `KVCacheManager`). Pages: "
            "`ample` never evicts, `0.25` is a quarter of the working set. Each peer ran "
            f"{args.peer_repeats} times per pool size, the peers taking turns within each round; the "
            "figures are those of its run with the least total time in cache calls (all totals "
            "listed). Ratios compare ours at the same page size.",
            "",
            f"| {' | '.join(peer_header)} |",
            "|---|---|---|---:|---:|---:|---:|---|---|",
            *(f"| {' | '.join(r)} |" for r in peer_table),
        ]
    profile = profile_replay(conversations, config) if args.profile else ""
    if profile:
        print(profile)

    info["load average at end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    md = [
        "# PrefixCache on a ShareGPT chat replay",
        "",
        *(f"- {key}: {value}" for key, value in info.items()),
        f"- command: `{command}`",
        f"- workload: {workload_line}",
        "",
        "Times are wall-clock µs inside the cache calls (`time.perf_counter_ns` around them), per replay "
        f"averaged over its requests; best and median of {args.repeats} replays (the machine is shared, "
        "so the best replay is the least disturbed one). Decode commits each token as `[int]`, the engine "
        "contract and `commit`'s fastest per-token path; the timed loop adds about 0.1 µs. Host "
        "memory: tracemalloc growth while 100,000 distinct pages are cached (32-page prompts), divided "
        "by the pages cached.",
        "",
        f"| {' | '.join(header)} |",
        "|---|---:|---:|---|",
        *(f"| {' | '.join(r).strip()} |" for r in rows),
        "",
        *peers_md,
    ]
    if profile:
        md += [
            "",
            "cProfile of one replay, per phase (own time of the cache's functions):",
            "",
            "```",
            profile,
            "```",
        ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(md) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

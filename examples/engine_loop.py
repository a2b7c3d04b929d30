"""A serving-engine step loop on prefix-cache: cache, KV pool, cascade planner and attention backend.

A one-layer toy model with random weights (9 query heads over 3 KV heads, as in SmolLM2) serves
conversations that share a system prompt, each sampled several times in parallel. Every step:

    admit -> write the new tokens' K/V into their pages -> plan the batch -> attention -> commit

The first sample of a prompt prefills it; the others are admitted once it is committed, and find it
cached. When the pool runs short, admission waits and a decode that needs a page preempts the youngest
running request (closed, requeued, recomputed later from its cached prefix). Sampling draws each
request's tokens from its own random stream, so the outputs do not depend on batching or preemption.
With ``--check`` every step's output is compared with float64 attention computed from the block
tables, request by request, without the plan.

    python examples/engine_loop.py                              # CPU, torch backend
    python examples/engine_loop.py --backend triton --device cuda --check
    python examples/engine_loop.py --num-pages 40 --check       # a small pool: requests are preempted
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch

from prefix_cache import CascadePlanner, OutOfPages, PrefixCache, Sequence
from prefix_cache.attention import create_backend

VOCAB, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 1000, 9, 3, 64
#: Sampling temperature: the toy model's logits are small (std ~0.1), so sharpen them until the
#: context, not the noise, decides the next token.
TEMPERATURE = 0.05
#: --check: largest |backend - float64 reference| allowed, relative to the reference's largest |value|.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass(eq=False)  # identity: a request is never equal to another
class Request:
    number: int  # seeds its sampling stream
    prompt: np.ndarray  # int32 token ids
    max_new_tokens: int
    output: list[int] = field(default_factory=list)  # sampled tokens; the last has no KV yet
    seq: Sequence | None = None
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # tokens to feed this step

    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int32)])


@dataclass
class Report:
    steps: int = 0
    shared_levels: int = 0
    preemptions: int = 0
    admissions_deferred: int = 0  # steps where the head of the queue waited for pages
    max_error: float = 0.0  # --check: relative, worst step
    outputs: list[list[int]] = field(default_factory=list)  # per request, in arrival order


class ToyModel:
    """Embedding, q/k/v projections, one attention, an output projection: just enough to make real
    K/V and queries from token ids and to sample the next token from the attention output."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = NUM_QO_HEADS * HEAD_DIM

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(device, dtype)

        self.embed = weight(VOCAB, width) * width**0.5
        self.wq, self.wk, self.wv = (
            weight(width, width),
            weight(width, NUM_KV_HEADS * HEAD_DIM),
            weight(width, NUM_KV_HEADS * HEAD_DIM),
        )
        self.wo = weight(width, VOCAB)

    def qkv(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed[tokens]
        return (
            (x @ self.wq).view(-1, NUM_QO_HEADS, HEAD_DIM),
            (x @ self.wk).view(-1, NUM_KV_HEADS, HEAD_DIM),
            (x @ self.wv).view(-1, NUM_KV_HEADS, HEAD_DIM),
        )

    def logits(self, attn_out: torch.Tensor) -> torch.Tensor:
        return attn_out.flatten(1) @ self.wo


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: list[np.ndarray],
    kv_lens: list[int],
    qo_lens: list[int],
) -> torch.Tensor:
    """Float64 attention of each request over the pages its block table names, without any plan.

    q: [sum(qo_lens), Hq, D], requests in order; kv_cache: [pages, 2, page_size, Hkv, D]. Request i's
    queries are its last qo_lens[i] KV tokens; query j sees KV positions 0 .. kv_lens[i] - qo_lens[i] + j.
    Returns float64 [sum(qo_lens), Hq, D].
    """
    page_size, group = kv_cache.shape[2], NUM_QO_HEADS // NUM_KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for table, kv_len, qo_len in zip(block_tables, kv_lens, qo_lens, strict=True):
        pages = torch.from_numpy(table[: -(-kv_len // page_size)].astype(np.int64)).to(q.device)
        kv = kv_cache[pages].double().transpose(0, 1).flatten(1, 2)[:, :kv_len]  # [2, kv_len, Hkv, D]
        k, v = kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + qo_len].double(), k) * HEAD_DIM**-0.5
        last_visible = kv_len - qo_len + torch.arange(qo_len, device=q.device)
        hidden = torch.arange(kv_len, device=q.device)[None, :] > last_visible[:, None]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[start : start + qo_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += qo_len
    return out


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (no upper bound when high is None)."""
    allowed = f"at least {low}" if high is None else f"in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available on this machine")
    return device


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "flashinfer"])
    ap.add_argument("--device", type=_device, default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--conversations", type=_int_in(1), default=4)
    ap.add_argument("--samples", type=_int_in(1), default=4, help="parallel samples per prompt")
    ap.add_argument("--system-tokens", type=_int_in(0), default=300)
    ap.add_argument("--new-tokens", type=_int_in(1), default=24)
    ap.add_argument("--max-running", type=_int_in(1), default=16)
    ap.add_argument("--num-pages", type=_int_in(1), default=512)
    ap.add_argument("--page-size", type=_int_in(1, 128), default=16, help="1..128, as the kernels support")
    ap.add_argument("--check", action="store_true", help="compare every step with float64 attention")
    ap.add_argument("--seed", type=_int_in(0), default=0)
    return ap


def serve(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> Report:
    """Serve every request to its last token; ``fail(message)`` reports a bad option."""
    device, dtype, page_size = args.device, getattr(torch, args.dtype), args.page_size
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, VOCAB, args.system_tokens, dtype=np.int32)
    requests: list[Request] = []
    for _ in range(args.conversations):
        prompt = np.concatenate([system, rng.integers(0, VOCAB, int(rng.integers(20, 80)), dtype=np.int32)])
        requests.extend(Request(len(requests), prompt, args.new_tokens) for _ in range(args.samples))
    # A request alone must fit, or nothing can guarantee it ever runs: KV of its prompt and of every
    # sampled token but the last.
    needed = max(-(-(len(r.prompt) + r.max_new_tokens - 1) // page_size) for r in requests)
    if args.num_pages < needed:
        fail(f"argument --num-pages: must be at least {needed} for these prompts, got {args.num_pages}")
    try:
        backend = create_backend(args.backend, device=device)
    except ImportError as error:
        fail(f"argument --backend: {error}")

    model = ToyModel(device, dtype, args.seed)
    cache = PrefixCache(num_pages=args.num_pages, page_size=page_size)
    kv_cache = torch.zeros(args.num_pages, 2, page_size, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    # Toy-sized thresholds so that this small batch gets shared levels; real engines keep the defaults.
    planner = CascadePlanner(min_shared_tokens=page_size, min_saved_tokens=2 * page_size)
    report = Report()

    waiting: deque[Request] = deque(requests)
    running: list[Request] = []  # in admission order: the last is the youngest
    prefilling: set[bytes] = set()  # prompts being prefilled: their twins wait to find them cached

    def preempt(req: Request) -> None:
        """Give its pages back and requeue it first; its committed full pages stay cached."""
        cache.close(req.seq)
        req.seq = None
        running.remove(req)
        waiting.appendleft(req)
        report.preemptions += 1

    while waiting or running:
        for req in list(waiting):
            if len(running) >= args.max_running:
                break
            key = req.prompt.tobytes()
            if key in prefilling:
                continue
            tokens = req.tokens()
            seq = cache.open(tokens)
            try:  # pages for the tokens not cached: their KV is computed this step
                cache.allocate(seq, len(tokens) - seq.num_cached_tokens)
            except OutOfPages:  # wait: finishing or preempted requests free pages
                cache.close(seq)
                report.admissions_deferred += 1
                break
            req.seq, req.pending = seq, tokens[seq.num_cached_tokens :]
            prefilling.add(key)
            waiting.remove(req)
            running.append(req)
        if not running:  # cannot happen: the head fits an idle pool (checked above)
            raise RuntimeError("no request could be admitted into an idle pool")

        # K/V of every new token into its page: slot = page id * page_size + offset.
        tokens = torch.from_numpy(np.concatenate([r.pending for r in running])).to(device)
        page_ids, offsets = [], []
        for r in running:
            positions = r.seq.num_tokens + np.arange(len(r.pending))
            page_ids.append(r.seq.block_table[positions // page_size].astype(np.int64))
            offsets.append(positions % page_size)
        page_ids = torch.from_numpy(np.concatenate(page_ids)).to(device)
        offsets = torch.from_numpy(np.concatenate(offsets)).to(device)
        q, k, v = model.qkv(tokens)
        kv_cache[page_ids, 0, offsets] = k
        kv_cache[page_ids, 1, offsets] = v

        qo_lens = [len(r.pending) for r in running]
        kv_lens = [r.seq.num_tokens + n for r, n in zip(running, qo_lens, strict=True)]
        block_tables = [r.seq.block_table for r in running]
        plan = planner.plan(block_tables, kv_lens, qo_lens, page_size)
        backend.plan(plan, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
        out = backend.run(q, kv_cache)
        if args.check:
            expected = reference_attention(q, kv_cache, block_tables, kv_lens, qo_lens)
            error = ((out.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
            report.max_error = float(np.maximum(report.max_error, error))  # a NaN stays NaN: never passes
        report.steps += 1
        report.shared_levels += len(plan.levels) - 1

        logits = model.logits(out[torch.from_numpy(np.cumsum(qo_lens) - 1).to(device)]).double().cpu().numpy()
        for req, row in zip(list(running), logits, strict=True):
            cache.commit(req.seq, req.pending)  # their KV is written: full pages become matchable
            prefilling.discard(req.prompt.tobytes())
            # Gumbel-max sampling from the request's own stream: token n of request r is the same in
            # any batch.
            noise = np.random.default_rng([args.seed, req.number, len(req.output)]).gumbel(size=VOCAB)
            req.output.append(int(np.argmax(row / TEMPERATURE + noise)))
            if len(req.output) == req.max_new_tokens:
                cache.close(req.seq)
                running.remove(req)
        for req in list(running):  # oldest first: a page for the token it feeds next step
            while req in running:
                try:
                    cache.allocate(req.seq, 1)
                    req.pending = np.array(req.output[-1:], dtype=np.int32)
                    break
                except OutOfPages:
                    preempt(running[-1])  # the youngest, maybe req itself

    cache.check_invariants()
    report.outputs = [r.output for r in requests]
    stats = cache.stats
    print(
        f"{report.steps} steps, {report.shared_levels / report.steps:.2f} shared levels per step on average"
    )
    print(f"prompt tokens {stats.query_tokens}, served from cache {stats.hit_tokens} ({stats.hit_rate:.1%})")
    print(f"pages: {cache.num_free_pages} free, {cache.num_evictable_pages} cached, of {args.num_pages}")
    print(f"{report.preemptions} preemptions, {report.admissions_deferred} admissions deferred for pages")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    report = serve(args, ap.error)
    if args.check:
        tolerance = TOLERANCE[getattr(torch, args.dtype)]
        print(f"max |{args.backend} - float64| / max |float64| over all steps: {report.max_error:.2e}")
        if not report.max_error <= tolerance:
            print(f"check failed: above the {args.dtype} tolerance {tolerance:.0e}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

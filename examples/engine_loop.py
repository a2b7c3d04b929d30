"""A serving-engine step loop on prefix-cache: cache, KV pool, cascade planner and attention backend.

A one-layer toy model with random weights (9 query heads over 3 KV heads, as in SmolLM2) serves
conversations that share a system prompt, each sampled several times in parallel. Every step:

    allocate pages -> write the new tokens' K/V into them -> plan the batch -> attention -> commit

The first sample of a prompt prefills it; the others are admitted once it is committed, and find it
cached. With ``--check`` every step's output is compared with the torch reference backend.

    python examples/engine_loop.py                              # CPU, torch backend
    python examples/engine_loop.py --backend triton --device cuda --check
"""

from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from prefix_cache import CascadePlanner, PrefixCache, Sequence
from prefix_cache.attention import create_backend

VOCAB, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 1000, 9, 3, 64


@dataclass(eq=False)  # identity: a request is never equal to another
class Request:
    prompt: np.ndarray  # int32 token ids
    max_new_tokens: int
    seq: Sequence | None = None
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # tokens to feed this step
    generated: int = 0


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "flashinfer"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="parallel samples per prompt")
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--check", action="store_true", help="compare every step with the torch backend")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device, dtype, page_size = torch.device(args.device), getattr(torch, args.dtype), args.page_size
    rng = np.random.default_rng(args.seed)
    model = ToyModel(device, dtype, args.seed)
    cache = PrefixCache(num_pages=args.num_pages, page_size=page_size)
    kv_cache = torch.zeros(args.num_pages, 2, page_size, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    # Toy-sized thresholds so that this small batch gets shared levels; real engines keep the defaults.
    planner = CascadePlanner(min_shared_tokens=page_size, min_saved_tokens=2 * page_size)
    backend = create_backend(args.backend, device=device)
    reference = create_backend("torch", device=device) if args.check else None
    sampler = torch.Generator(device=device).manual_seed(args.seed)

    system = rng.integers(0, VOCAB, args.system_tokens, dtype=np.int32)
    waiting: deque[Request] = deque()
    for _ in range(args.conversations):
        question = rng.integers(0, VOCAB, int(rng.integers(20, 80)), dtype=np.int32)
        prompt = np.concatenate([system, question])
        waiting.extend(Request(prompt, args.new_tokens) for _ in range(args.samples))

    running: list[Request] = []
    prefilling: set[bytes] = set()  # prompts being prefilled: their twins wait to find them cached
    steps = shared_levels = 0
    max_error = 0.0
    while waiting or running:
        for req in list(waiting):
            key = req.prompt.tobytes()
            if len(running) >= args.max_running or key in prefilling:
                continue
            req.seq = cache.open(req.prompt)
            req.pending = req.prompt[req.seq.num_cached_tokens :]
            cache.allocate(req.seq, len(req.pending))  # pages for the prompt's uncached tokens
            prefilling.add(key)
            waiting.remove(req)
            running.append(req)

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
        plan = planner.plan([r.seq.block_table for r in running], kv_lens, qo_lens, page_size)
        backend.plan(plan, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
        out = backend.run(q, kv_cache)
        if reference is not None:
            reference.plan(plan, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
            max_error = max(max_error, (out.float() - reference.run(q, kv_cache).float()).abs().max().item())
        steps += 1
        shared_levels += len(plan.levels) - 1

        last = torch.from_numpy(np.cumsum(qo_lens) - 1).to(device)
        probs = torch.softmax(model.logits(out[last]).float(), dim=-1)
        next_tokens = torch.multinomial(probs, 1, generator=sampler).view(-1).int().cpu().numpy()
        for req, token in zip(list(running), next_tokens, strict=True):
            cache.commit(req.seq, req.pending)  # their KV is written: full pages become matchable
            prefilling.discard(req.prompt.tobytes())
            req.generated += 1
            if req.generated == req.max_new_tokens:
                cache.close(req.seq)
                running.remove(req)
            else:
                cache.allocate(req.seq, 1)
                req.pending = np.array([token], dtype=np.int32)

    stats = cache.stats
    print(f"{steps} steps, {shared_levels / steps:.2f} shared levels per step on average")
    print(f"prompt tokens {stats.query_tokens}, served from cache {stats.hit_tokens} ({stats.hit_rate:.1%})")
    print(f"pages: {cache.num_free_pages} free, {cache.num_evictable_pages} cached, of {args.num_pages}")
    if reference is not None:
        print(f"max |{args.backend} - torch| over all steps: {max_error:.2e}")
    cache.check_invariants()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

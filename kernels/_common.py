"""Helpers shared by the kernel wrappers: interpreter detection, device facts, small integer maths."""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

LOG2E = 1.4426950408889634
"""log2(e): the kernels compute exp(x) as exp2(x * LOG2E)."""

# Triton's interpreter has no SM count; a plan made for the CPU assumes an H200-sized device.
_DEFAULT_NUM_SMS = 132


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a default for CPU tensors)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


def dependent_launches(device: torch.device) -> bool:
    """Whether kernels on ``device`` may launch with programmatic dependent launch (PDL, Hopper and
    later, a Triton with grid dependency control): a kernel launched so may start while the one
    before it in the stream finishes, and waits for its results in the kernel (``gdc_wait``)."""
    return (
        gdc_wait is not None
        and not interpreting()
        and device.type == "cuda"
        and torch.version.hip is None  # ROCm reports "cuda" devices too; PDL is NVIDIA's
        and _capability(device) >= 9
    )


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def check_runnable(*tensors: torch.Tensor) -> None:
    """Raise if the tensors cannot be handed to a Triton kernel: all on one device, and a CPU device
    only in interpreter mode."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors must be on one device, got {sorted(str(d) for d in devices)}")
    device = devices.pop()
    if device.type == "cpu" and not interpreting():
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)

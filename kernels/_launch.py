"""Launching compiled Triton kernels without Triton's per-call Python path.

``kernel[grid](*args, **constants)`` binds the arguments, derives their specialization, looks the
compiled kernel up and only then launches: for our ~30-argument attention kernel that Python path,
not the launch, is most of a launch's host time. A ``BoundKernel`` fixes the grid and the
compile-time constants once (per plan) and remembers, per specialization of the arguments, the
``CompiledKernel`` that Triton's own path returned for it: later calls with the same specialization
go straight to that kernel's launcher. The attention and merge launches pass their key in parts:
their plan's buffers, the same objects for every layer, are read once (``CachedSpecialization``),
the layer's tensors at every call.

The specialization key is conservative: every tensor's dtype and address modulo 16 and every other
argument's exact value (Triton specializes on a tensor's dtype and 16-byte alignment, and on an
integer being 1, a multiple of 16 or 64-bit), plus the current device. Equal keys therefore mean
the same compiled kernel; a new stride, dtype or alignment takes Triton's path once more.

Triton's path is kept for the interpreter (``TRITON_INTERPRET=1``), for launch hooks (profilers see
every launch through it), for Triton versions whose compiled kernels take another argument list, and
when ``PREFIX_CACHE_TRITON_LAUNCH=jit`` is set (to compare the two).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from triton.runtime import driver

try:
    from triton import knobs
except ImportError:  # Triton before 3.4: always its own path
    knobs = None

from prefix_cache.kernels._common import interpreting

# Compiled kernels by (kernel, constants, device, specialization), shared by every BoundKernel so a
# new plan's launches find the kernels of the previous ones. Cleared when it grows past the limit
# (a workload with ever-new strides), which costs one pass through Triton's path per key.
_COMPILED: dict[tuple, Any] = {}
_COMPILED_LIMIT = 4096


def direct_launch_enabled() -> bool:
    """Whether ``BoundKernel`` may call compiled kernels' launchers itself (see the module doc)."""
    return (
        knobs is not None
        and not interpreting()
        and os.environ.get("PREFIX_CACHE_TRITON_LAUNCH", "direct") != "jit"
    )


def _hooks_installed() -> bool:
    """True when Triton has launch hooks to call (a profiler): they need Triton's own path."""
    # Triton 3.6 keeps a hook or None; later versions a chain of hooks, empty by default.
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True))
    )


def specialization(args: tuple) -> tuple:
    """The key of ``args`` (see the module doc): (dtype, address % 16) per tensor, other values as
    they are."""
    return tuple([(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a for a in args])


class CachedSpecialization:
    """``specialization`` of arguments that stay the same objects from call to call (a plan's own
    buffers, passed again for every layer), recomputed only when another object comes: checking
    identity costs a fraction of reading every tensor's dtype and address. It holds the last
    objects, so an identical-looking new object is never mistaken for them. Callers must not move
    a cached tensor to other memory in place (``set_``, ``resize_``): its key would be stale."""

    def __init__(self) -> None:
        self._args: tuple = ()
        self._key: tuple = ()

    def __call__(self, *args: Any) -> tuple:
        last = self._args
        if len(args) != len(last) or any(a is not b for a, b in zip(args, last, strict=True)):
            self._args, self._key = args, specialization(args)
        return self._key


class BoundKernel:
    """A ``@triton.jit`` kernel with its grid and compile-time constants fixed.

    kernel: the JIT function; grid: 1 to 3 program counts; constants: its ``tl.constexpr``
    parameters (those after the positional arguments of a call) and launch options (``num_warps``,
    ``num_stages``). Calling it with the kernel's positional arguments launches on the current
    stream of the current device, exactly as ``kernel[grid](*args, **constants)`` would.
    """

    def __init__(self, kernel: Any, grid: tuple[int, ...], constants: dict[str, Any]) -> None:
        self.kernel, self.grid, self.constants = kernel, tuple(grid), constants
        self._grid3 = (*self.grid, 1, 1)[:3]
        self._direct = direct_launch_enabled()
        self._constant_key = tuple(sorted(constants.items()))
        self._tail: tuple | None = None  # constexpr values in parameter order, after the call's args
        self._launchers: dict[tuple, Any] = {}

    def __call__(self, *args: Any) -> None:
        self.launch(specialization(args) if self._direct else (), args)

    def launch(self, key: tuple, args: tuple) -> None:
        """Launch ``args`` (the kernel's positional arguments), ``key`` standing for their
        specialization: ``specialization(args)``, or any tuple that is equal for two calls only when
        theirs are (callers that know part of it ahead pass that part precomputed)."""
        if not self._direct:
            self.kernel[self.grid](*args, **self.constants)
            return
        device = torch.cuda.current_device()
        key = (device, *key)
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launchers[key] = self._launcher(key, args)
        if launcher is False or _hooks_installed():
            self.kernel[self.grid](*args, **self.constants)
            return
        run, function, metadata, tail, current_stream = launcher
        gx, gy, gz = self._grid3
        run(gx, gy, gz, current_stream(device), function, metadata, None, None, None, *args, *tail)

    def _launcher(self, key: tuple, args: tuple) -> Any:
        """(launcher, function, packed metadata, constexpr tail, current-stream getter) of the
        compiled kernel for ``key``, or False where this Triton's compiled kernels cannot be called
        directly. Compiles through Triton's path when the kernel is new (``warmup``: no launch)."""
        names = self.kernel.arg_names
        if any(name not in self.constants for name in names[len(args) :]):
            return False
        full_key = (self.kernel, self._constant_key, key)
        compiled = _COMPILED.get(full_key)
        if compiled is None:
            compiled = self.kernel.warmup(*args, grid=self.grid, **self.constants)
            if len(_COMPILED) >= _COMPILED_LIMIT:
                _COMPILED.clear()
            _COMPILED[full_key] = compiled
        if len(getattr(compiled.src, "signature", ())) != len(names):
            return False  # a Triton whose launchers take only the runtime arguments
        run = compiled.run  # loads the binary on the current device (sets ``function``)
        if compiled.function is None:
            return False
        tail = tuple(self.constants[name] for name in names[len(args) :])
        return run, compiled.function, compiled.packed_metadata, tail, driver.active.get_current_stream

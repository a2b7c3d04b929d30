"""``BoundKernel``: which calls reuse a compiled kernel's launcher and which go through Triton.

Triton's interpreter has no compiled kernels, so the direct path is driven here by a stand-in JIT
function that records what it is asked to compile and launch; the GPU test
``test_gpu_triton_backend_relaunches_for_each_layout`` runs the real one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from prefix_cache.kernels import _launch


class FakeCompiled:
    """A compiled kernel: its launcher records the calls."""

    def __init__(self, num_params: int) -> None:
        self.src = SimpleNamespace(signature={f"p{i}": "x" for i in range(num_params)})
        self.function, self.packed_metadata, self.launches = object(), object(), []

    def run(self, *call) -> None:
        self.launches.append(call)


class FakeJIT:
    """A ``@triton.jit`` function of two runtime parameters and one constexpr ``C``."""

    arg_names = ("x", "n", "C")

    def __init__(self, num_params: int = 3) -> None:
        self.num_params = num_params
        self.compiled: list[FakeCompiled] = []
        self.jit_launches: list[tuple] = []

    def warmup(self, *args, grid, **constants) -> FakeCompiled:
        self.compiled.append(FakeCompiled(self.num_params))
        return self.compiled[-1]

    def __getitem__(self, grid):
        return lambda *args, **constants: self.jit_launches.append((grid, args, constants))


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch):
    """The direct path switched on as on a GPU: device 0, stream 7, no launch hooks."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PREFIX_CACHE_TRITON_LAUNCH", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    active = SimpleNamespace(get_current_stream=lambda device: 7)
    monkeypatch.setattr(_launch, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "_COMPILED", {})


def test_same_specialization_reuses_the_launcher(direct) -> None:
    fn = FakeJIT()
    bound = _launch.BoundKernel(fn, (5,), {"C": 3, "num_warps": 4})
    x = torch.zeros(64, dtype=torch.float16)
    bound(x, 32)
    bound(x, 32)
    (compiled,) = fn.compiled
    assert fn.jit_launches == []
    assert len(compiled.launches) == 2
    # grid padded to 3-D, the stream, the kernel, no hooks, the arguments, then the constexpr.
    assert compiled.launches[0] == (5, 1, 1, 7, compiled.function, compiled.packed_metadata, None, None, None,
                                    x, 32, 3)  # fmt: skip
    # Another plan's launch with the same constants finds the kernel compiled for the first.
    _launch.BoundKernel(fn, (9,), {"C": 3, "num_warps": 4})(torch.ones(64, dtype=torch.float16), 32)
    assert len(fn.compiled) == 1 and compiled.launches[-1][0] == 9


def test_a_new_specialization_compiles_again(direct) -> None:
    fn = FakeJIT()
    bound = _launch.BoundKernel(fn, (5,), {"C": 3})
    storage = torch.zeros(64, dtype=torch.float16)
    bound(storage[:32], 32)
    bound(storage[1:33], 32)  # 2 bytes past a 16-byte boundary
    bound(storage[8:40], 32)  # 16 bytes past it: aligned again
    bound(storage[:32], 16)  # another integer
    bound(storage[:32].float(), 32)  # another dtype
    assert len(fn.compiled) == 4
    assert [len(c.launches) for c in fn.compiled] == [2, 1, 1, 1]
    _launch.BoundKernel(fn, (5,), {"C": 4})(storage[:32], 32)  # other constants
    assert len(fn.compiled) == 5


def test_triton_path_where_direct_launches_do_not_apply(direct, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(16)
    # A Triton whose compiled kernels take only the runtime arguments.
    fn = FakeJIT(num_params=2)
    _launch.BoundKernel(fn, (2,), {"C": 1})(x, 4)
    assert fn.compiled[0].launches == [] and fn.jit_launches == [((2,), (x, 4), {"C": 1})]
    # Launch hooks installed (a profiler).
    fn = FakeJIT()
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: True)
    _launch.BoundKernel(fn, (2,), {"C": 1})(x, 4)
    assert len(fn.jit_launches) == 1 and all(c.launches == [] for c in fn.compiled)
    # Switched off.
    monkeypatch.setenv("PREFIX_CACHE_TRITON_LAUNCH", "jit")
    fn = FakeJIT()
    _launch.BoundKernel(fn, (2,), {"C": 1})(x, 4)
    assert len(fn.jit_launches) == 1 and fn.compiled == []
    # The interpreter.
    monkeypatch.delenv("PREFIX_CACHE_TRITON_LAUNCH")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = FakeJIT()
    _launch.BoundKernel(fn, (2,), {"C": 1})(x, 4)
    assert len(fn.jit_launches) == 1 and fn.compiled == []

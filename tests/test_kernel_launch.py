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


def test_a_given_key_stands_for_the_specialization(direct) -> None:
    """``launch`` with a caller's key: equal keys reuse the launcher, another key compiles again."""
    fn = FakeJIT()
    bound = _launch.BoundKernel(fn, (5,), {"C": 3})
    x = torch.zeros(64, dtype=torch.float16)
    bound.launch(("plan", 32), (x, 32))
    bound.launch(("plan", 32), (x, 32))
    bound.launch(("other plan", 32), (x, 32))
    assert [len(c.launches) for c in fn.compiled] == [2, 1]


def test_cached_specialization_recomputes_only_for_other_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _launch.specialization
    monkeypatch.setattr(_launch, "specialization", lambda args: calls.append(args) or real(args))
    cached = _launch.CachedSpecialization()
    storage = torch.zeros(64, dtype=torch.float16)
    a, b = storage[:32], storage[8:40]
    first = cached(a, b)
    assert cached(a, b) is first and len(calls) == 1  # the same objects: not read again
    assert cached(storage[:32], b) == first and len(calls) == 2  # a new object: read, same key
    assert cached(storage[1:33], b) != first  # misaligned
    assert cached(a.float(), b) != first  # another dtype
    assert cached(a) != first  # fewer arguments


class RecordingKernel:
    """Stands in for a ``BoundKernel``: records each launch's key and arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, tuple]] = []

    def launch(self, key: tuple, args: tuple) -> None:
        self.calls.append((key, args))


def _keys_tell_every_argument(launch, args: list) -> None:
    """Changing any one argument's alignment (tensors) or value (numbers) gives another key, and
    going back to the first objects gives the first key again."""
    recorder = RecordingKernel()
    if hasattr(launch, "_kernels"):  # an attention launch: its kernels by offset width
        launch._kernels = (recorder,) * 3
    else:
        launch._kernel = recorder
    launch(*args)
    base_key = recorder.calls[-1][0]
    for i, arg in enumerate(args):
        changed = list(args)
        if isinstance(arg, torch.Tensor):
            changed[i] = torch.zeros(arg.numel() + 8, dtype=arg.dtype)[1 : 1 + arg.numel()].view(arg.shape)
        else:
            changed[i] = arg * 2
        launch(*changed)
        assert recorder.calls[-1][0] != base_key, f"argument {i} is not in the key"
        launch(*args)  # back to the plan's objects: the first key again
        assert recorder.calls[-1][0] == base_key


def test_attention_launch_keys_every_argument() -> None:
    from prefix_cache.kernels.attention import AttentionLaunch
    from prefix_cache.kernels.work import TileConfig

    launch = AttentionLaunch(num_programs=4, group_size=2, tile=TileConfig(16, 16, 1, 1), num_kv_heads=1,
                             page_size=4, head_dim=16, dtype=torch.float16)  # fmt: skip
    q, out = torch.zeros(3, 2, 16, dtype=torch.float16), torch.zeros(4, 2, 16)
    kv = torch.zeros(5, 4, 1, 16, dtype=torch.float16)
    ints = [torch.zeros(8, dtype=torch.int32) for _ in range(5)]
    args = [q, ints[0], kv, kv.clone(), ints[1], ints[2], ints[3], ints[4], out, torch.zeros(4, 2),
            torch.zeros(3, 2, 16, dtype=torch.float16), 0.125]  # fmt: skip
    _keys_tell_every_argument(launch, args)


def test_attention_launch_takes_64_bit_offsets_for_a_pool_past_2_31_elements() -> None:
    """The same launch runs its 32-bit-offset kernel on a small pool, its kernel with a 64-bit page
    term where the K or V view reaches 2**31 elements past its first, and the one with a 64-bit slot
    term too where the slot's term alone does (``offset_widths``), call by call. The pool views are
    meta tensors: shapes and strides, no memory."""
    from prefix_cache.kernels.attention import AttentionLaunch
    from prefix_cache.kernels.work import TileConfig

    launch = AttentionLaunch(num_programs=4, group_size=2, tile=TileConfig(16, 16, 1, 1), num_kv_heads=8,
                             page_size=16, head_dim=128, dtype=torch.float16)  # fmt: skip
    assert [kernel.constants["WIDE_OFFSETS"] for kernel in launch._kernels] == [0, 1, 2]
    narrow, page, both = kernels = RecordingKernel(), RecordingKernel(), RecordingKernel()
    launch._kernels = kernels
    q, out = torch.zeros(3, 16, 128, dtype=torch.float16), torch.zeros(4, 16, 128)
    ints = [torch.zeros(8, dtype=torch.int32) for _ in range(5)]

    def run(k: torch.Tensor, v: torch.Tensor) -> None:
        launch(q, ints[0], k, v, ints[1], ints[2], ints[3], ints[4], out, torch.zeros(4, 16),
               torch.zeros(3, 16, 128, dtype=torch.float16), 0.125)  # fmt: skip

    small = torch.empty(2**17, 16, 8, 128, dtype=torch.float16, device="meta")  # 2**31 elements
    large = torch.empty(2**17 + 1, 16, 8, 128, dtype=torch.float16, device="meta")
    # Slot-major: a slot stride of 2**28 elements, 15 x that past 2**31.
    slot_major = torch.empty(16, 2**18, 8, 128, dtype=torch.float16, device="meta").transpose(0, 1)
    expected = []
    for k, v, kernel in (
        (small, small, narrow),
        (small, large, page),
        (slot_major, small, both),
        (large, small, page),
        (large, slot_major, both),
        (small, small, narrow),
    ):
        run(k, v)
        expected.append(kernel)
        assert [len(each.calls) for each in kernels] == [expected.count(each) for each in kernels]


def test_merge_launch_keys_every_argument() -> None:
    from prefix_cache.kernels.merge_state import MergeLaunch

    launch = MergeLaunch(num_tokens=3, num_heads=2, head_dim=16, sms=132)
    starts, counts, out_rows = (torch.zeros(3, dtype=torch.int32) for _ in range(3))
    out = torch.zeros(3, 2, 16, dtype=torch.float16)
    args = [torch.zeros(6, 2, 16), torch.zeros(6, 2), starts, counts, out, out_rows]
    _keys_tell_every_argument(launch, args)

"""The host tier's mover on CPU tensors: bytes survive a save and a load in every layout and dtype,
random batches agree with a dict of page -> bytes, and bad input changes nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from offload_layouts import (
    DIM,
    DTYPES,
    HEADS,
    HOST,
    LAYERS,
    LAYOUTS,
    PAGE,
    PAGES,
    build,
    check_round_trip,
    host_page_bytes,
    make_pool,
    page_bytes,
    random_bits,
    snapshot,
)

from prefix_cache.attention.kv_layout import split_kv_cache
from prefix_cache.offload import HostKVPool, KVMover, PinningError


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bitwise_and_touches_only_its_pages(layout: str, dtype: torch.dtype) -> None:
    check_round_trip(layout, dtype, "cpu")


@st.composite
def strided_pools(draw) -> tuple[list, tuple[int, int, int, int, int]]:
    """Every layer's 5-D KV cache or K/V pair as views of one tensor ``[layers * halves, pages,
    (2,) page, heads, dim]`` laid out in any dim order (head_dim innermost) with gaps between rows:
    layers at a regular step, or in a shuffled order (not mergeable). No two elements share bytes.
    Returns (kv_caches, (layers, pages, page, heads, dim))."""
    layers, pages, page, heads = (draw(st.integers(1, 3)) for _ in range(4))
    dim = draw(st.sampled_from([1, 3, 4, 8]))
    halves = draw(st.sampled_from([1, 2]))  # 1: 5-D layers; 2: K and V tensors
    shape = [layers * halves, pages, *([2] if halves == 1 else []), page, heads, dim]
    order = draw(st.permutations(range(len(shape) - 1)))
    strides = [0] * len(shape)
    strides[-1] = 1
    extent = dim + draw(st.sampled_from([0, 0, 1]))
    for axis in reversed(order):
        strides[axis] = extent
        extent = extent * shape[axis] + draw(st.sampled_from([0, 0, 2]))
    bits = torch.randint(0, 2**15, (extent,), dtype=torch.int16)
    whole = bits.view(torch.float16).as_strided(shape, strides)
    views = list(whole)
    if draw(st.booleans()):
        views = draw(st.permutations(views))
    kv_caches = views if halves == 1 else [tuple(views[2 * i : 2 * i + 2]) for i in range(layers)]
    return kv_caches, (layers, pages, page, heads, dim)


@settings(max_examples=150, deadline=None)
@given(pool=strided_pools(), data=st.data())
def test_any_strided_pool_round_trips(pool, data) -> None:
    # Direct or gathered, a saved host page holds the GPU page's bytes in the documented order, and
    # a load writes exactly those bytes back into the page it names.
    kv_caches, (layers, pages, page, heads, dim) = pool
    mover = KVMover(kv_caches, HostKVPool(2, layers, page, heads, dim, torch.float16))
    before = [page_bytes(kv_caches, p) for p in range(pages)]
    src = data.draw(st.integers(0, pages - 1))
    dst = data.draw(st.integers(0, pages - 1))
    assert mover.save([src], [1]).ok
    assert host_page_bytes(mover.host_pool.pages, 1) == before[src]
    assert mover.load([1], [dst]).ok
    assert [page_bytes(kv_caches, p) for p in range(pages)] == [
        before[src] if p == dst else before[p] for p in range(pages)
    ]


def test_host_pages_are_page_first() -> None:
    kv_caches, pool, mover = build("hnd_pair", torch.float32)
    mover.save([7], [2])
    k, v = (half.view(torch.int32) for half in kv_caches[1])  # bits: random bytes hold NaNs
    host = pool.pages.view(torch.int32)
    assert torch.equal(host[2, 1, 0], k[7]) and torch.equal(host[2, 1, 1], v[7])
    assert pool.pages[2].is_contiguous() and pool.page_bytes == LAYERS * 2 * PAGE * HEADS * DIM * 4


class MoverMachine(RuleBasedStateMachine):
    """Random batches of saves, loads, forward writes and bad batches against a dict of page -> bytes."""

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        dtype=st.sampled_from([torch.bfloat16, torch.float32]),
        staging=st.integers(1, 4),
        seed=st.integers(0, 2**16),
    )
    def setup(self, layout: str, dtype: torch.dtype, staging: int, seed: int) -> None:
        self.kv_caches, self.pool, self.mover = build(layout, dtype, seed, staging_pages=staging)
        self.gen = torch.Generator().manual_seed(seed + 1)
        gpu, host = snapshot(self.kv_caches, self.pool)
        self.gpu = dict(enumerate(gpu))
        self.host = dict(enumerate(host))

    def batch(self, data, dest_limit: int, src_limit: int) -> tuple[list[int], list[int]]:
        dests = data.draw(st.lists(st.integers(0, dest_limit - 1), max_size=dest_limit, unique=True))
        srcs = data.draw(st.lists(st.integers(0, src_limit - 1), min_size=len(dests), max_size=len(dests)))
        return srcs, dests

    @rule(data=st.data())
    def save(self, data) -> None:
        gpu, host = self.batch(data, HOST, PAGES)
        assert self.mover.save(gpu, host).ok
        self.host.update({h: self.gpu[g] for g, h in zip(gpu, host, strict=True)})

    @rule(data=st.data())
    def load(self, data) -> None:
        host, gpu = self.batch(data, PAGES, HOST)
        assert self.mover.load(np.array(host, dtype=np.int32), gpu).ok
        self.gpu.update({g: self.host[h] for h, g in zip(host, gpu, strict=True)})

    @rule(page=st.integers(0, PAGES - 1))
    def forward_writes(self, page: int) -> None:
        for kv_cache in self.kv_caches:
            for half in split_kv_cache(kv_cache):
                half[page] = random_bits(tuple(half[page].shape), half.dtype, self.gen, "cpu")
        self.gpu[page] = page_bytes(self.kv_caches, page)

    @rule(
        kind=st.sampled_from(["save", "load"]),
        bad=st.sampled_from(["gpu_range", "host_range", "negative", "duplicate", "lengths", "float"]),
    )
    def bad_batch(self, kind: str, bad: str) -> None:
        gpu, host = [0, 1, 2], [3, 4, 5]
        if bad == "gpu_range":
            gpu = [0, PAGES, 2]
        elif bad == "host_range":
            host = [3, HOST, 5]
        elif bad == "negative":
            gpu = [0, -1, 2]
        elif bad == "duplicate":
            gpu, host = ([0, 1, 1], host) if kind == "load" else (gpu, [3, 3, 5])
        elif bad == "lengths":
            host = [3, 4]
        else:
            gpu = [0.0, 1.0, 2.0]
        with pytest.raises(ValueError):
            self.mover.save(gpu, host) if kind == "save" else self.mover.load(host, gpu)

    @invariant()
    def pools_match_the_model(self) -> None:
        gpu, host = snapshot(self.kv_caches, self.pool)
        assert gpu == [self.gpu[p] for p in range(PAGES)]
        assert host == [self.host[h] for h in range(HOST)]


TestMoverMachine = MoverMachine.TestCase
TestMoverMachine.settings = settings(
    max_examples=60, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.save([0, 12], [0, 1]), "gpu_pages holds page 12, outside the pool's pages 0..11"),
        (lambda m: m.save([0, 1], [0, 10]), "host_pages holds page 10, outside the pool's pages 0..9"),
        (lambda m: m.load([0, 1], [-3, 1]), "gpu_pages holds page -3"),
        (lambda m: m.save([0, 1], [4, 4]), "host_pages names page 4 twice in one batch"),
        (lambda m: m.load([4, 4], [0, 0]), "gpu_pages names page 0 twice in one batch"),
        (lambda m: m.save([0, 1, 2], [0, 1]), "gpu_pages has 3 pages, host_pages 2"),
        (lambda m: m.load([[0]], [1]), "host_pages must be a 1-D list"),
        (lambda m: m.save([0.5], [1]), "gpu_pages must be integer page ids"),
        (lambda m: m.save([True], [1]), "gpu_pages must be integer page ids"),
    ],
)
def test_bad_batches_name_the_problem_and_change_nothing(call, message: str) -> None:
    kv_caches, pool, mover = build("vllm", torch.bfloat16)
    before = snapshot(kv_caches, pool)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(mover)
    assert snapshot(kv_caches, pool) == before


def test_duplicate_sources_are_fine_and_empty_batches_do_nothing() -> None:
    kv_caches, pool, mover = build("nhd5", torch.float16)
    before = snapshot(kv_caches, pool)
    assert mover.save([], []).ok and mover.load(np.array([], dtype=np.int64), []).ok
    assert snapshot(kv_caches, pool) == before
    assert mover.save([3, 3], [0, 1]).ok
    assert host_page_bytes(pool.pages, 0) == host_page_bytes(pool.pages, 1) == before[0][3]


def layers(layout: str, dtype=torch.float32, pages=PAGES, page=PAGE, heads=HEADS, dim=DIM, n=LAYERS):
    gen = torch.Generator().manual_seed(0)
    return make_pool(layout, n, pages, page, heads, dim, dtype, gen)


@pytest.mark.parametrize(
    ("kv_caches", "pool", "message"),
    [
        ([], (HOST, LAYERS, PAGE, HEADS, DIM, torch.float32), "kv_caches must be a non-empty list"),
        (
            [*layers("pair", n=2), layers("pair", dtype=torch.float16, n=1)[0]],
            (HOST, LAYERS, PAGE, HEADS, DIM, torch.float32),
            "layer 2 is (12, 4, 2, 8) torch.float16 on cpu, layer 0 is (12, 4, 2, 8) torch.float32",
        ),
        (
            [*layers("nhd5", n=2), layers("nhd5", pages=11, n=1)[0]],
            (HOST, LAYERS, PAGE, HEADS, DIM, torch.float32),
            "layer 2 is (11, 4, 2, 8)",
        ),
        (
            [*layers("pair", n=2), (torch.zeros(12, 4, 2, 8), torch.zeros(12, 4, 2, 7))],
            (HOST, LAYERS, PAGE, HEADS, DIM, torch.float32),
            "layer 2: k_cache and v_cache must both be",
        ),
        (layers("vllm"), (HOST, LAYERS, PAGE, HEADS, DIM, torch.bfloat16), "the host pool's pages are"),
        (
            layers("vllm"),
            (HOST, LAYERS + 1, PAGE, HEADS, DIM, torch.float32),
            "the KV pool needs (3, 2, 4, 2, 8)",
        ),
        (layers("hnd5"), (HOST, LAYERS, PAGE, HEADS + 1, DIM, torch.float32), "the host pool's pages are"),
        (
            [*layers("nhd5", n=2), torch.empty(PAGES, 2, PAGE, HEADS, DIM, device="meta")],
            (HOST, LAYERS, PAGE, HEADS, DIM, torch.float32),
            "layer 2 is (12, 4, 2, 8) torch.float32 on meta, layer 0 is (12, 4, 2, 8) torch.float32 on cpu",
        ),
        (
            [torch.empty(PAGES, 2, PAGE, HEADS, DIM, device="meta")] * LAYERS,
            (HOST, LAYERS, PAGE, HEADS, DIM, torch.float32),
            "the KV pool must be on CPU or CUDA, got meta",
        ),
    ],
)
def test_mismatched_pools_are_refused(kv_caches, pool, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KVMover(kv_caches, HostKVPool(*pool))


def test_bad_staging_size_is_refused() -> None:
    with pytest.raises(ValueError, match="staging_pages must be an integer >= 1, got 0"):
        KVMover(layers("pair"), HostKVPool(HOST, LAYERS, PAGE, HEADS, DIM, torch.float32), staging_pages=0)


@pytest.mark.parametrize("host_pages", [0, -4, True, 2.0, None])
def test_host_pages_out_of_range(host_pages) -> None:
    with pytest.raises(ValueError, match="host_pages must be an integer >= 1"):
        HostKVPool(host_pages, LAYERS, PAGE, HEADS, DIM, torch.float32)


def test_a_host_pool_larger_than_the_machine_is_refused() -> None:
    with pytest.raises(ValueError, match=r"host_pages=\d+ needs .* GiB .* more than this machine's"):
        HostKVPool(2**40, 32, 16, 8, 128, torch.bfloat16)


def test_a_pinning_failure_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch, "empty", fail)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        PinningError, match=r"could not allocate 0\.00 GiB of pinned host memory for host_pages=4"
    ):
        HostKVPool(4, LAYERS, PAGE, HEADS, DIM, torch.float32, pin=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinning_without_cuda_is_refused() -> None:
    with pytest.raises(PinningError, match="a pinned host pool needs CUDA"):
        HostKVPool(4, LAYERS, PAGE, HEADS, DIM, torch.float32, pin=True)


def test_a_copy_that_fails_midway_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, mover = build("pair", torch.float32, staging_pages=1)
    calls = []

    def index_copy_then_fail(self, dim, index, source):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(self, dim, index, source)

    original = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy_then_fail)
    handle = mover.load([0, 1, 2], [0, 1, 2])
    assert handle.done() and not handle.ok
    assert "illegal memory access" in str(handle.error)
    assert "failed" in repr(handle)


def test_a_cancelled_copy_is_done_but_not_ok() -> None:
    _, _, mover = build("pair", torch.float32)
    handle = mover.save([0], [0])
    handle.cancel()
    assert handle.done() and handle.cancelled and not handle.ok
    handle.wait()
    handle.wait_on()  # nothing to wait for on CPU
    assert not handle.ok


@pytest.mark.parametrize(("dtype", "dim"), [(torch.bfloat16, 3), (torch.float32, 1), (torch.float16, 6)])
def test_head_dims_of_any_size_round_trip(dtype: torch.dtype, dim: int) -> None:
    # 6, 4 and 12 bytes of head_dim: the copies go through 2-, 4- and 4-byte integers, not 8.
    gen = torch.Generator().manual_seed(3)
    kv_caches = make_pool("hnd5", 2, PAGES, PAGE, HEADS, dim, dtype, gen)
    mover = KVMover(kv_caches, HostKVPool(4, 2, PAGE, HEADS, dim, dtype))
    before = [page_bytes(kv_caches, p) for p in range(PAGES)]
    assert mover.save([5, 6], [3, 0]).ok and mover.load([3, 0], [1, 2]).ok
    assert [page_bytes(kv_caches, p) for p in range(PAGES)] == [before[0], before[5], before[6], *before[3:]]


@pytest.mark.parametrize(
    ("layout", "ops", "direct"),
    [
        ("one_nhd5", 1, True),
        ("one_vllm", 2, True),
        ("page_major", 2, True),
        ("nhd5", 3, False),
        ("mixed", 4, False),
    ],
)
def test_layers_of_one_tensor_move_in_one_op(layout: str, ops: int, direct: bool) -> None:
    # mixed: layers 0 and 2 are 5-D (two ops), layer 1 a K and V pair (two more). Direct: one or two
    # 2-D copies per page, no gather and no staging buffer.
    _, _, mover = build(layout, torch.bfloat16)
    assert mover.ops_per_chunk == ops
    assert mover.direct == direct and mover.staging_pages == (0 if direct else HOST)


def test_rows_that_overlap_are_gathered() -> None:
    # an expanded head axis: a page's two rows (heads) are the same bytes, a pitch of 0
    k, v = (torch.randn(PAGES, 1, 1, DIM).half().expand(PAGES, 2, 1, DIM) for _ in range(2))
    mover = KVMover([(k, v)], HostKVPool(HOST, 1, 2, 1, DIM, torch.float16))
    assert not mover.direct
    assert mover.save([3], [0]).ok
    assert host_page_bytes(mover.host_pool.pages, 0) == page_bytes([(k, v)], 3)


def test_a_transposed_tensor_of_all_layers_is_gathered() -> None:
    # one [layers, pages, H, page_size, D] K and V (HND): a page's rows are not a host page's rows
    gen = torch.Generator().manual_seed(9)
    k, v = (random_bits((LAYERS, PAGES, HEADS, PAGE, DIM), torch.float16, gen, "cpu") for _ in range(2))
    kv_caches = [(k[layer].transpose(1, 2), v[layer].transpose(1, 2)) for layer in range(LAYERS)]
    mover = KVMover(kv_caches, HostKVPool(HOST, LAYERS, PAGE, HEADS, DIM, torch.float16))
    assert mover.ops_per_chunk == 2 and not mover.direct
    before = [page_bytes(kv_caches, p) for p in range(PAGES)]
    assert mover.save([3], [0]).ok and mover.load([0], [8]).ok
    assert page_bytes(kv_caches, 8) == before[3]


def _irregular(case: str, gen: torch.Generator) -> list:
    """Four layers, some views of one tensor that do not line up with the layer order."""
    pool = list(random_bits((4, PAGES, 2, PAGE, HEADS, DIM), torch.float16, gen, "cpu"))
    pair = make_pool("pair", 1, PAGES, PAGE, HEADS, DIM, torch.float16, gen)[0]
    if case == "swapped":  # a regular first step, then not
        return [pool[0], pool[1], pool[3], pool[2]]
    if case == "after_a_pair":  # layers 1-3 line up: one op, at layers 1..3 of a host page
        return [pair, pool[0], pool[1], pool[2]]
    return [pool[0], pair, pool[1], pool[2]]  # "around_a_pair": layers 0, 2, 3 are not consecutive


@pytest.mark.parametrize(("case", "ops"), [("swapped", 4), ("after_a_pair", 3), ("around_a_pair", 5)])
def test_layers_of_one_tensor_that_do_not_line_up_round_trip(case: str, ops: int) -> None:
    gen = torch.Generator().manual_seed(5)
    kv_caches = _irregular(case, gen)
    mover = KVMover(kv_caches, HostKVPool(2, 4, PAGE, HEADS, DIM, torch.float16))
    assert mover.ops_per_chunk == ops
    before = [page_bytes(kv_caches, p) for p in range(PAGES)]
    assert mover.save([4, 7], [1, 0]).ok and mover.load([1, 0], [9, 2]).ok
    assert host_page_bytes(mover.host_pool.pages, 1) == before[4]
    assert host_page_bytes(mover.host_pool.pages, 0) == before[7]
    assert [page_bytes(kv_caches, p) for p in range(PAGES)] == [
        before[4] if p == 9 else before[7] if p == 2 else before[p] for p in range(PAGES)
    ]


def test_the_benchmark_runs_on_the_cpu(tmp_path) -> None:
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_offload.py"
    run = subprocess.run(
        [sys.executable, str(bench), "--smoke", "--layouts", "nhd5,one,hnd", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "offload_smoke.json").read_text())["rows"]
    assert [(r["layout"], r["pages"]) for r in rows] == [
        (lay, n) for lay in ("nhd5", "one", "hnd") for n in (1, 4, 8)
    ]
    assert all(r["bitwise"] for r in rows)
    assert [r["ops"] for r in rows[::3]] == [2, 1, 4]
    assert [r["direct"] for r in rows[::3]] == [True, True, False]  # 2 layers: nhd5 is two tensors

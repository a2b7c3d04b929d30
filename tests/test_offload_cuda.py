"""The mover on the GPU: bytes survive the round trip, and its side stream is ordered against the
caller's stream as documented (a save sees the forward's writes, a load is seen by the forward after
``wait_on``, neither waits for an idle caller). ``torch.cuda._sleep`` holds a stream busy so that a
missing wait shows as wrong bytes instead of passing by luck."""

from __future__ import annotations

import pytest
import torch
from offload_layouts import (
    DIM,
    DTYPES,
    HEADS,
    HOST,
    LAYERS,
    LAYOUTS,
    PAGE,
    build,
    check_round_trip,
    host_page_bytes,
    page_bytes,
)

from prefix_cache.attention.kv_layout import split_kv_cache
from prefix_cache.offload import HostKVPool, KVMover

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: GPU cycles of ``torch.cuda._sleep``: a quarter of a second, far longer than queuing a batch on a
#: warm mover, even with other processes on the GPU (at 50 ms, a first save on a shared device was
#: still being queued when the sleep ended).
BUSY = 500_000_000


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_on_the_gpu(layout: str, dtype: torch.dtype) -> None:
    check_round_trip(layout, dtype, "cuda")


@pytest.mark.parametrize(
    ("layout", "direct"),
    [("one_nhd5", True), ("one_vllm", True), ("page_major", True), ("nhd5", False), ("hnd_pair", False)],
)
def test_layouts_of_one_tensor_move_on_the_copy_engine(layout: str, direct: bool) -> None:
    _, _, mover = build(layout, torch.bfloat16, device="cuda")
    assert mover.direct == direct and mover.staging_pages == (0 if direct else HOST)


def test_a_layer_step_past_the_pitch_limit_is_gathered() -> None:
    # 2.4 GB a layer: a 2-D copy's pitch would pass cudaDevAttrMaxPitch (2**31 - 1 on NVIDIA GPUs)
    pool = torch.zeros(2, 36000, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    pool[1, 35999].fill_(3.0)
    mover = KVMover(list(pool), HostKVPool(4, 2, 16, 8, 128, torch.bfloat16))
    assert mover.ops_per_chunk == 1 and not mover.direct
    handle = mover.save([35999], [2])
    handle.wait()
    assert handle.ok and torch.equal(mover.host_pool.pages[2, 1].cuda(), pool[1, 35999])
    del pool, mover
    torch.cuda.empty_cache()


def test_a_copy_the_cuda_runtime_refuses_fails_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, mover = build("one_nhd5", torch.bfloat16, device="cuda")
    real = mover._direct._copy2d
    calls = []

    def refuse_the_third(dst, dpitch, src, spitch, width, height, kind, stream):
        calls.append(1)
        if len(calls) == 3:  # a pitch below the width: the runtime refuses it
            return real(dst, 1, src, 1, width, height, kind, stream)
        return real(dst, dpitch, src, spitch, width, height, kind, stream)

    monkeypatch.setattr(mover._direct, "_copy2d", refuse_the_third)
    handle = mover.save([0, 1, 2, 3], [0, 1, 2, 3])
    handle.wait()
    assert handle.done() and not handle.ok
    assert "cudaMemcpy2DAsync failed" in str(handle.error)
    # the refusal left no error behind for torch's next launch to report as its own
    assert torch.ones(8, device="cuda").sum().item() == 8
    monkeypatch.undo()
    handle = mover.save([4], [4])
    handle.wait()
    assert handle.ok  # and the mover goes on


def fill(kv_caches, page: int, value: int) -> None:
    """Writes ``value`` into every byte of GPU page ``page`` of every layer, on the current stream."""
    for kv_cache in kv_caches:
        for half in split_kv_cache(kv_cache):
            half[page].view(torch.uint8).fill_(value)


@pytest.mark.parametrize("layout", ["nhd5", "one_nhd5"])
def test_a_save_waits_for_the_write_queued_before_it(layout: str) -> None:
    kv_caches, pool, mover = build(layout, torch.bfloat16, device="cuda")
    mover.save([5], [0]).wait()  # first use allocates: not part of what is timed against the sleep
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(BUSY)
        fill(kv_caches, 5, 0x3C)  # the forward's write, still queued behind the sleep
        handle = mover.save([5], [0])
    assert not handle.done()  # the save waits for the write
    handle.wait()
    assert handle.ok and set(host_page_bytes(pool.pages, 0)) == {0x3C}


@pytest.mark.parametrize("layout", ["pair", "one_vllm"])
def test_a_saved_page_is_overwritten_only_after_wait_on(layout: str) -> None:
    kv_caches, pool, mover = build(layout, torch.float16, device="cuda")
    before = page_bytes(kv_caches, 3)
    with torch.cuda.stream(mover.copy_stream):
        torch.cuda._sleep(BUSY)  # the copy runs late
    handle = mover.save([3], [7])
    handle.wait_on()
    fill(kv_caches, 3, 0x11)  # the page's next owner writes it
    torch.cuda.synchronize()
    assert handle.ok and host_page_bytes(pool.pages, 7) == before


@pytest.mark.parametrize("layout", ["hnd_pair", "one_nhd5"])
def test_the_forward_after_wait_on_reads_the_loaded_bytes(layout: str) -> None:
    kv_caches, pool, mover = build(layout, torch.bfloat16, device="cuda")
    pool.pages[2].view(torch.uint8).fill_(0x5A)
    with torch.cuda.stream(mover.copy_stream):
        torch.cuda._sleep(BUSY)
    handle = mover.load([2], [9])
    handle.wait_on()
    read = [half[9].clone() for kv_cache in kv_caches for half in split_kv_cache(kv_cache)]  # the forward
    torch.cuda.synchronize()
    assert handle.ok
    assert all(set(t.view(torch.uint8).flatten().tolist()) == {0x5A} for t in read)


@pytest.mark.parametrize("layout", ["vllm", "page_major"])
def test_a_load_waits_for_kernels_still_reading_the_old_bytes(layout: str) -> None:
    kv_caches, pool, mover = build(layout, torch.float32, device="cuda")
    old = page_bytes(kv_caches, 4)
    torch.cuda._sleep(BUSY)
    read = [half[4].clone() for kv_cache in kv_caches for half in split_kv_cache(kv_cache)]  # old owner
    handle = mover.load([1], [4])
    handle.wait()
    torch.cuda.synchronize()
    assert b"".join(t.view(torch.uint8).cpu().numpy().tobytes() for t in read) == old
    assert page_bytes(kv_caches, 4) == host_page_bytes(pool.pages, 1)


@pytest.mark.parametrize("layout", ["nhd5", "one_nhd5"])
def test_copies_overlap_a_busy_stream_they_do_not_depend_on(layout: str) -> None:
    _, _, mover = build(layout, torch.bfloat16, device="cuda")
    busy = torch.cuda.current_stream()
    torch.cuda._sleep(BUSY)
    handle = mover.save([1, 2], [1, 2], stream=torch.cuda.Stream())
    handle.wait()
    assert handle.ok and not busy.query()  # saved while the other stream still computes
    torch.cuda.synchronize()


def test_the_host_pool_is_pinned_and_an_unpinned_one_is_refused() -> None:
    pool = HostKVPool(HOST, LAYERS, PAGE, HEADS, DIM, torch.bfloat16)
    assert pool.pinned and pool.pages.is_pinned()
    kv_caches = [torch.zeros(4, 2, PAGE, HEADS, DIM, dtype=torch.bfloat16, device="cuda")] * LAYERS
    KVMover(kv_caches, pool)
    unpinned = HostKVPool(HOST, LAYERS, PAGE, HEADS, DIM, torch.bfloat16, pin=False)
    with pytest.raises(ValueError, match="a KV pool on CUDA needs a pinned host pool"):
        KVMover(kv_caches, unpinned)

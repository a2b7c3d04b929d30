import dataclasses
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from attention_reference import reference_attention
from cascade_batches import Batch, batches
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache.attention import create_backend
from prefix_cache.attention.flashinfer_backend import compact_level
from prefix_cache.attention.merge import merge_states
from prefix_cache.attention.torch_backend import TorchBackend
from prefix_cache.planner.plan import CascadeLevel
from prefix_cache.planner.planner import CascadePlanner

BACKENDS = ["torch", "triton", "auto", "flashinfer"]
CUDA = torch.cuda.is_available()
# Absolute and relative tolerance against the float64 reference, by the dtype of q and the KV.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
HEADS = [(1, 1), (2, 1), (4, 2), (9, 3), (4, 4)]  # (num_qo_heads, num_kv_heads)
# Planners that share even tiny prefixes, so that small batches get deep plans, and the default one.
PLANNERS = [CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, max_levels=m) for m in (1, 2, 3, 4)]
PLANNERS.append(CascadePlanner())


def make_backend(name: str):
    """The backend, or a skip when its optional dependency or CUDA is missing here."""
    if name in ("triton", "auto"):
        pytest.importorskip("triton")
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
        if not CUDA:
            pytest.skip("flashinfer needs CUDA")
    return create_backend(name)


@dataclass(frozen=True)
class Sweep:
    """What to draw for one backend: its device, dtypes, head dims, batches and how many."""

    device: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    batches: st.SearchStrategy[Batch]
    max_examples: int


SWEEPS = {
    "torch": Sweep("cpu", (torch.float32, torch.float16, torch.bfloat16), (16, 32), batches(), 100),
    # Without CUDA, Triton's interpreter runs the kernels: slow, and wrong for bf16. Small batches there.
    "triton": Sweep("cuda", (torch.float32, torch.float16, torch.bfloat16), (64, 128), batches(), 30)
    if CUDA
    else Sweep(
        "cpu",
        (torch.float32, torch.float16),
        (16, 32),
        batches(max_conversations=2, max_samples=2, max_segment_pages=2, max_qo_len=4),
        30,
    ),
    # The auto backend with plans that give their dtype: FlashInfer routes where it is installed.
    "auto": Sweep("cuda", (torch.bfloat16,), (128,), batches(max_qo_len=80), 15)
    if CUDA
    else Sweep(
        "cpu",
        (torch.float32,),
        (16,),
        batches(max_conversations=2, max_samples=2, max_segment_pages=2, max_qo_len=4),
        10,
    ),
    # One dtype and head_dim: every (dtype, head_dim) is a separate FlashInfer JIT build (minutes).
    "flashinfer": Sweep("cuda", (torch.bfloat16,), (128,), batches(), 20),
}


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_reference(name: str) -> None:
    """Random batches, plans and data; the backend against the float64 attention from page tables."""
    backend = make_backend(name)
    sweep = SWEEPS[name]

    @settings(max_examples=sweep.max_examples, deadline=None)
    @given(data=st.data(), batch=sweep.batches)
    def check(data: st.DataObject, batch: Batch) -> None:
        dtype = data.draw(st.sampled_from(sweep.dtypes), label="dtype")
        head_dim = data.draw(st.sampled_from(sweep.head_dims), label="head_dim")
        num_qo_heads, num_kv_heads = data.draw(st.sampled_from(HEADS), label="heads")
        planner = data.draw(st.sampled_from(PLANNERS), label="planner")
        generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
        q = torch.randn(int(batch.qo_lens.sum()), num_qo_heads, head_dim, generator=generator)
        kv_cache = torch.randn(
            batch.num_pages, 2, batch.page_size, num_kv_heads, head_dim, generator=generator
        )
        q, kv_cache = q.to(sweep.device, dtype), kv_cache.to(sweep.device, dtype)

        plan = planner.plan(batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size)
        backend.plan(
            plan, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=dtype
        )
        out = backend.run(q, kv_cache)
        expected = reference_attention(
            q, kv_cache, batch.block_tables, batch.kv_lens, batch.qo_lens, head_dim**-0.5
        )

        assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
        assert torch.isfinite(out).all()
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)

    check()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("kv_lens", "qo_lens"), [([], []), ([50, 0], [0, 0])])
def test_batch_without_queries(name: str, kv_lens: list[int], qo_lens: list[int]) -> None:
    backend = make_backend(name)
    device, dtype = SWEEPS[name].device, torch.float16
    tables = [np.arange(4, dtype=np.int32) for _ in kv_lens]
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, 16)
    backend.plan(plan, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    kv_cache = torch.randn(4, 2, 16, 2, 64).to(device, dtype)
    assert backend.run(torch.zeros(0, 4, 64, device=device, dtype=dtype), kv_cache).shape == (0, 4, 64)


def test_run_checks_its_inputs() -> None:
    backend = TorchBackend()
    with pytest.raises(RuntimeError, match="before plan"):
        backend.run(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16, 1, 16))
    with pytest.raises(ValueError, match="multiple"):
        backend.plan(CascadePlanner().plan([[0]], [1], [1], 16), num_qo_heads=3, num_kv_heads=2, head_dim=16)
    backend.plan(CascadePlanner().plan([[0]], [1], [1], 16), num_qo_heads=2, num_kv_heads=1, head_dim=16)
    kv_cache = torch.zeros(1, 2, 16, 1, 16)
    with pytest.raises(ValueError, match="q has shape"):
        backend.run(torch.zeros(2, 2, 16), kv_cache)
    with pytest.raises(ValueError, match="kv_cache has pages of"):
        backend.run(torch.zeros(1, 2, 16), torch.zeros(1, 2, 8, 1, 16))
    with pytest.raises(ValueError, match="share one of"):
        backend.run(torch.zeros(1, 2, 16, dtype=torch.float16), kv_cache)


def test_merge_states_equals_attention_over_the_union() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 3, 12, generator=generator)  # [tokens, heads, keys]
    values = torch.randn(12, 4, generator=generator)
    segments = [slice(0, 4), slice(4, 4), slice(4, 12)]  # the middle one is empty

    def attend(keys: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores[..., keys]
        if s.shape[-1] == 0:  # an empty segment's out may be anything
            return torch.full((5, 3, 4), float("nan")), torch.full((5, 3), float("-inf"))
        return torch.softmax(s, -1) @ values[keys], torch.logsumexp(s, -1)

    outs, lses = zip(*(attend(k) for k in segments), strict=True)
    out, lse = merge_states(list(outs), list(lses))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    # Every segment empty: out 0, lse -inf.
    out, lse = merge_states([torch.ones(2, 1, 4)], [torch.full((2, 1), float("-inf"))])
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_compact_level_drops_groups_without_queries_or_kv() -> None:
    level = CascadeLevel(
        qo_indptr=np.array([0, 2, 2, 5, 6], dtype=np.int32),  # group 1 has no queries
        kv_indptr=np.array([0, 3, 4, 4, 6], dtype=np.int32),  # group 2 has no KV
        kv_indices=np.array([7, 8, 9, 1, 5, 6], dtype=np.int32),
        kv_last_page_len=np.array([16, 16, 0, 16], dtype=np.int32),
        causal=False,
    )
    compact = compact_level(level)
    assert compact.qo_indptr.tolist() == [0, 2, 3] and compact.kv_indptr.tolist() == [0, 3, 5]
    assert compact.kv_indices.tolist() == [7, 8, 9, 5, 6] and compact.kv_last_page_len.tolist() == [16, 16]
    assert compact.rows.tolist() == [0, 1, 5] and not compact.causal
    # Without group 2, only a group without queries goes: every row stays.
    keep = [0, 1, 2, 4]
    without_gap = CascadeLevel(
        level.qo_indptr[keep],
        level.kv_indptr[keep],
        level.kv_indices,
        level.kv_last_page_len[[0, 1, 3]],
        True,
    )
    assert compact_level(without_gap).rows is None


def test_small_decode_reaches_flashinfer_in_engine_order() -> None:
    """The auto backend's FlashInfer route for small unshared decode skips the q gather and output
    scatter: the planner leaves such a batch in the engine's order, even where sorting by table
    would reorder it; a cascade plan is permuted and keeps them."""
    from prefix_cache.attention.auto_backend import Routing, choose_route
    from prefix_cache.attention.base import in_engine_order

    tables = [np.arange(40 * i, 40 * i + 20) for i in (3, 0, 2, 1)]  # out of page order
    plan = CascadePlanner().plan(tables, [300, 310, 20, 5], [1, 1, 1, 1], 16)
    assert len(plan.levels) == 1 and in_engine_order(plan.query_order)
    assert choose_route(plan, 4, Routing()) == "flashinfer"
    shared = [np.array([*range(32), 100 + i]) for i in (3, 0, 2, 1)]
    cascade = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0).plan(
        [np.arange(200, 240), *shared], [600] + [520] * 4, [1] * 5, 16
    )
    assert len(cascade.levels) == 2 and not in_engine_order(cascade.query_order)
    assert not in_engine_order(np.array([1, 0])) and in_engine_order(np.zeros(0, dtype=np.int64))


def test_small_decode_cascades_run_as_one_level_on_flashinfer_eager() -> None:
    """``Routing.eager_flat_kv_bytes``: a decode cascade whose one-level plan reads at most that
    many bytes of K and V is handed over as that plan (which the eager route sends to FlashInfer's
    decode wrapper); not past the limit, not for GQA groups over ``decode_max_group``, not for
    prefill chunks, not at 0."""
    from prefix_cache.attention.auto_backend import Routing, choose_flat_decode, choose_route

    planner = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0)
    shared = list(range(32))  # 512 tokens
    tables = [np.array([*shared, 100 + i]) for i in range(8)]
    plan = planner.plan(tables, [520] * 8, [1] * 8, 16)
    assert len(plan.levels) == 2
    size = 8 * 33 * 16 * 8 * 128 * 2 * 2  # requests x pages x tokens x KV heads x head_dim x (K, V) x bf16
    flat = choose_flat_decode(plan, 4, 8, 128, 2, Routing(eager_flat_kv_bytes=size))
    assert flat is not None and len(flat.levels) == 1
    assert choose_route(flat, 4, Routing()) == "flashinfer"
    assert choose_flat_decode(plan, 4, 8, 128, 2, Routing(eager_flat_kv_bytes=size - 1)) is None
    assert choose_flat_decode(plan, 16, 8, 128, 2, Routing(eager_flat_kv_bytes=size)) is None
    assert choose_flat_decode(plan, 4, 8, 128, 2, Routing(eager_flat_kv_bytes=0)) is None
    # A malformed plan raises as the Triton route's plan would: a last page longer than a page.
    bad_last = dataclasses.replace(plan.levels[-1], kv_last_page_len=np.full(8, 40, dtype=np.int32))
    with pytest.raises(ValueError, match="kv_last_page_len"):
        choose_flat_decode(
            dataclasses.replace(plan, levels=(plan.levels[0], bad_last)),
            4,
            8,
            128,
            2,
            Routing(eager_flat_kv_bytes=size),
        )
    prefill = planner.plan(tables, [520] * 8, [4] * 8, 16)
    assert len(prefill.levels) == 2
    assert choose_flat_decode(prefill, 4, 8, 128, 2, Routing(eager_flat_kv_bytes=10 * size)) is None
    # The default takes 512 tokens shared by 32 decodes of 256 more at Llama-3-8B's heads (96 MiB).
    tables = [np.array([*shared, *range(100 + 16 * i, 116 + 16 * i)]) for i in range(32)]
    plan = planner.plan(tables, [768] * 32, [1] * 32, 16)
    assert len(plan.levels) == 2 and choose_flat_decode(plan, 4, 8, 128, 2, Routing()) is not None


def test_prefill_cascade_with_an_fa3_level_takes_the_triton_route() -> None:
    """A cascade with prefill chunks, which the thresholds send to FlashInfer's cascade wrapper, runs
    on the Triton route when the ``LevelRule`` gives its shared level to FA3 (a stand-in FlashInfer
    on CPU), and its output matches the float64 reference; a rule that takes no level leaves it on
    FlashInfer's route."""
    pytest.importorskip("triton")
    import flashinfer_stand_in

    from prefix_cache.attention.auto_backend import Routing
    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    device = SWEEPS["triton"].device
    page, hq, hkv, d = 4, 4, 2, 64
    gen = torch.Generator().manual_seed(12)
    kv_cache = torch.randn(40, 2, page, hkv, d, generator=gen).half().to(device)
    tables = [np.r_[np.arange(9), 20 + 3 * r, 21 + 3 * r, 22 + 3 * r] for r in range(3)]  # 36 shared tokens
    kv_lens, qo_lens = [36 + 2, 36 + 9, 36 + 3], [1, 8, 2]
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(tables, kv_lens, qo_lens, page)
    assert len(plan.levels) == 2
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16)
    # The level: 22 rows x 36 tokens x 2 KV heads.
    for work, route in ((22 * 36 * hkv, "triton+fa3"), (22 * 36 * hkv + 1, "flashinfer")):
        routing = Routing(prefill_min_tokens=4, prefill_tokens=4)
        backend = create_backend("auto", device=device, routing=routing)
        backend._fi_module = flashinfer_stand_in  # FlashInfer is only looked for on CUDA
        rule = LevelRule(min_rows=4, min_kv_tokens=12, min_work=work, min_split_tokens=8)
        fa3 = SharedLevelsOnFlashInfer(flashinfer_stand_in, torch.device(device), rule)
        backend._triton._shared_levels = fa3
        backend.num_qo_heads, backend.num_kv_heads, backend.head_dim = hq, hkv, d
        backend.dtype = backend.kv_dtype = torch.float16
        assert backend._fa3_takes_a_level(plan) == (route == "triton+fa3")
        if route == "flashinfer":
            continue  # FlashInfer's cascade wrapper has no stand-in
        backend.plan(plan, **heads)
        assert backend.route == route
        q = torch.randn(sum(qo_lens), hq, d, generator=gen).half().to(device)
        out = backend.run(q, kv_cache)
        expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3)


def test_create_backend() -> None:
    assert isinstance(create_backend("torch"), TorchBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("cuda")


def test_create_backend_explains_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(ImportError, match="needs the 'flashinfer' package"):
        create_backend("flashinfer")


# ----------------------------------------------------------------------------------------------
# KV layouts, planned dtypes, out=, fixed capacity


def _layouts(kv_cache: torch.Tensor) -> dict[str, object]:
    """The same pages in every layout the backends accept (see prefix_cache.attention.kv_layout)."""
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    vllm = torch.stack([k, v])  # [2, pages, page_size, H, D]
    hnd = torch.stack([k, v], dim=1).transpose(2, 3).contiguous()  # [pages, 2, H, page_size, D]
    return {
        "nhd": kv_cache,
        "vllm": (vllm[0], vllm[1]),
        "separate": (k.contiguous(), v.contiguous()),
        "hnd": (hnd[:, 0].transpose(1, 2), hnd[:, 1].transpose(1, 2)),
    }


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_kv_layouts_give_the_same_attention(name: str) -> None:
    backend = make_backend(name)
    device = SWEEPS[name].device
    generator = torch.Generator().manual_seed(3)
    page_size, hq, hkv, d = 4, 4, 2, 16
    tables = [np.array([5, 1, 7, 2]), np.array([5, 1, 3]), np.array([6, 0])]
    kv_lens, qo_lens = [15, 11, 6], [1, 3, 2]
    kv_cache = torch.randn(8, 2, page_size, hkv, d, generator=generator).to(device)
    q = torch.randn(sum(qo_lens), hq, d, generator=generator).to(device)
    plan = PLANNERS[2].plan(tables, kv_lens, qo_lens, page_size)
    assert len(plan.levels) > 1
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
    for layout, kv in _layouts(kv_cache).items():
        out = backend.run(q, kv)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5, msg=layout)


def test_planned_dtype_and_out() -> None:
    backend = make_backend("triton")
    device = SWEEPS["triton"].device
    plan = CascadePlanner().plan([np.arange(3)], [40], [2], 16)
    backend.plan(plan, num_qo_heads=2, num_kv_heads=1, head_dim=16, q_dtype=torch.float32)
    kv_cache = torch.randn(3, 2, 16, 1, 16, device=device)
    q = torch.randn(2, 2, 16, device=device)
    out = torch.full_like(q, float("nan"))
    assert backend.run(q, kv_cache, out=out) is out and out.isfinite().all()
    with pytest.raises(ValueError, match="planned"):
        backend.run(q.half(), kv_cache.half())
    with pytest.raises(ValueError, match="out must be like q"):
        backend.run(q, kv_cache, out=out[:1])
    with pytest.raises(ValueError, match="kv_dtype"):
        backend.plan(plan, num_qo_heads=2, num_kv_heads=1, head_dim=16, q_dtype=torch.float16,
                     kv_dtype=torch.float32)  # fmt: skip


# Small on the CPU (Triton's interpreter); fixed capacity on the GPU is also replayed in CUDA graphs
# (tests/test_kernels.py).
SMALL = batches(min_page_size=4, max_page_size=4, max_conversations=2, max_samples=2, max_segment_pages=2,
                max_qo_len=4)  # fmt: skip


def test_fixed_capacity_replans_into_the_same_buffers() -> None:
    """One backend, many different plans (depth, lengths, padding rows): every run is right, and no
    plan moves a buffer, so a CUDA graph captured once stays valid."""
    pytest.importorskip("triton")
    from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend

    device = SWEEPS["triton"].device
    capacity = GraphCapacity(max_query_tokens=40, max_pages=200, max_levels=4)
    backend = TritonBackend(device, capacity=capacity)
    hq, hkv, d = 4, 2, 16
    buffers: list[int] = []

    @settings(max_examples=12, deadline=None)
    @given(data=st.data(), batch=SMALL)
    def check(data: st.DataObject, batch: Batch) -> None:
        planner = data.draw(st.sampled_from(PLANNERS), label="planner")
        plan = planner.plan(batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size)
        generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
        kv_cache = torch.randn(batch.num_pages, 2, batch.page_size, hkv, d, generator=generator).to(device)
        nq = plan.num_query_tokens
        q = torch.randn(capacity.max_query_tokens, hq, d, generator=generator).to(device)  # padded
        backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
        ptrs = [backend._ints.data_ptr(), backend._part_o.data_ptr(), backend._part_lse.data_ptr()]
        if buffers:
            assert ptrs == buffers, "a plan moved a device buffer"
        buffers[:] = ptrs
        out = torch.full_like(q, float("nan"))
        backend.run(q, kv_cache, out=out)
        expected = reference_attention(
            q[:nq], kv_cache, batch.block_tables, batch.kv_lens, batch.qo_lens, d**-0.5
        )
        torch.testing.assert_close(out[:nq].double(), expected, atol=2e-5, rtol=2e-5)
        assert out[nq:].isnan().all(), "padding rows must be left as they were"

    check()


def test_fixed_capacity_rejects_what_does_not_fit() -> None:
    pytest.importorskip("triton")
    from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend

    device = SWEEPS["triton"].device
    backend = TritonBackend(device, capacity=GraphCapacity(max_query_tokens=4, max_pages=8, max_levels=2))
    heads = dict(num_qo_heads=2, num_kv_heads=1, head_dim=16)
    ok = CascadePlanner().plan([np.arange(2)], [20], [3], 16)
    backend.plan(ok, **heads)
    for tables, kv_lens, qo_lens, what in (
        ([np.arange(2)], [20], [5], "5 query tokens"),
        ([np.arange(9)], [140], [1], "9 pages"),
    ):
        with pytest.raises(ValueError, match=f"{what}, over the backend's capacity"):
            backend.plan(CascadePlanner().plan(tables, kv_lens, qo_lens, 16), **heads)
        with pytest.raises(RuntimeError, match="before plan"):
            backend.run(torch.zeros(3, 2, 16, device=device), torch.zeros(9, 2, 16, 1, 16, device=device))
    deep = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, max_levels=3)
    tables = [np.array([0, 1, 2]), np.array([0, 1, 3]), np.array([0, 4])]
    with pytest.raises(ValueError, match="3 levels"):
        backend.plan(deep.plan(tables, [40, 40, 20], [1, 1, 1], 16), **heads)
    with pytest.raises(ValueError, match="keeps its heads"):
        backend.plan(ok, num_qo_heads=4, num_kv_heads=1, head_dim=16)
    backend.plan(ok, **heads)  # the buffers still serve plans that fit
    kv_cache = torch.randn(2, 2, 16, 1, 16, device=device)
    # q padded to the capacity's 4 rows: the plan's 3 are computed, the padding row is left as it was.
    out = torch.full((4, 2, 16), 7.0, device=device)
    backend.run(torch.randn(4, 2, 16, device=device), kv_cache, out=out)
    assert out[:3].isfinite().all() and (out[:3] != 7.0).all() and (out[3] == 7.0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_auto_backend_routes() -> None:
    """Each route of the auto backend against the float64 reference: prefill on FlashInfer (one level,
    and a cascade on its multi-level wrapper), unshared decode on FlashInfer's decode wrapper, shared
    decode on our kernels, and eager, a small shared decode as one level on FlashInfer's decode
    wrapper (``Routing.eager_flat_kv_bytes``)."""
    pytest.importorskip("flashinfer")
    from prefix_cache.attention.auto_backend import Routing

    routing = Routing(prefill_min_tokens=8, prefill_tokens=16, eager_flat_kv_bytes=0)
    backend = create_backend("auto", routing=routing)
    flat = create_backend("auto", routing=dataclasses.replace(routing, eager_flat_kv_bytes=2**30))
    page_size, hq, hkv, d, dtype = 16, 32, 8, 128, torch.bfloat16
    generator = torch.Generator().manual_seed(9)
    kv_cache = torch.randn(400, 2, page_size, hkv, d, generator=generator).to("cuda", dtype)
    shared = list(range(32))  # 512 tokens
    cases = [
        ("flashinfer", [np.arange(40, 60), np.arange(60, 80)], [300, 310], [40, 17]),
        ("flashinfer", [np.array([*shared, 100 + i, 120 + i]) for i in range(8)], [540] * 8, [20, 1] * 4),
        ("flashinfer", [np.arange(40, 60), np.arange(60, 80)], [300, 310], [1, 1]),
        ("triton", [np.array([*shared, 100 + i]) for i in range(8)], [520] * 8, [1] * 8),
        # The same shared decode as one level, and one with an idle request and a partial last page.
        ("flat", [np.array([*shared, 100 + i]) for i in range(8)], [520] * 8, [1] * 8),
        (
            "flat",
            [np.array([*shared, 100 + i, 120 + i]) for i in range(4)],
            [540, 530, 529, 515],
            [1, 0, 1, 1],
        ),
    ]
    for route, tables, kv_lens, qo_lens in cases:
        plan = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0).plan(
            tables, kv_lens, qo_lens, page_size
        )
        runner = backend
        if route == "flat":
            runner, route = flat, "flashinfer"
            assert len(plan.levels) == 2
        runner.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
        assert runner.route == route
        if runner is flat:  # the one-level plan, on the decode wrapper
            assert len(flat._fi_backend._levels) == 1 and flat._fi_backend._decode_wrapper is not None
        q = torch.randn(sum(qo_lens), hq, d, generator=generator).to("cuda", dtype)
        expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        scale = float(expected.abs().max())
        out = runner.run(q, kv_cache)
        torch.testing.assert_close(out.double(), expected, atol=1.6e-2 * scale, rtol=0, msg=route)
        # Every route refuses a pool without the pages the plan reads (FlashInfer's kernels would read
        # past it).
        top = max(int(table[: -(-n // page_size)].max()) for table, n in zip(tables, kv_lens, strict=True))
        with pytest.raises(ValueError, match=f"references page {top}, the KV cache has {top} pages"):
            runner.run(q, kv_cache[:top])
        # The caller's output: contiguous (one-level FlashInfer plans write it in place) and strided
        # (written through a copy).
        strided = torch.full((q.shape[0], hq, 2 * d), float("nan"), dtype=dtype, device="cuda")[..., :d]
        for mine in (torch.full_like(q, float("nan")), strided):
            assert runner.run(q, kv_cache, out=mine) is mine
            torch.testing.assert_close(mine.double(), expected, atol=1.6e-2 * scale, rtol=0, msg=route)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (16, 4, 64)])
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_auto_backend_runs_long_shared_levels_on_fa3(hq: int, hkv: int, d: int, layout: str) -> None:
    """On Hopper, shared levels the ``LevelRule`` admits run on FlashInfer's FA3, split by hand, and
    merge with our kernels' unique level (route ``triton+fa3``): two shared prefixes of different
    lengths, decodes and a prefill chunk, a request that shares nothing, both KV layouts; every output
    row against the float64 reference."""
    pytest.importorskip("flashinfer")
    from prefix_cache.attention.auto_backend import Routing
    from prefix_cache.attention.flashinfer_levels import LevelRule

    rule = LevelRule(min_rows=32, min_kv_tokens=512, min_work=1, min_split_tokens=256)
    page_size, dtype = 16, torch.bfloat16
    generator = torch.Generator().manual_seed(11)
    pool = torch.randn(400, 2, page_size, hkv, d, generator=generator).to("cuda", dtype)
    vllm = pool.transpose(0, 1).contiguous()  # [2, pages, page_size, H, D]
    kv_cache = pool if layout == "nhd" else (vllm[0], vllm[1])
    first, second = list(range(0, 80)), list(range(80, 112))  # 1280 and 512 tokens
    tables = [np.array([*first, 200 + 2 * i, 201 + 2 * i]) for i in range(12)]
    tables += [np.array([*second, 240 + i]) for i in range(10)]
    tables.append(np.arange(300, 310))
    kv_lens = [1280 + 20 + i for i in range(12)] + [512 + 9] * 10 + [150]
    qo_lens = [1] * 11 + [7] + [1] * 10 + [1]
    plan = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0).plan(tables, kv_lens, qo_lens, page_size)
    hopper = torch.cuda.get_device_capability()[0] == 9
    q = torch.randn(sum(qo_lens), hq, d, generator=generator).to("cuda", dtype)
    expected = reference_attention(q, pool, tables, kv_lens, qo_lens, d**-0.5)
    scale = float(expected.abs().max())
    # Default routing (a decode batch: Triton), and thresholds that call the 7-token chunk a prefill
    # (FlashInfer's cascade, unless FA3 takes the shared level).
    prefills = Routing(prefill_min_tokens=4, prefill_tokens=4)
    for routing, elsewhere in ((None, "triton"), (prefills, "flashinfer")):
        backend = create_backend("auto", level_rule=rule, routing=routing)
        backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
        assert backend.route == ("triton+fa3" if hopper else elsewhere)
        for _ in range(2):  # the plan's buffers serve every layer
            out = torch.full_like(q, float("nan"))
            backend.run(q, kv_cache, out=out)
            torch.testing.assert_close(out.double(), expected, atol=1.6e-2 * scale, rtol=0)


def test_graph_keys() -> None:
    """Under a capacity, one-level plans that the routing sends to FlashInfer take its decode or
    prefill graph (a decode of one or two short requests the prefill one, of many requests Triton);
    every other plan, and every plan of a backend without FlashInfer, a Triton one (the narrow
    launch with the middle tile's, the wide tile's or none, as the levels need); a backend without a
    capacity has no key."""
    pytest.importorskip("triton")
    from prefix_cache.attention.auto_backend import Routing, choose_graph_key
    from prefix_cache.attention.triton_backend import GraphCapacity

    routing = Routing(prefill_min_tokens=8, prefill_tokens=16)
    unshared = [np.arange(20 * i, 20 * i + 20) for i in range(3)]
    decode = CascadePlanner().plan(unshared, [300, 310, 20], [1, 1, 1], 16)
    prefill = CascadePlanner().plan(unshared, [300, 310, 20], [32, 1, 1], 16)
    chunk = CascadePlanner().plan(unshared, [300, 310, 20], [8, 1, 1], 16)
    assert choose_graph_key(decode, 4, 128, routing) == "flashinfer-decode"
    assert choose_graph_key(prefill, 4, 128, routing) == "flashinfer-prefill"
    assert choose_graph_key(prefill, 32, 128, routing) == "flashinfer-prefill"
    assert choose_graph_key(decode, 32, 128, routing) == "triton"  # FlashInfer's decode routing stops at 8
    assert choose_graph_key(prefill, 4, 128, Routing(prefill_min_tokens=8, prefill_tokens=33)) == "triton"
    # Decodes of one or two requests of at most 256 KV tokens: FlashInfer's prefill graph; of 8
    # requests or more: Triton.
    short = CascadePlanner().plan(unshared[:2], [256, 20], [1, 1], 16)
    assert choose_graph_key(short, 4, 128, routing) == "flashinfer-prefill"
    assert choose_graph_key(short, 4, 128, Routing(graph_fa3_decodes=1)) == "flashinfer-decode"
    assert choose_graph_key(short, 4, 128, Routing(graph_fa3_decode_kv=255)) == "flashinfer-decode"
    longer = CascadePlanner().plan(unshared[:2], [257, 20], [1, 1], 16)
    assert choose_graph_key(longer, 4, 128, routing) == "flashinfer-decode"
    many = [np.arange(4 * i, 4 * i + 4) for i in range(8)]
    eight = CascadePlanner().plan(many, [50] * 8, [1] * 8, 16)
    assert choose_graph_key(eight, 4, 128, routing) == "triton"
    assert choose_graph_key(eight, 4, 128, Routing(graph_triton_decodes=9)) == "flashinfer-decode"
    # Head dims over 128 keep splits from 256 tokens on one level, and FlashInfer up to 15 decodes.
    assert choose_graph_key(eight, 4, 256, routing) == "flashinfer-decode"
    assert choose_graph_key(eight, 4, 256, Routing(graph_triton_decodes_large_heads=8)) == "triton"
    assert choose_graph_key(CascadePlanner().plan(many[:7], [50] * 7, [1] * 7, 16), 4, 128, routing) == (
        "flashinfer-decode"
    )
    # A request without a query this step: FlashInfer's fixed batch gives each request a row.
    idle = CascadePlanner().plan(unshared, [300, 310, 20], [1, 0, 1], 16)
    assert len(idle.levels) == 1 and choose_graph_key(idle, 4, 128, routing) == "triton"
    shared = [np.array([*range(32), 100 + i]) for i in range(4)]
    cascade = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0).plan(
        shared, [520] * 4, [16, 1, 1, 1], 16
    )
    assert len(cascade.levels) == 2 and choose_graph_key(cascade, 4, 128, routing) == "triton"
    # One-level plans that FlashInfer's graph launches would run wrongly are left to Triton: a request
    # without KV, a non-causal level, a level that does not cover the plan's query tokens.
    (level,) = decode.levels
    no_kv = dataclasses.replace(
        level,
        kv_indptr=np.array([0, 0, 20, 40], dtype=np.int32),
        kv_indices=level.kv_indices[20:],
        kv_last_page_len=np.array([0, 16, 4], dtype=np.int32),
    )
    for broken in (no_kv, dataclasses.replace(level, causal=False)):
        assert choose_graph_key(dataclasses.replace(decode, levels=(broken,)), 4, 128, routing) == "triton"
    (chunks,) = prefill.levels
    more_rows = dataclasses.replace(chunks, qo_indptr=np.array([0, 32, 33, 35], dtype=np.int32))
    assert choose_graph_key(dataclasses.replace(prefill, levels=(more_rows,)), 4, 128, routing) == "triton"

    device = SWEEPS["triton"].device
    heads = dict(num_qo_heads=4, num_kv_heads=1, head_dim=16, q_dtype=torch.float32)
    capacity = GraphCapacity(max_query_tokens=40, max_pages=100)
    generator = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(60, 2, 16, 1, 16, generator=generator).to(device)
    import flashinfer_stand_in

    for name in ("triton", "auto"):
        assert create_backend(name, device=device).graph_key is None
        backend = create_backend(name, device=device, capacity=capacity)
        if name == "auto":
            backend._fi_module = flashinfer_stand_in  # FlashInfer is only looked for on CUDA
        for plan, key, qo_lens in ((decode, "triton-narrow", [1, 1, 1]), (prefill, "triton", [32, 1, 1]),
                                   (chunk, "triton-mid", [8, 1, 1]), (decode, "triton-narrow", [1, 1, 1]),
                                   (chunk, "triton-mid", [8, 1, 1])):  # fmt: skip
            # float32: never FlashInfer; decode rows fit the narrow tile (16 rows), 8 queries x 4 heads
            # the middle one (32 rows in the interpreter, 64 on a GPU), 32 x 4 the wide one (64, 128).
            backend.plan(plan, **heads)
            assert backend.graph_key == key
            # The key's launches are the plan's whole work: the output is right.
            q = torch.randn(sum(qo_lens), 4, 16, generator=generator).to(device)
            expected = reference_attention(q, kv_cache, unshared, [300, 310, 20], qo_lens, 16**-0.5)
            torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=2e-5, rtol=2e-5)
        backend.plan(decode, **{**heads, "q_dtype": torch.bfloat16})
        assert backend.graph_key == {"triton": "triton-narrow", "auto": "flashinfer-decode"}[name]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_auto_backend_graphs_replay_across_plans_of_each_key(layout: str) -> None:
    """With a capacity, the auto backend's six launch sets (FlashInfer decode, FlashInfer prefill,
    which also takes decodes of one or two short requests, our Triton cascade with its narrow launch
    alone, which also takes decodes of 8 requests or more, with its middle or its wide tile, and on
    Hopper that cascade with its long shared level on FA3) each replay from one CUDA graph, captured
    at its key's first plan, after later plans of that key with other batch sizes, prefix lengths and
    query counts: every replay against the float64 reference, the padding rows as documented, into a
    contiguous ``out`` and a strided one. A plan over the capacity raises and leaves the backend
    serving plans that fit."""
    pytest.importorskip("flashinfer")
    from prefix_cache.attention.auto_backend import Routing
    from prefix_cache.attention.flashinfer_levels import LevelRule
    from prefix_cache.attention.triton_backend import GraphCapacity

    page_size, hq, hkv, d, dtype, num_pages = 16, 32, 8, 128, torch.bfloat16, 900
    capacity = GraphCapacity(max_query_tokens=48, max_pages=640, max_levels=2)
    backend = create_backend(
        "auto",
        capacity=capacity,
        routing=Routing(prefill_min_tokens=8, prefill_tokens=16),
        level_rule=LevelRule(min_rows=32, min_kv_tokens=1024, min_work=1, min_split_tokens=256),
    )
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
    rng = np.random.default_rng(5 if layout == "contiguous" else 6)
    generator = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=generator).to("cuda", dtype)
    planner = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0)

    def batch(kind: str):
        free = list(rng.permutation(num_pages))
        if kind in ("shared", "wide"):  # 512 tokens shared by 2-8 decodes, or by 33-40 (over 128 rows)
            shared = [free.pop() for _ in range(32)]
            n = int(rng.integers(2, 9)) if kind == "shared" else int(rng.integers(33, 41))
            tables = [np.array([*shared, free.pop()]) for _ in range(n)]
            kv_lens = [512 + int(rng.integers(1, page_size + 1)) for _ in range(n)]
            return tables, kv_lens, [1] * n
        if kind == "mid":  # 8480-8960 shared tokens, 5-7 decodes: 20-28 rows, too long for the narrow tile
            shared = [free.pop() for _ in range(int(rng.integers(530, 561)))]
            n = int(rng.integers(5, 8))
            tables = [np.array([*shared, free.pop()]) for _ in range(n)]
            kv_lens = [len(shared) * page_size + int(rng.integers(1, page_size + 1)) for _ in range(n)]
            return tables, kv_lens, [1] * n
        if kind == "long":  # 1024-4096 shared tokens, 8-12 decodes: 32-48 query rows per KV head
            shared = [free.pop() for _ in range(int(rng.integers(64, 257)))]
            n = int(rng.integers(8, 13))
            tables = [np.array([*shared, free.pop()]) for _ in range(n)]
            kv_lens = [len(shared) * page_size + int(rng.integers(1, page_size + 1)) for _ in range(n)]
            return tables, kv_lens, [1] * n
        n = {"decode": (3, 8), "tiny": (1, 3), "many": (8, 25), "prefill": (1, 3)}[kind]
        n = int(rng.integers(*n))
        qo_lens = [int(rng.integers(16, 24)) for _ in range(n)] if kind == "prefill" else [1] * n
        kv_lens = [int(rng.integers(qo, 257 if kind == "tiny" else 400)) for qo in qo_lens]
        tables = [np.array([free.pop() for _ in range(-(-kv // page_size))]) for kv in kv_lens]
        return tables, kv_lens, qo_lens

    q = torch.zeros(capacity.max_query_tokens, hq, d, dtype=dtype, device="cuda")
    if layout == "contiguous":
        out = torch.zeros_like(q)
    else:
        out = torch.zeros(capacity.max_query_tokens, hq, 2 * d, dtype=dtype, device="cuda")[..., :d]
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    hopper = torch.cuda.get_device_capability()[0] == 9
    keys = {
        "decode": "flashinfer-decode",
        "prefill": "flashinfer-prefill",
        "tiny": "flashinfer-prefill",
        "shared": "triton-narrow",
        "many": "triton-narrow",
        "mid": "triton-mid",
        "wide": "triton",
        "long": "triton+fa3" if hopper else "triton-narrow",
    }
    replayed: dict[str, set[int]] = {}

    def step(kind: str) -> None:
        tables, kv_lens, qo_lens = batch(kind)
        plan = planner.plan(tables, kv_lens, qo_lens, page_size)
        backend.plan(plan, **heads)
        key = backend.graph_key
        assert key == keys[kind]
        nq = plan.num_query_tokens
        q[:nq] = torch.randn(nq, hq, d, generator=generator).to("cuda", dtype)
        if key not in graphs:
            backend.run(q, kv_cache, out=out)  # compiles outside the capture
            torch.cuda.synchronize()
            graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[key]):
                backend.run(q, kv_cache, out=out)
        out.fill_(float("nan"))
        graphs[key].replay()
        expected = reference_attention(q[:nq], kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        got = out[:nq].double()
        # Padding rows: left as they were, or zeroed by FA3 in a contiguous out of the capacity's rows.
        padding = 0.0 if key == "flashinfer-prefill" and layout == "contiguous" else float("nan")
        assert got.isfinite().all(), key
        torch.testing.assert_close(out[nq:], torch.full_like(out[nq:], padding), equal_nan=True, msg=key)
        torch.testing.assert_close(got, expected, atol=1.6e-2 * float(expected.abs().max()), rtol=0, msg=key)
        replayed.setdefault(key, set()).add(nq)

    for kind in ["decode", "prefill", "tiny", "shared", "many", "mid", "wide", "long"] * 3:
        step(kind)
    assert all(len(counts) >= 2 for counts in replayed.values()), replayed  # other row counts replayed
    many = [np.array([i]) for i in range(capacity.max_query_tokens + 1)]
    too_many = planner.plan(many, [5] * len(many), [1] * len(many), page_size)
    with pytest.raises(ValueError, match="49 query tokens, over the backend's capacity of 48"):
        backend.plan(too_many, **heads)
    long = planner.plan([np.arange(641)], [641 * page_size], [16], page_size)
    with pytest.raises(ValueError, match="641 pages, over the backend's capacity of 640"):
        backend.plan(long, **heads)
    with pytest.raises(ValueError, match="launches keep their heads"):
        backend.plan(planner.plan(*batch("decode"), page_size), **{**heads, "num_qo_heads": 16})
    step("decode")
    # Eager, q and out of the plan's rows only (under the capacity's): through the capacity's buffers.
    for kind in ("prefill", "decode"):
        tables, kv_lens, qo_lens = batch(kind)
        backend.plan(planner.plan(tables, kv_lens, qo_lens, page_size), **heads)
        exact = torch.randn(sum(qo_lens), hq, d, generator=generator).to("cuda", dtype)
        expected = reference_attention(exact, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        got = backend.run(exact, kv_cache).double()
        torch.testing.assert_close(got, expected, atol=1.6e-2 * float(expected.abs().max()), rtol=0, msg=kind)


def _one_level_batch(rng: np.random.Generator, kind: str, page_size: int, num_pages: int):
    """Requests over distinct random pages (nothing shared: a one-level plan), one query each
    (decode) or 2-8 (prefill): (block_tables, kv_lens, qo_lens)."""
    n = int(rng.integers(1, 11)) if kind == "decode" else int(rng.integers(1, 4))
    qo_lens = [1] * n if kind == "decode" else [int(rng.integers(2, 9)) for _ in range(n)]
    kv_lens = [int(rng.integers(qo, 40)) for qo in qo_lens]
    free = list(rng.permutation(num_pages))
    tables = [np.array([free.pop() for _ in range(-(-kv // page_size))]) for kv in kv_lens]
    return tables, kv_lens, qo_lens


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["capacity rows", "strided", "plan rows"])
def test_flashinfer_graph_launches_pad_every_plan(kind: str, layout: str) -> None:
    """FlashInfer's CUDA-graph launches on a stand-in that keeps its wrapper's contract
    (``flashinfer_stand_in``): plans of other sizes padded to the one fixed batch after a sizing plan,
    q and out of the capacity's rows, strided, or of the plan's rows; each output against the float64
    reference, the padding rows as documented; plans over the capacity or with other heads raise and
    the next plan is served."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_graphs import OneLevelGraphs
    from prefix_cache.attention.triton_backend import GraphCapacity

    page_size, hq, hkv, d, num_pages = 4, 4, 2, 16, 200
    capacity = GraphCapacity(max_query_tokens=24, max_pages=120)
    graphs = OneLevelGraphs(flashinfer_stand_in, torch.device("cpu"), capacity, 1 << 20)
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=0.25)
    rng = np.random.default_rng(["decode", "prefill"].index(kind))
    generator = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=generator)
    rows = set()
    for step in range(7):
        tables, kv_lens, qo_lens = _one_level_batch(rng, kind, page_size, num_pages)
        plan = CascadePlanner().plan(tables, kv_lens, qo_lens, page_size)
        assert len(plan.levels) == 1
        graphs.plan(kind, plan.levels[0], page_size, heads, (torch.float32, torch.float32))
        nq = plan.num_query_tokens
        rows.add(nq)
        q = torch.randn(
            nq if layout == "plan rows" else capacity.max_query_tokens, hq, d, generator=generator
        )
        if layout == "strided":
            out = torch.full((q.shape[0], hq, 2 * d), float("nan"))[..., :d]
        else:
            out = torch.full_like(q, float("nan"))
        graphs.run(kind, q, kv_cache, out, (1.0, 1.0))
        expected = reference_attention(q[:nq], kv_cache, tables, kv_lens, qo_lens, 0.25)
        torch.testing.assert_close(out[:nq].double(), expected, atol=1e-5, rtol=1e-5)
        zeroed = kind == "prefill" and layout == "capacity rows"  # FA3's padding request
        padding = torch.full_like(out[nq:], 0.0 if zeroed else float("nan"))
        torch.testing.assert_close(out[nq:], padding, equal_nan=True, msg=f"step {step}")
        if step == 3:
            over = CascadePlanner().plan([np.arange(121)], [121 * page_size], [1], page_size)
            with pytest.raises(ValueError, match="121 pages, over the backend's capacity of 120"):
                graphs.plan(kind, over.levels[0], page_size, heads, (torch.float32, torch.float32))
            with pytest.raises(ValueError, match="launches keep their heads"):
                graphs.plan(
                    kind,
                    plan.levels[0],
                    page_size,
                    {**heads, "num_qo_heads": 2},
                    (torch.float32, torch.float32),
                )
            # Refused plans leave the wrappers with the plan before them.
            out.fill_(float("nan"))
            graphs.run(kind, q, kv_cache, out, (1.0, 1.0))
            torch.testing.assert_close(out[:nq].double(), expected, atol=1e-5, rtol=1e-5)
    assert len(rows) >= 3, rows


def test_auto_backend_graph_launches_check_the_pool() -> None:
    """The auto backend under a capacity, its FlashInfer launches on the stand-in: a one-level decode
    of two short requests takes the prefill key, or the decode key when routed there, and is right;
    a pool without the pages the plan reads is refused."""
    import flashinfer_stand_in

    from prefix_cache.attention.auto_backend import AutoBackend, Routing
    from prefix_cache.attention.triton_backend import GraphCapacity

    tables, kv_lens, qo_lens = [np.array([5, 40]), np.array([41])], [7, 3], [1, 1]
    generator = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(42, 2, 4, 2, 16, generator=generator).bfloat16()
    q = torch.randn(2, 4, 16, generator=generator).bfloat16()
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 0.25)
    routes = ((Routing(), "flashinfer-prefill"), (Routing(graph_fa3_decodes=0), "flashinfer-decode"))
    for routing, key in routes:
        capacity = GraphCapacity(max_query_tokens=8, max_pages=64)
        backend = AutoBackend("cpu", capacity=capacity, routing=routing)
        backend._fi_module = flashinfer_stand_in  # FlashInfer is only looked for on CUDA
        backend.plan(CascadePlanner().plan(tables, kv_lens, qo_lens, 4), num_qo_heads=4, num_kv_heads=2,
                     head_dim=16, q_dtype=torch.bfloat16)  # fmt: skip
        assert backend.graph_key == key
        torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=1e-2, rtol=1e-2)
        with pytest.raises(ValueError, match="references page 41, the KV cache has 41 pages"):
            backend.run(q, kv_cache[:41])
    # An fp8 pool under a capacity takes our launches on both routes: FlashInfer's captured decode
    # would apply the V scale to the capture's rows only, its prefill graph (FA3) takes no fp8 KV.
    from prefix_cache.attention.kv_layout import FP8_KV_DTYPE

    for routing, _ in routes:
        backend = AutoBackend(
            "cpu", capacity=GraphCapacity(max_query_tokens=8, max_pages=64), routing=routing
        )
        backend._fi_module = flashinfer_stand_in
        backend.plan(CascadePlanner().plan(tables, kv_lens, qo_lens, 4), num_qo_heads=4, num_kv_heads=2,
                     head_dim=16, q_dtype=torch.bfloat16, kv_dtype=FP8_KV_DTYPE)  # fmt: skip
        assert backend.graph_key.startswith("triton"), backend.graph_key


def test_flashinfer_backend_checks_page_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FlashInfer backend (its prefill wrapper on the stand-in, on CPU) refuses a plan with a
    negative page id at ``plan`` and a pool without the pages the plan reads at ``run``: FlashInfer's
    kernels would read out of bounds. The plan it keeps is right."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_backend import FlashInferBackend

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the backend runs on the stand-in
    tables, kv_lens, qo_lens = [np.array([5, 40]), np.array([41])], [7, 3], [3, 2]
    generator = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(42, 2, 4, 2, 16, generator=generator).bfloat16()
    q = torch.randn(5, 4, 16, generator=generator).bfloat16()
    expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, 0.25)
    backend = FlashInferBackend("cpu", workspace_bytes=1 << 20)
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, q_dtype=torch.bfloat16)
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, 4)
    backend.plan(plan, **heads)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="references page 41, the KV cache has 41 pages"):
        backend.run(q, kv_cache[:41])
    level = plan.levels[0]
    negative = dataclasses.replace(level, kv_indices=np.where(level.kv_indices == 40, -1, level.kv_indices))
    with pytest.raises(ValueError, match="page ids in"):
        backend.plan(dataclasses.replace(plan, levels=(negative,)), **heads)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.run(q, kv_cache)


@pytest.mark.parametrize(
    ("num_qo_heads", "num_kv_heads", "tokens"), [(32, 8, 8), (32, 8, 1024), (32, 1, 1024), (64, 4, 300)]
)
def test_flashinfer_decode_workspace_fits_the_capacity(
    num_qo_heads: int, num_kv_heads: int, tokens: int
) -> None:
    """The decode launches' workspace holds what FlashInfer's scheduler asks of it for the capacity
    (the stand-in raises otherwise), at most 2.5x that: small and large buckets, groups of 4, 16 and 32."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_graphs import OneLevelGraphs
    from prefix_cache.attention.triton_backend import GraphCapacity

    capacity = GraphCapacity(max_query_tokens=tokens, max_pages=64)
    graphs = OneLevelGraphs(flashinfer_stand_in, torch.device("cpu"), capacity, 1 << 20)
    plan = CascadePlanner().plan([np.array([i]) for i in range(3)], [5, 9, 16], [1, 1, 1], 16)
    heads = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=128, sm_scale=0.1)
    graphs.plan("decode", plan.levels[0], 16, heads, (torch.bfloat16, torch.bfloat16))
    wrapper = graphs._wrappers["decode"]
    assert wrapper.need <= wrapper.workspace.numel() <= 2.5 * wrapper.need


@pytest.mark.parametrize(
    "page, message", [(5, "references page 5, the KV cache has 5 pages"), (-1, "page -1")]
)
def test_torch_backend_checks_the_pages_a_plan_reads(page, message) -> None:
    # A page id outside the pool is a clear error naming it (not an IndexError from the gather), and
    # a negative one is never read as a page from the pool's end.
    from prefix_cache.planner.plan import CascadePlan

    level = CascadeLevel(*(np.asarray(a, np.int32) for a in ([0, 1], [0, 2], [0, page], [4])), True)
    plan = CascadePlan((level,), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int64), 4)
    backend = TorchBackend()
    q, kv_cache = torch.randn(1, 2, 16), torch.randn(5, 2, 4, 1, 16)
    with pytest.raises(ValueError, match=message):
        backend.plan(plan, num_qo_heads=2, num_kv_heads=1, head_dim=16, q_dtype=torch.float32)
        backend.run(q, kv_cache)

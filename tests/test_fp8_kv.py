"""An fp8 (e4m3) KV cache: quantizing into it (``append_kv``, ``quantize_fp8``), attention over it in
the kernels and every backend, and the checks of its scales.

Attention is compared with a float64 reference computed on the dequantized cache (stored value x
scale), so the tolerance is that of the 16/32-bit computation, not of fp8 rounding; outputs start as
NaN and must come out finite. Without CUDA the kernels run in Triton's interpreter (small cases);
the cases marked ``gpu`` run at real sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_reference import reference_attention

from prefix_cache.attention import create_backend
from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, FP8_MAX, quantize_fp8
from prefix_cache.planner.cost_model import default_cost_model
from prefix_cache.planner.planner import CascadePlanner

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# Scales far from 1 and from each other: a scale dropped, applied twice or swapped fails.
K_SCALE, V_SCALE = 0.37, 2.5
BAD_SCALES = [0.0, -1.0, float("nan"), float("inf")]


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, ascending, float64 (from the bit patterns)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_KV_DTYPE).double()
    return values[values.isfinite()].unique()


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The reference quantizer, independent of torch's conversion: each float64 value of ``x``
    saturated at +-448 and moved to the nearest e4m3 value, a tie to the one with an even mantissa;
    the sign of a zero kept."""
    grid = _e4m3_values()
    clamped = x.double().clamp(-FP8_MAX, FP8_MAX)
    i = torch.searchsorted(grid, clamped).clamp(1, grid.numel() - 1)
    lo, hi = grid[i - 1], grid[i]
    take_hi = (hi - clamped) < (clamped - lo)
    tie = (hi - clamped) == (clamped - lo)
    hi_bits = hi.to(FP8_KV_DTYPE).view(torch.uint8)
    take_hi |= tie & (hi_bits % 2 == 0)
    out = torch.where(take_hi, hi, lo)
    return torch.where(out == 0, torch.copysign(torch.zeros_like(out), clamped), out)


def _hard_values(n_random: int = 600) -> torch.Tensor:
    """float32 values that test a quantizer: every e4m3 value, the midpoints between neighbours and
    the floats next to them, values past the range (saturation), infinities, tiny and random ones."""
    grid = _e4m3_values()
    grid = torch.cat([grid, -grid])
    grid = grid.unique()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    big = torch.full_like(mids, 1e9)
    extra = torch.tensor(
        [449.0, 464.0, 465.0, 1e6, float("inf"), -449.0, -464.0, -1e6, float("-inf"), -1e-12]
    )
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(n_random, generator=generator) * torch.logspace(-4, 3, n_random)
    return torch.cat([grid.float(), mids, mids.nextafter(big), mids.nextafter(-big), extra, random])


def test_quantize_fp8_rounds_to_the_nearest_e4m3_value() -> None:
    """The library's torch quantizer against the grid search, bit for bit, scales included."""
    x = _hard_values()
    for scale in (1.0, 0.5, 3.0):
        got = quantize_fp8(x * scale, scale)
        want = _nearest_e4m3((x * scale).float() * torch.tensor(1 / scale, dtype=torch.float32))
        assert torch.equal(got.view(torch.uint8), want.to(FP8_KV_DTYPE).view(torch.uint8)), scale


def _pool(num_pages: int, page_size: int, heads: int, dim: int, layout: str, device: str = "cpu"):
    """An fp8 pool of ``layout`` ("nhd": one 5-D tensor; "hnd": K and V as transposed views of
    [pages, H, page_size, D]) on ``device``, filled with NaN bits, so an unwritten slot cannot
    pass."""
    if layout == "nhd":
        pool = torch.full((num_pages, 2, page_size, heads, dim), float("nan"), device=device).to(FP8_KV_DTYPE)
        return pool, pool[:, 0], pool[:, 1]
    k = torch.full((num_pages, heads, page_size, dim), float("nan"), device=device).to(FP8_KV_DTYPE)
    v = torch.full((num_pages, heads, page_size, dim), float("nan"), device=device).to(FP8_KV_DTYPE)
    return (k.transpose(1, 2), v.transpose(1, 2)), k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize(("layout", "dtype"), [("nhd", torch.bfloat16), ("hnd", torch.float32)])
def test_append_kv_quantizes_bit_for_bit(layout: str, dtype: torch.dtype) -> None:
    """``append_kv`` into an fp8 pool stores exactly ``quantize_fp8`` of K and V with their scales
    (saturating, rounding ties to even); slots of -1 are skipped; the dequantized values are within
    half an e4m3 step of the input. The kernel runs on the GPU where there is one (else in Triton's
    interpreter); the reference quantizer on the CPU."""
    from prefix_cache.kernels import append_kv

    device = "cuda" if HAS_CUDA else "cpu"

    heads, dim, page_size = 2, 32, 8
    values = _hard_values().to(dtype).float()
    n = -(-values.numel() // (heads * dim))
    values = torch.cat([values, torch.zeros(n * heads * dim - values.numel())]).view(n, heads, dim)
    k, v = values.to(dtype), (values.flip(0) * 3).to(dtype)
    slots = torch.randperm(n + 5, generator=torch.Generator().manual_seed(1))[:n]
    slots[3] = -1
    num_pages = -(-(n + 5) // page_size)
    pool, k_pool, v_pool = _pool(num_pages, page_size, heads, dim, layout, device)
    append_kv(pool, k.to(device), v.to(device), slots.to(device), k_scale=K_SCALE, v_scale=V_SCALE)
    k_pool, v_pool = k_pool.cpu(), v_pool.cpu()
    written = slots >= 0
    pages, offsets = slots[written] // page_size, slots[written] % page_size
    for stored, x, scale in ((k_pool, k, K_SCALE), (v_pool, v, V_SCALE)):
        got = stored[pages, offsets]
        want = quantize_fp8(x[written], scale)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # The round trip: within half a step of the e4m3 grid (relative 2**-4, absolute 2**-10 near 0).
        back, ref = got.double() * scale, x[written].double().clamp(-FP8_MAX * scale, FP8_MAX * scale)
        assert ((back - ref).abs() <= ref.abs() * 2**-4 + 2**-10 * scale).all()
    skipped = torch.ones(num_pages * page_size, dtype=torch.bool)
    skipped[slots[written]] = False
    assert k_pool.reshape(-1, heads, dim)[skipped].float().isnan().all()


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_bad_scales_are_refused_and_nothing_is_written(scale: float) -> None:
    from prefix_cache.kernels import append_kv, level_attention

    pool = torch.zeros(2, 2, 4, 1, 16, dtype=FP8_KV_DTYPE)
    k = torch.ones(3, 1, 16)
    slots = torch.arange(3)
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} must be a positive finite number"):
            append_kv(pool, k, k, slots, **{name: scale})
        assert not pool.float().any()
        with pytest.raises(ValueError, match=f"{name} must be a positive finite number"):
            level_attention(
                torch.ones(1, 2, 16), pool, *(np.array(a) for a in ([0, 1], [0, 1], [0], [3])), causal=True,
                **{name: scale},
            )  # fmt: skip
    backend = create_backend("torch")
    backend.plan(CascadePlanner().plan([[0]], [3], [1], 4), num_qo_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
        backend.run(torch.ones(1, 2, 16), pool, v_scale=scale)


def test_scales_need_an_fp8_cache_and_dtypes_are_checked() -> None:
    from prefix_cache.kernels import append_kv

    pool = torch.zeros(2, 2, 4, 1, 16)
    with pytest.raises(ValueError, match="for an fp8 KV cache"):
        append_kv(pool, torch.ones(1, 1, 16), torch.ones(1, 1, 16), torch.arange(1), k_scale=2.0)
    fp8 = pool.to(FP8_KV_DTYPE)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        append_kv(fp8, fp8[0, 0, :1], fp8[0, 0, :1], torch.arange(1))
    backend = create_backend("torch")
    plan = CascadePlanner().plan([[0]], [3], [1], 4)
    heads = dict(num_qo_heads=2, num_kv_heads=1, head_dim=16)
    backend.plan(plan, **heads)
    with pytest.raises(ValueError, match="for an fp8 KV cache"):
        backend.run(torch.ones(1, 2, 16), pool, k_scale=1.0)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        backend.plan(plan, **heads, q_dtype=torch.float32, kv_dtype=torch.int8)
    # A plan for an fp8 cache takes no other cache, and one for a bf16 cache no fp8 one.
    backend.plan(plan, **heads, q_dtype=torch.float32, kv_dtype=FP8_KV_DTYPE)
    with pytest.raises(ValueError, match="share one of"):
        backend.run(torch.ones(1, 2, 16), pool)
    backend.plan(plan, **heads, q_dtype=torch.float32)
    with pytest.raises(ValueError, match="share one of"):
        backend.run(torch.ones(1, 2, 16), fp8)


def _random_fp8_pool(num_pages, page_size, hkv, d, generator, device=DEVICE):
    """An fp8 NHD pool of random values spread over the e4m3 range (stored values up to ~40), and
    its dequantized float64 copy (K x K_SCALE, V x V_SCALE)."""
    raw = torch.randn(num_pages, 2, page_size, hkv, d, generator=generator) * 8
    pool = raw.to(FP8_KV_DTYPE).to(device)
    deq = pool.double()
    deq[:, 0] *= K_SCALE
    deq[:, 1] *= V_SCALE
    return pool, deq


def _ref_level(q, deq, groups, causal, sm_scale):
    """float64 (out, lse) of one level, group by group: groups are (q rows, pages, kv_len)."""
    nq, hq, d = q.shape
    out = torch.zeros(nq, hq, d, dtype=torch.float64)
    lse = torch.full((nq, hq), -math.inf, dtype=torch.float64)
    group = hq // deq.shape[3]
    for rows, pages, kv_len in groups:
        kv = deq[torch.as_tensor(pages)].cpu()  # [p, 2, ps, Hkv, D]
        k = kv[:, 0].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        v = kv[:, 1].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[rows].cpu().double(), k) * sm_scale
        if causal:
            j = torch.arange(len(rows))[:, None]
            s = s.masked_fill(torch.arange(kv_len)[None, :] > kv_len - len(rows) + j, -math.inf)
        lse[rows] = torch.logsumexp(s, -1).T
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out, lse


def _check_level(
    q, pool, deq, q_lens, kv_lens, page_size, causal, kv_chunk_size, atol,
    k_scale=K_SCALE, v_scale=V_SCALE, lse_rtol=0.0,
):  # fmt: skip
    """One level over ``pool`` (pages shuffled) against the float64 reference on ``deq``: out within
    ``atol`` of its largest value, LSE within 1e-4 (plus ``lse_rtol`` of its magnitude)."""
    from prefix_cache.kernels import level_attention

    generator = torch.Generator().manual_seed(7)
    num_pages = pool.shape[0]
    counts = [-(-n // page_size) for n in kv_lens]
    perm = torch.randperm(num_pages, generator=generator)[: sum(counts)].numpy()
    kv_indptr = np.concatenate([[0], np.cumsum(counts)])
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)])
    last = np.array([n - (c - 1) * page_size for n, c in zip(kv_lens, counts, strict=True)])
    out, lse = level_attention(
        q, pool, qo_indptr, kv_indptr, perm, last, causal=causal, kv_chunk_size=kv_chunk_size,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    groups = [
        (list(range(qo_indptr[g], qo_indptr[g + 1])), perm[kv_indptr[g] : kv_indptr[g + 1]], kv_lens[g])
        for g in range(len(q_lens))
    ]
    ref_out, ref_lse = _ref_level(q, deq, groups, causal, q.shape[2] ** -0.5)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    scale = ref_out.abs().max().item()
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=atol * scale, rtol=0)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=lse_rtol)


@pytest.mark.parametrize(
    ("q_dtype", "causal", "kv_chunk_size"),
    [(torch.float32, True, None), (torch.float32, False, 16), (torch.bfloat16, True, 16)],
)
def test_level_attention_reads_fp8(q_dtype, causal, kv_chunk_size) -> None:
    """Decode and prefill groups (causal), a shared-level shape (non-causal) and split KV."""
    generator = torch.Generator().manual_seed(3)
    hq, hkv, d, page_size = 4, 2, 32, 4
    pool, deq = _random_fp8_pool(24, page_size, hkv, d, generator)
    q_lens, kv_lens = ([1, 5, 1], [13, 21, 7]) if causal else ([3, 2], [30, 9])
    q = torch.randn(sum(q_lens), hq, d, generator=generator).to(DEVICE, q_dtype)
    atol = 2e-5 if q_dtype == torch.float32 and not HAS_CUDA else 2e-2
    _check_level(q, pool, deq, q_lens, kv_lens, page_size, causal, kv_chunk_size, atol)


@pytest.mark.parametrize(
    ("q_exponent", "subnormal"),
    [(0, True), (-100, False), (100, False), (110, False), (-120, False)],
    ids=["subnormal-kv", "q-2^-100", "q-2^100", "q-2^110", "q-2^-120"],
)
def test_fp8_attention_holds_at_extreme_magnitudes(q_exponent: int, subnormal: bool) -> None:
    """Queries of magnitude 2**-120 (beside K scales that keep their scores of order one) to 2**110,
    and K/V made only of e4m3 subnormals (scaled to matter), give the float64 attention over the
    dequantized cache: the conversion of every e4m3 value is exact and the dots neither overflow nor
    lose small products (a conversion by bit moves that read K/V times 2**-120 needed a power of
    two on q for this: benchmarks/NOTES.md, "fp8 tiles by bit moves"). Runs under the interpreter
    here (which reads bf16 subnormals inexactly, so q has none) and at these sizes on a GPU."""
    generator = torch.Generator().manual_seed(11)
    hq, hkv, d, page_size, num_pages = 4, 2, 32, 4, 16
    # Small queries meet large K scales, so their scores still matter (2**-120 x 2**116).
    k_scale, v_scale = (K_SCALE, V_SCALE) if q_exponent >= 0 else (2.0 ** min(-q_exponent - 4, 126), V_SCALE)
    if subnormal:  # every byte an e4m3 subnormal (magnitude 1-7, either sign)
        bits = torch.randint(1, 8, (num_pages, 2, page_size, hkv, d), generator=generator)
        bits |= torch.randint(0, 2, bits.shape, generator=generator) << 7
        pool = bits.to(torch.uint8).view(FP8_KV_DTYPE)
        k_scale = v_scale = 2.0**10  # stored values of 2**-9 .. 7 * 2**-9 read as 2 .. 14
    else:
        pool = (torch.randn(num_pages, 2, page_size, hkv, d, generator=generator) * 8).to(FP8_KV_DTYPE)
    deq = pool.double()
    deq[:, 0] *= k_scale
    deq[:, 1] *= v_scale
    base = torch.randn(4, hq, d, generator=generator).double()
    q = (base.sign() * (1 + base.abs()) * 2.0**q_exponent).to(torch.bfloat16)  # |q| >= 2**q_exponent
    assert q.isfinite().all() and (q.abs() >= 2.0**-126).all()
    atol = 2e-5 if not HAS_CUDA else 1.6e-2
    _check_level(
        q.to(DEVICE), pool.to(DEVICE), deq, [1, 3], [17, 30], page_size, True, None, atol,
        k_scale=k_scale, v_scale=v_scale, lse_rtol=1e-5,
    )  # fmt: skip


def _cascade_batch(generator, page_size=4):
    """Four requests under one shared system prefix, two sharing more: prefill chunks and decodes."""
    prefix = list(range(6))
    tables = [[*prefix, 6, 7, 8, 9 + i] for i in range(2)] + [
        [*prefix, 11 + 2 * i, 12 + 2 * i] for i in range(2)
    ]
    kv_lens = [38, 37, 30, 29]
    qo_lens = [1, 5, 1, 3]
    return [np.array(t, dtype=np.int32) for t in tables], kv_lens, qo_lens


@pytest.mark.parametrize("name", ["torch", "triton", "triton-capacity", "auto"])
def test_backends_read_fp8_cascades(name: str) -> None:
    """A cascade plan (shared levels, then the causal level) over an fp8 pool on every backend that
    runs on this machine, against the float64 attention from page tables over the dequantized pool;
    the fixed-capacity (CUDA-graph) backend over two plans."""
    from prefix_cache.attention.triton_backend import GraphCapacity

    if name != "torch":
        pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(5)
    hq, hkv, d, page_size = 4, 2, 16, 4
    pool, deq = _random_fp8_pool(16, page_size, hkv, d, generator)
    kwargs = {"device": DEVICE}
    if name == "triton-capacity":
        kwargs["capacity"] = GraphCapacity(max_query_tokens=16, max_pages=48, max_levels=3)
    backend = create_backend(name.removesuffix("-capacity"), **kwargs)
    planner = CascadePlanner(min_shared_tokens=4, min_saved_tokens=4)
    tables, kv_lens, qo_lens = _cascade_batch(generator)
    for step in range(2 if name == "triton-capacity" else 1):
        if step:  # the next step: decodes only
            kv_lens, qo_lens = [n + 1 for n in kv_lens], [1, 1, 1, 1]
        plan = planner.plan(tables, kv_lens, qo_lens, page_size)
        assert len(plan.levels) > 1
        backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float32,
                     kv_dtype=FP8_KV_DTYPE)  # fmt: skip
        q = torch.randn(sum(qo_lens), hq, d, generator=generator).to(DEVICE)
        out = torch.full_like(q, float("nan"))
        backend.run(q, pool, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
        expected = reference_attention(q.cpu(), deq.cpu(), tables, kv_lens, qo_lens, d**-0.5)
        assert torch.isfinite(out).all()
        tol = 2e-5 if not HAS_CUDA else 2e-2
        torch.testing.assert_close(
            out.cpu().double(), expected, atol=tol * expected.abs().max().item(), rtol=0
        )


def test_flashinfer_graph_decode_passes_fp8_and_its_scales() -> None:
    """FlashInfer's CUDA-graph decode launches plan an fp8 cache as ``kv_data_type`` and pass the
    layer's scales to ``run`` (on the stand-in, which reads KV as stored x scale); its prefill
    launches refuse an fp8 cache (FA3 takes none beside a 16-bit q)."""
    import flashinfer_stand_in

    from prefix_cache.attention.flashinfer_graphs import OneLevelGraphs
    from prefix_cache.attention.triton_backend import GraphCapacity

    generator = torch.Generator().manual_seed(2)
    hq, hkv, d, page_size = 4, 2, 16, 4
    pool, deq = _random_fp8_pool(40, page_size, hkv, d, generator, device="cpu")
    graphs = OneLevelGraphs(flashinfer_stand_in, torch.device("cpu"), GraphCapacity(8, 40), 1 << 20)
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=d**-0.5)
    tables = [np.arange(8 * i, 8 * i + 8, dtype=np.int32) for i in range(3)]
    kv_lens, qo_lens = [29, 17, 32], [1, 1, 1]
    plan = CascadePlanner(max_levels=1).plan(tables, kv_lens, qo_lens, page_size)
    dtypes = (torch.float32, FP8_KV_DTYPE)
    graphs.plan("decode", plan.levels[0], page_size, heads, dtypes)
    q = torch.randn(3, hq, d, generator=generator)
    out = torch.full_like(q, float("nan"))
    graphs.run("decode", q, pool, out, (K_SCALE, V_SCALE))
    expected = reference_attention(q, deq, tables, kv_lens, qo_lens, d**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="decode wrapper only"):
        graphs.plan("prefill", plan.levels[0], page_size, heads, dtypes)


def test_auto_backend_keeps_fp8_shared_levels_off_fa3() -> None:
    """On the Triton route, a shared level that FA3 takes at fp16 (a stand-in FlashInfer on CPU)
    stays on our kernels over an fp8 pool (FA3 takes fp8 KV only beside an fp8 q), and the plan
    matches the reference."""
    pytest.importorskip("triton")
    import flashinfer_stand_in

    from prefix_cache.attention.auto_backend import Routing
    from prefix_cache.attention.flashinfer_levels import LevelRule, SharedLevelsOnFlashInfer

    page, hq, hkv, d = 4, 4, 2, 64
    generator = torch.Generator().manual_seed(12)
    pool, deq = _random_fp8_pool(40, page, hkv, d, generator)
    tables = [np.r_[np.arange(9), 20 + 3 * r, 21 + 3 * r, 22 + 3 * r] for r in range(3)]  # 36 shared tokens
    kv_lens, qo_lens = [38, 45, 39], [1, 8, 2]
    plan = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0).plan(tables, kv_lens, qo_lens, page)
    rule = LevelRule(min_rows=4, min_kv_tokens=12, min_work=1, min_split_tokens=8)
    routes = {}
    for kv_dtype in (torch.float16, FP8_KV_DTYPE):
        backend = create_backend("auto", device=DEVICE, routing=Routing(prefill_min_tokens=10**6))
        backend._fi_module = flashinfer_stand_in  # FlashInfer is only looked for on CUDA
        backend._triton._shared_levels = SharedLevelsOnFlashInfer(
            flashinfer_stand_in, torch.device(DEVICE), rule
        )
        backend.plan(
            plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float16, kv_dtype=kv_dtype
        )
        routes[kv_dtype] = backend.route
    assert routes == {torch.float16: "triton+fa3", FP8_KV_DTYPE: "triton"}
    q = torch.randn(sum(qo_lens), hq, d, generator=generator).half().to(DEVICE)
    out = backend.run(q, pool, k_scale=K_SCALE, v_scale=V_SCALE)
    expected = reference_attention(q.cpu(), deq.cpu(), tables, kv_lens, qo_lens, d**-0.5)
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-3 * expected.abs().max().item(), rtol=0)


def test_cost_model_weighs_fp8_reads_at_half_the_bytes() -> None:
    """The time of reading KV halves at fp8; the rest of the estimate is unchanged."""
    from prefix_cache.planner.cost_model import PlanFeatures

    bf16 = default_cost_model()
    fp8 = bf16.for_kv_itemsize(1)
    assert fp8.kv_itemsize == 1 and fp8.for_kv_itemsize(2) == bf16
    reads = PlanFeatures(levels=1, launches=1, merge=0, kv_tokens=1e6, pairs=0, chain_steps=0, work_items=0)
    none = PlanFeatures(levels=1, launches=1, merge=0, kv_tokens=0, pairs=0, chain_steps=0, work_items=0)
    assert fp8.time_us(none) == bf16.time_us(none)
    assert fp8.time_us(reads) - fp8.time_us(none) == pytest.approx(
        (bf16.time_us(reads) - bf16.time_us(none)) / 2
    )


# ----------------------------------------------------------------------------------------------
# On the GPU, at real sizes


@gpu
@pytest.mark.gpu
def test_gpu_append_kv_quantizes_bit_for_bit() -> None:
    """The kernel's fp8 bits on the GPU equal ``quantize_fp8`` on the CPU: 4096 bf16 tokens of Llama
    shapes into a shuffled pool, and the hard values (midpoints, saturation, subnormals)."""
    from prefix_cache.kernels import append_kv

    generator = torch.Generator().manual_seed(0)
    heads, dim, page_size = 8, 128, 16
    hard = _hard_values().to(torch.bfloat16).float()
    n = 4096
    k = torch.randn(n, heads, dim, generator=generator) * torch.logspace(-5, 3, n)[:, None, None]
    k.view(-1)[: hard.numel()] = hard
    k = k.to(torch.bfloat16)
    v = (torch.randn(n, heads, dim, generator=generator) * 3).to(torch.bfloat16)
    slots = torch.randperm(2 * n, generator=generator)[:n]
    pool = torch.zeros(2 * n // page_size, 2, page_size, heads, dim, dtype=FP8_KV_DTYPE, device="cuda")
    append_kv(pool, k.cuda(), v.cuda(), slots.cuda(), k_scale=K_SCALE, v_scale=V_SCALE)
    stored = pool.cpu()[slots // page_size, :, slots % page_size]  # [n, 2, heads, dim]
    for i, (x, scale) in enumerate(((k, K_SCALE), (v, V_SCALE))):
        assert torch.equal(stored[:, i].view(torch.uint8), quantize_fp8(x, scale).view(torch.uint8))


def _gpu_pool(num_pages, page_size, hkv, d, seed):
    generator = torch.Generator().manual_seed(seed)
    return _random_fp8_pool(num_pages, page_size, hkv, d, generator, device="cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("q_lens", "kv_lens", "causal"),
    [
        ([1] * 64, [2048] * 64, True),  # decode
        ([512, 300], [4096, 300], True),  # prefill chunks
        ([64], [20000], False),  # a shared level: one group of many rows, split KV
        ([1, 1], [20000, 9000], True),  # long decodes: split KV
    ],
    ids=["decode", "prefill", "shared", "long-decode"],
)
def test_gpu_level_attention_reads_fp8(q_lens, kv_lens, causal) -> None:
    """Llama-3-8B heads (32/8, d128), bf16 q, an fp8 pool: output and LSE against the float64
    reference on the dequantized pool."""
    hq, hkv, d, page_size = 32, 8, 128, 16
    pool, deq = _gpu_pool(sum(-(-n // page_size) for n in kv_lens) + 8, page_size, hkv, d, 1)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    _check_level(q, pool, deq.cpu(), q_lens, kv_lens, page_size, causal, None, atol=1.6e-2)


def _gpu_batch(kind: str, rng: np.random.Generator, num_pages: int, page_size: int):
    free = list(rng.permutation(num_pages))
    if kind in ("shared", "wide"):  # 1024 shared tokens under 4-8 or 40 decodes
        shared = [free.pop() for _ in range(64)]
        n = int(rng.integers(4, 9)) if kind == "shared" else 40
        tables = [np.array([*shared, free.pop(), free.pop()]) for _ in range(n)]
        kv_lens = [1024 + int(rng.integers(1, 2 * page_size + 1)) for _ in range(n)]
        return tables, kv_lens, [1] * n
    n = {"decode": (3, 8), "many": (12, 25), "prefill": (1, 3)}[kind]
    n = int(rng.integers(*n))
    qo_lens = [int(rng.integers(16, 24)) for _ in range(n)] if kind == "prefill" else [1] * n
    kv_lens = [int(rng.integers(qo + 100, 700)) for qo in qo_lens]  # 44 pages at most: 24 fit the pool
    tables = [np.array([free.pop() for _ in range(-(-kv // page_size))]) for kv in kv_lens]
    return tables, kv_lens, qo_lens


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "auto", "flashinfer"])
def test_gpu_backends_read_fp8(name: str) -> None:
    """Every backend, eager, over an fp8 pool: decodes, prefill chunks, cascades with a shared level
    (FlashInfer runs those level by level with the scales), against the float64 reference on the
    dequantized pool."""
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    hq, hkv, d, page_size, num_pages = 32, 8, 128, 16, 1200
    pool, deq = _gpu_pool(num_pages, page_size, hkv, d, 3)
    backend = create_backend(name, device="cuda")
    planner = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0)
    rng = np.random.default_rng(4)
    generator = torch.Generator().manual_seed(4)
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.bfloat16, kv_dtype=FP8_KV_DTYPE)
    for kind in ("decode", "prefill", "shared", "many", "wide"):
        tables, kv_lens, qo_lens = _gpu_batch(kind, rng, num_pages, page_size)
        plan = planner.plan(tables, kv_lens, qo_lens, page_size)
        backend.plan(plan, **heads)
        q = torch.randn(sum(qo_lens), hq, d, generator=generator).to("cuda", torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        backend.run(q, pool, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
        expected = reference_attention(q, deq, tables, kv_lens, qo_lens, d**-0.5)
        assert out.isfinite().all(), kind
        atol = 1.6e-2 * float(expected.abs().max())
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0, msg=f"{name} {kind}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "auto"])
def test_gpu_fp8_plans_replay_from_cuda_graphs(name: str) -> None:
    """Fixed-capacity backends over an fp8 pool: each graph key's launches captured once (scales
    included) and replayed after later plans of other sizes, against the reference; the auto
    backend's fp8 plans never take FA3 (no ``flashinfer-prefill`` or ``triton+fa3`` key)."""
    from prefix_cache.attention.triton_backend import GraphCapacity

    hq, hkv, d, page_size, num_pages = 32, 8, 128, 16, 1200
    pool, deq = _gpu_pool(num_pages, page_size, hkv, d, 6)
    capacity = GraphCapacity(max_query_tokens=64, max_pages=1200, max_levels=2)
    backend = create_backend(name, device="cuda", capacity=capacity)
    planner = CascadePlanner(min_shared_tokens=256, min_saved_tokens=0)
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.bfloat16, kv_dtype=FP8_KV_DTYPE)
    rng = np.random.default_rng(7)
    generator = torch.Generator().manual_seed(7)
    q = torch.zeros(capacity.max_query_tokens, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(q)
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for kind in ["decode", "prefill", "shared", "many", "wide"] * 2:
        tables, kv_lens, qo_lens = _gpu_batch(kind, rng, num_pages, page_size)
        plan = planner.plan(tables, kv_lens, qo_lens, page_size)
        backend.plan(plan, **heads)
        key = backend.graph_key
        assert key not in ("flashinfer-prefill", "triton+fa3"), key
        nq = plan.num_query_tokens
        q[:nq] = torch.randn(nq, hq, d, generator=generator).to("cuda", torch.bfloat16)
        if key not in graphs:
            backend.run(q, pool, out=out, k_scale=K_SCALE, v_scale=V_SCALE)  # compiles outside the capture
            torch.cuda.synchronize()
            graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[key]):
                backend.run(q, pool, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
        out.fill_(float("nan"))
        graphs[key].replay()
        expected = reference_attention(q[:nq], deq, tables, kv_lens, qo_lens, d**-0.5)
        assert out[:nq].isfinite().all(), key
        atol = 1.6e-2 * float(expected.abs().max())
        torch.testing.assert_close(out[:nq].double(), expected, atol=atol, rtol=0, msg=f"{name} {key} {kind}")

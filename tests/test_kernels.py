"""The Triton kernels and the triton backend against float64 references in torch.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so the CPU cases are small;
the cases marked ``gpu`` use realistic shapes and skip without CUDA. Outputs are filled with NaN
before each kernel so that an element the kernel fails to write cannot pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from prefix_cache.kernels.attention import launch_level, level_attention, offset_widths, plan_level
from prefix_cache.kernels.kv_append import append_kv
from prefix_cache.kernels.merge_state import merge_states, merge_states_varlen
from prefix_cache.kernels.work import tile_config

from prefix_cache.attention.kv_layout import split_kv_cache
from prefix_cache.attention.triton_backend import GraphCapacity, TritonBackend
from prefix_cache.planner.plan import CascadeLevel, CascadePlan
from prefix_cache.planner.planner import CascadePlanner

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

# Tolerances against a float64 reference, relative to the reference output's largest magnitude (an
# average over thousands of random values is small: an absolute tolerance would pass a lost split).
# In the interpreter every dtype is computed in fp32 after loading, so only the final rounding to the
# output dtype differs; on the GPU the P @ V product runs with P rounded to fp16/bf16.
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}
# The LSE is accumulated in fp32 from exact products of the (rounded) inputs: tight for every dtype.
# A page of 16 tokens skipped out of 20000 moves it by 8e-4.
LSE_ATOL = 1e-4


# ----------------------------------------------------------------------------------------------
# Helpers: random paged levels and a float64 reference


def _pages_for(lengths: list[int], page_size: int, num_pages: int, gen: torch.Generator):
    """Distinct random pages for segments of ``lengths`` tokens: (kv_indptr, kv_indices, last_page_len)."""
    counts = [-(-n // page_size) for n in lengths]
    perm = torch.randperm(num_pages, generator=gen).numpy()
    assert sum(counts) <= num_pages
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = perm[: sum(counts)].astype(np.int32)
    last = np.array(
        [n - (c - 1) * page_size if c else 0 for n, c in zip(lengths, counts, strict=True)], dtype=np.int32
    )
    return indptr, indices, last


def _gather_kv(kv_cache: torch.Tensor, pages: np.ndarray, length: int):
    """K and V of a segment, float64 [length, Hkv, D] each."""
    ps = kv_cache.shape[2]
    pos = torch.arange(length, device=kv_cache.device)
    page_ids = torch.as_tensor(pages, dtype=torch.long, device=kv_cache.device)[pos // ps]
    kv = kv_cache[page_ids, :, pos % ps].cpu().double()  # [length, 2, Hkv, D]
    return kv[:, 0], kv[:, 1]


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float):
    """q [Q, Hq, D], k/v [L, Hkv, D] float64 -> out [Q, Hq, D], lse [Q, Hq] (natural log, -inf empty)."""
    nq, hq, d = q.shape
    group = hq // k.shape[1]
    if k.shape[0] == 0 or nq == 0:
        return torch.zeros(nq, hq, d, dtype=torch.float64), torch.full(
            (nq, hq), -math.inf, dtype=torch.float64
        )
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if causal:
        length = k.shape[0]
        j = torch.arange(nq)[:, None]
        s = s.masked_fill(torch.arange(length)[None, :] > length - nq + j, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse.T


def _ref_level(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last, causal, sm_scale):
    ps = kv_cache.shape[2]
    outs, lses = [], []
    for g in range(len(last)):
        npages = kv_indptr[g + 1] - kv_indptr[g]
        length = (npages - 1) * ps + last[g] if npages else 0
        k, v = _gather_kv(kv_cache, kv_indices[kv_indptr[g] : kv_indptr[g + 1]], int(length))
        o, s = _ref_attention(q[qo_indptr[g] : qo_indptr[g + 1]].cpu().double(), k, v, causal, sm_scale)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def _assert_close(out, lse, ref_out, ref_lse, tol):
    """out within ``tol`` x the reference's largest magnitude everywhere; the LSE within LSE_ATOL;
    -inf exactly where the reference has no KV; NaN never."""
    out, lse = out.cpu().double(), lse.cpu().double()
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "empty queries must get lse -inf, others finite"
    scale = max(float(ref_out.abs().max()), 1e-3) if ref_out.numel() else 1.0
    torch.testing.assert_close(out, ref_out, atol=tol * scale, rtol=0)
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=LSE_ATOL, rtol=0)


# Groups as (query tokens, KV tokens): no queries, no KV, one query, several, KV shorter than the
# queries (causal: early queries see nothing), and KV spanning several KV tiles and splits.
CPU_GROUPS = [(2, 37), (0, 9), (3, 0), (1, 150), (5, 3), (4, 20)]


def _run_level(q, kv_cache, arrays, causal, sm_scale, kv_chunk_size, out_dtype):
    """plan_level + launch_level + merge into NaN-poisoned buffers; returns (out, lse, splits)."""
    qo, kvp, idx, last = arrays
    nq, hq, d = q.shape
    sched = plan_level(
        qo, kvp, idx, last, causal=causal, page_size=kv_cache.shape[2], num_qo_heads=hq,
        num_kv_heads=kv_cache.shape[3], head_dim=d, device=q.device, kv_chunk_size=kv_chunk_size,
    )  # fmt: skip
    counts = torch.from_numpy(sched.splits.astype(np.int64)).to(q.device)
    starts = torch.cumsum(counts, 0) - counts
    rows = int(counts.sum())
    part_o = torch.full((rows, hq, d), math.nan, dtype=torch.float32, device=q.device)
    part_lse = torch.full((rows, hq), math.nan, dtype=torch.float32, device=q.device)
    q_rows = torch.arange(nq, device=q.device)
    launch_level(
        sched, q, kv_cache, sm_scale=sm_scale, q_rows=q_rows, o_rows=starts, out=part_o, lse=part_lse
    )
    out = torch.full((nq, hq, d), math.nan, dtype=out_dtype, device=q.device)
    lse = torch.full((nq, hq), math.nan, dtype=torch.float32, device=q.device)
    merge_states_varlen(part_o, part_lse, starts, counts, out, out_lse=lse)
    return out, lse, sched.splits


# ----------------------------------------------------------------------------------------------
# Level attention


@pytest.mark.parametrize("page_size", [1, 3, 16, 128])
@pytest.mark.parametrize(("num_qo_heads", "num_kv_heads"), [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_chunk_size", [None, 16])
def test_level_attention_matches_reference(page_size, num_qo_heads, num_kv_heads, causal, kv_chunk_size):
    gen = torch.Generator().manual_seed(page_size * 100 + num_qo_heads * 10 + num_kv_heads)
    head_dim = 16
    lengths = [kv for _, kv in CPU_GROUPS]
    num_pages = sum(-(-n // page_size) for n in lengths) + 5
    kvp, idx, last = _pages_for(lengths, page_size, num_pages, gen)
    qo = np.concatenate([[0], np.cumsum([n for n, _ in CPU_GROUPS])]).astype(np.int32)
    kv_cache = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    q = torch.randn(int(qo[-1]), num_qo_heads, head_dim, generator=gen).to(DEVICE)
    scale = 0.3
    out, lse, splits = _run_level(
        q, kv_cache, (qo, kvp, idx, last), causal, scale, kv_chunk_size, torch.float32
    )
    if kv_chunk_size is not None:
        assert splits.max() > 1, "the case must exercise split-KV"
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, causal, scale)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[torch.float32])


@pytest.mark.parametrize("widths", [0, 1, 2])
def test_level_attention_on_each_offset_width(widths, monkeypatch):
    """Each of the three kernels (``offset_widths``: 32-bit offsets, a 64-bit page term, both terms
    64-bit) computes the same attention; forced here on a small pool, which needs none of them."""
    from prefix_cache.kernels import attention

    monkeypatch.setattr(attention, "offset_widths", lambda k, v: widths)
    gen = torch.Generator().manual_seed(7)
    page_size, lengths = 3, [kv for _, kv in CPU_GROUPS]
    num_pages = sum(-(-n // page_size) for n in lengths) + 5
    kvp, idx, last = _pages_for(lengths, page_size, num_pages, gen)
    qo = np.concatenate([[0], np.cumsum([n for n, _ in CPU_GROUPS])]).astype(np.int32)
    kv_cache = torch.randn(num_pages, 2, page_size, 2, 16, generator=gen).to(DEVICE)
    q = torch.randn(int(qo[-1]), 6, 16, generator=gen).to(DEVICE)
    out, lse, _ = _run_level(q, kv_cache, (qo, kvp, idx, last), True, 0.3, 16, torch.float32)
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, True, 0.3)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_level_attention_half_precision(dtype):
    gen = torch.Generator().manual_seed(7)
    page_size, hq, hkv, d = 4, 8, 2, 32
    lengths = [kv for _, kv in CPU_GROUPS]
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    kvp, idx, last = _pages_for(lengths, page_size, num_pages, gen)
    qo = np.concatenate([[0], np.cumsum([n for n, _ in CPU_GROUPS])]).astype(np.int32)
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(int(qo[-1]), hq, d, generator=gen).to(dtype).to(DEVICE)
    out, lse = level_attention(
        q, kv_cache, qo, kvp, idx, last, causal=True, out_dtype=dtype, kv_chunk_size=16
    )
    assert out.dtype == dtype
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, True, d**-0.5)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[dtype])


def test_level_attention_unpadded_head_dim_and_wide_group():
    """head_dim 24 is masked inside a 32-wide tile; 9 query heads over 3 KV heads leave padded rows."""
    gen = torch.Generator().manual_seed(11)
    groups = [(7, 30), (1, 5)]
    lengths = [kv for _, kv in groups]
    kvp, idx, last = _pages_for(lengths, 5, 12, gen)
    qo = np.array([0, 7, 8], dtype=np.int32)
    kv_cache = torch.randn(12, 2, 5, 3, 24, generator=gen).to(DEVICE)
    q = torch.randn(8, 9, 24, generator=gen).to(DEVICE)
    out, lse, _ = _run_level(q, kv_cache, (qo, kvp, idx, last), False, 24**-0.5, None, torch.float32)
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, False, 24**-0.5)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[torch.float32])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_chunk_size", [None, 32])
def test_level_attention_group_spanning_several_m_tiles(causal, kv_chunk_size):
    """45 queries x 3 heads per KV head exceed one M tile: tiles of 21 tokens (63 of 64 rows used)."""
    gen = torch.Generator().manual_seed(13)
    groups = [(45, 70), (2, 9)]
    kvp, idx, last = _pages_for([kv for _, kv in groups], 8, 12, gen)
    qo = np.array([0, 45, 47], dtype=np.int32)
    kv_cache = torch.randn(12, 2, 8, 2, 16, generator=gen).to(DEVICE)
    q = torch.randn(47, 6, 16, generator=gen).to(DEVICE)
    sched = plan_level(
        qo, kvp, idx, last, causal=causal, page_size=8, num_qo_heads=6, num_kv_heads=2, head_dim=16,
        device=DEVICE,
    )  # fmt: skip
    assert sched.tile_q * 3 < sched.block_m < 45 * 3
    out, lse, _ = _run_level(q, kv_cache, (qo, kvp, idx, last), causal, 0.25, kv_chunk_size, torch.float32)
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, causal, 0.25)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[torch.float32])


def test_level_attention_automatic_split():
    """A long decode group with few programs gets split by the planner's own choice."""
    gen = torch.Generator().manual_seed(17)
    kvp, idx, last = _pages_for([1100, 40], 16, 75, gen)
    qo = np.array([0, 1, 3], dtype=np.int32)
    kv_cache = torch.randn(75, 2, 16, 2, 16, generator=gen).to(DEVICE)
    q = torch.randn(3, 8, 16, generator=gen).to(DEVICE)
    out, lse, splits = _run_level(q, kv_cache, (qo, kvp, idx, last), True, 0.25, None, torch.float32)
    assert splits[0] > 1 and splits[1] == 1
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, True, 0.25)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[torch.float32])


def test_plan_level_rejects_bad_input():
    ok = dict(causal=False, page_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=16, device="cpu")
    qo, kvp, idx, last = np.array([0, 2]), np.array([0, 1]), np.array([3]), np.array([4])
    plan_level(qo, kvp, idx, last, **ok)
    with pytest.raises(ValueError, match="multiple"):
        plan_level(qo, kvp, idx, last, **{**ok, "num_qo_heads": 3})
    with pytest.raises(ValueError, match="kv_last_page_len"):
        plan_level(qo, kvp, idx, np.array([5]), **ok)
    with pytest.raises(ValueError, match="group count"):
        plan_level(np.array([0, 1, 2]), kvp, idx, last, **ok)
    with pytest.raises(ValueError, match="non-decreasing"):
        plan_level(qo, np.array([0, 2]), idx, last, **ok)
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        with pytest.raises(ValueError, match="page ids"):
            plan_level(qo, kvp, np.array([-1], dtype=dtype), last, **ok)
    with pytest.raises(ValueError, match="page ids"):
        plan_level(qo, kvp, np.array([2**31]), last, **ok)
    assert plan_level(qo, kvp, np.array([2**31 - 1]), last, **ok).max_page == 2**31 - 1


def test_launch_level_rejects_mismatched_cache():
    sched = plan_level(
        [0, 1], [0, 1], [7], [2], causal=False, page_size=4, num_qo_heads=2, num_kv_heads=1, head_dim=16,
        device="cpu",
    )  # fmt: skip
    q = torch.randn(1, 2, 16)
    rows = torch.zeros(1, dtype=torch.long)
    out, lse = torch.empty(1, 2, 16), torch.empty(1, 2)
    with pytest.raises(ValueError, match="page 7"):
        launch_level(
            sched, q, torch.randn(4, 2, 4, 1, 16), sm_scale=1.0, q_rows=rows, o_rows=rows, out=out, lse=lse
        )
    with pytest.raises(ValueError, match="dtype"):
        kv = torch.randn(8, 2, 4, 1, 16, dtype=torch.float16)
        launch_level(sched, q, kv, sm_scale=1.0, q_rows=rows, o_rows=rows, out=out, lse=lse)


# ----------------------------------------------------------------------------------------------
# Merge


def _ref_merge(o: torch.Tensor, lse: torch.Tensor):
    """o [N, T, H, D], lse [N, T, H] -> float64 (out, lse), empty segments ignored."""
    lse = lse.double()
    total = torch.logsumexp(lse, 0)
    w = torch.exp(lse - total).nan_to_num(0.0)
    out = (w[..., None] * o.double().nan_to_num(0.0)).sum(0)
    return out, total


def test_merge_states_fixed_count():
    gen = torch.Generator().manual_seed(3)
    n, t, h, d = 3, 7, 5, 24
    o = torch.randn(n, t, h, d, generator=gen)
    lse = torch.randn(n, t, h, generator=gen) * 4
    lse[0, :, 1] = -math.inf  # one empty segment
    lse[:, 2, :] = -math.inf  # a token with no KV at all
    o[lse == -math.inf] = math.nan  # an empty segment's output must never be read
    out, out_lse = merge_states(o.to(DEVICE), lse.to(DEVICE))
    ref_out, ref_lse = _ref_merge(o, lse)
    _assert_close(out, out_lse, ref_out, ref_lse, ATOL[torch.float32])
    assert (out[2].cpu() == 0).all()


def test_merge_states_varlen_scatters_and_handles_zero_counts():
    gen = torch.Generator().manual_seed(4)
    h, d = 4, 16
    counts = torch.tensor([2, 0, 1, 3], dtype=torch.int32, device=DEVICE)
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    rows = int(counts.sum())
    o = torch.randn(rows, h, d, generator=gen).to(DEVICE)
    lse = torch.randn(rows, h, generator=gen).to(DEVICE)
    lse[3, 0] = -math.inf
    out_rows = torch.tensor([3, 0, 2, 1], device=DEVICE)
    out = torch.full((4, h, d), math.nan, dtype=torch.bfloat16, device=DEVICE)
    out_lse = torch.full((4, h), math.nan, device=DEVICE)
    merge_states_varlen(o, lse, starts, counts, out, out_rows=out_rows, out_lse=out_lse)
    for tok in range(4):
        seg = slice(int(starts[tok]), int(starts[tok] + counts[tok]))
        if counts[tok] == 0:
            ref_out, ref_lse = (
                torch.zeros(h, d, dtype=torch.float64),
                torch.full((h,), -math.inf, dtype=torch.float64),
            )
        else:
            ref_out, ref_lse = _ref_merge(o[seg, None], lse[seg, None])
            ref_out, ref_lse = ref_out[0], ref_lse[0]
        r = int(out_rows[tok])
        _assert_close(out[r], out_lse[r], ref_out, ref_lse, ATOL[torch.bfloat16])


def test_merge_launch_pairs_rows_and_extra_states():
    """The backend's merge (``MergeLaunch``, two rows per step) over tokens of 0-5 partial rows and
    0-3 extra states (FA3's: bf16, base-2 LSE, a token's states ``step`` rows apart, interleaved
    with another token's): every count odd and even, another token's finite row right after each
    token's last (a fold reading one row too many would take it in), heads in several tiles with a
    partial last one, empty segments holding NaN, a padding token (out row -1) writing nothing."""
    from prefix_cache.kernels.merge_state import MergeLaunch

    gen = torch.Generator().manual_seed(5)
    h, d = 10, 24  # 10 heads over 8 tokens: tiles of 4 heads, the last half masked
    counts = [0, 1, 2, 3, 4, 5, 1, 0]
    t = len(counts)
    starts = [sum(counts[:i]) for i in range(t)]
    rows = sum(counts) + 1  # and a finite row past the last token's
    o = torch.randn(rows, h, d, generator=gen)
    lse = torch.randn(rows, h, generator=gen) * 3
    lse[starts[3] + 1, :3] = -math.inf  # empty segments in the middle of a pair and at its start
    lse[starts[4], 5:] = -math.inf
    o[lse == -math.inf] = math.nan
    # Extra states (start, step, count) per token: tokens 0 and 4 interleaved (step 2, 3 states
    # each), token 3 step 3, token 2 one state followed by a row of nobody's.
    ext_table = [(0, 2, 3), (0, 1, 0), (7, 1, 1), (6, 3, 2), (1, 2, 3), (0, 1, 0), (0, 1, 0), (0, 1, 0)]
    ext_o = torch.randn(12, h, d, generator=gen).to(torch.bfloat16)
    ext_lse = torch.randn(12, h, generator=gen) * 3  # base 2
    ext_lse[9, :4] = -math.inf
    ext_o[9, :4] = math.nan
    ext_rows = torch.tensor(ext_table, dtype=torch.int32).T.contiguous()
    out_rows = torch.tensor([5, 0, 7, 2, 1, 3, 6, -1], dtype=torch.int32)
    out = torch.full((t + 1, h, d), math.nan, dtype=torch.bfloat16)
    launch = MergeLaunch(t, h, d, sms=132, extra=True)
    assert launch._kernel.grid == (t, 3)
    to = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    dev = to(o, lse, torch.tensor(starts, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32), out,
             out_rows, ext_o, ext_lse, ext_rows)  # fmt: skip
    launch(*dev[:6], tuple(dev[6:]))
    got = dev[4].cpu()
    for tok in range(t):
        own = lse[starts[tok] : starts[tok] + counts[tok]].double()
        own_o = o[starts[tok] : starts[tok] + counts[tok]].double()
        e0, step, n = ext_table[tok]
        idx = [e0 + i * step for i in range(n)]
        seg_lse = torch.cat([own, ext_lse[idx].double() * math.log(2)])
        seg_o = torch.cat([own_o, ext_o[idx].double()])
        if seg_lse.shape[0] == 0:
            ref_out, ref_lse = torch.zeros(h, d, dtype=torch.float64), torch.full((h,), -math.inf)
        else:
            ref_out, ref_lse = _ref_merge(seg_o[:, None], seg_lse[:, None])
            ref_out, ref_lse = ref_out[0], ref_lse[0]
        if out_rows[tok] < 0:
            continue
        r = int(out_rows[tok])
        assert not got[r].isnan().any()
        scale = max(float(ref_out.abs().max()), 1e-3)
        torch.testing.assert_close(got[r].double(), ref_out, atol=ATOL[torch.bfloat16] * scale, rtol=0)
    assert got[4].isnan().all(), "the padding token (out row -1) must write nothing"


# ----------------------------------------------------------------------------------------------
# KV append


@pytest.mark.parametrize("page_size", [1, 3, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_kv_writes_slots_and_skips_minus_one(page_size, dtype):
    gen = torch.Generator().manual_seed(page_size)
    num_pages, hkv, d, n = 12, 3, 16, 9
    cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n]
    slots[[1, 5]] = -1
    expected = cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // page_size, 0, slot % page_size] = k[i]
            expected[slot // page_size, 1, slot % page_size] = v[i]
    device_cache = cache.to(DEVICE)
    append_kv(device_cache, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(device_cache.cpu(), expected)


@pytest.mark.parametrize("layout", ["vllm", "separate", "hnd"])
def test_append_kv_into_other_layouts(layout):
    """The same writes through (K, V) views of vLLM's [2, pages, ...], separate pools and HND pools."""
    gen = torch.Generator().manual_seed(3)
    num_pages, page_size, hkv, d, n = 6, 4, 2, 16, 7
    k = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n]
    slots[2] = -1
    if layout == "vllm":
        pool = torch.zeros(2, num_pages, page_size, hkv, d, device=DEVICE)
        k_cache, v_cache = pool[0], pool[1]
    elif layout == "separate":
        k_cache = torch.zeros(num_pages, page_size, hkv, d, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
    else:
        pool = torch.zeros(num_pages, 2, hkv, page_size, d, device=DEVICE)
        k_cache, v_cache = pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2)
    append_kv((k_cache, v_cache), k, v, slots.to(DEVICE))
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // page_size, slot % page_size], k[i])
            assert torch.equal(v_cache[slot // page_size, slot % page_size], v[i])
    written = int((slots >= 0).sum()) * hkv * d
    assert int((k_cache != 0).sum()) == written and int((v_cache != 0).sum()) == written


def test_append_kv_rejects_dtype_mismatch():
    cache = torch.randn(2, 2, 4, 1, 16)
    k = torch.randn(1, 1, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        append_kv(cache, k, k, torch.zeros(1, dtype=torch.long))


# ----------------------------------------------------------------------------------------------
# The triton backend over a hand-built three-level plan


def _tree_batch(prefix_len, mid_lens, suffix_lens, q_lens, page_size, hq, hkv, d, dtype, device, gen):
    """A batch whose requests share a prefix (level 0), then a per-branch middle part (level 1), then
    their own suffix (level 2, causal over their own new tokens). Requests of branch b are listed in
    ``suffix_lens[b]``; the engine order interleaves branches, so the plan must permute.

    Returns (plan, q, kv_cache, pages of each segment, per engine request its (segment, length) list,
    engine query offsets [num_req + 1]).
    """
    branches = [(b, i) for b in range(len(mid_lens)) for i in range(len(suffix_lens[b]))]
    num_req = len(branches)
    # Engine order: a fixed shuffle of the planned (branch-major) order.
    request_order = torch.randperm(num_req, generator=gen).numpy().astype(np.int32)
    engine_of_planned = request_order
    planned_q = [q_lens[p] for p in range(num_req)]
    engine_q = np.zeros(num_req, dtype=np.int64)
    engine_q[engine_of_planned] = planned_q
    engine_off = np.concatenate([[0], np.cumsum(engine_q)])
    query_order = np.concatenate(
        [np.arange(engine_off[r], engine_off[r + 1]) for r in engine_of_planned] or [np.zeros(0)]
    ).astype(np.int64)

    seg_lens = [prefix_len, *mid_lens, *[s for b in suffix_lens for s in b]]
    num_pages = sum(-(-n // page_size) for n in seg_lens) + 4
    indptr, indices, last = _pages_for(seg_lens, page_size, num_pages, gen)
    seg_pages = [indices[indptr[i] : indptr[i + 1]] for i in range(len(seg_lens))]
    q_indptr_req = np.concatenate([[0], np.cumsum(planned_q)]).astype(np.int32)

    def level(segs, qo, causal):
        kvp = np.concatenate([[0], np.cumsum([len(seg_pages[s]) for s in segs])]).astype(np.int32)
        idx = np.concatenate([seg_pages[s] for s in segs]).astype(np.int32)
        return CascadeLevel(
            np.asarray(qo, np.int32), kvp, idx, np.array([last[s] for s in segs], np.int32), causal
        )

    per_branch = [len(s) for s in suffix_lens]
    branch_end = np.cumsum(per_branch)
    mid_qo = [0] + [int(q_indptr_req[e]) for e in branch_end]
    levels = (
        level([0], [0, int(q_indptr_req[-1])], False),
        level(list(range(1, 1 + len(mid_lens))), mid_qo, False),
        level(list(range(1 + len(mid_lens), len(seg_lens))), q_indptr_req, True),
    )
    plan = CascadePlan(
        levels=levels,
        request_order=request_order,
        request_inverse=np.argsort(request_order).astype(np.int32),
        query_order=query_order,
        page_size=page_size,
    )
    # Per engine request: its (segment, length) list, shared prefix first.
    segments = [None] * num_req
    for p, (b, _) in enumerate(branches):
        s = 1 + len(mid_lens) + p
        segments[engine_of_planned[p]] = [(0, prefix_len), (1 + b, mid_lens[b]), (s, seg_lens[s])]
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype).to(device)
    q = torch.randn(int(engine_off[-1]), hq, d, generator=gen).to(dtype).to(device)
    return plan, q, kv_cache, seg_pages, segments, engine_off


def _ref_tree(q, kv_cache, seg_pages, segments, engine_off, sm_scale):
    outs = []
    for r, segs in enumerate(segments):
        ks, vs = zip(*[_gather_kv(kv_cache, seg_pages[s], n) for s, n in segs], strict=True)
        qr = q[engine_off[r] : engine_off[r + 1]].cpu().double()
        outs.append(_ref_attention(qr, torch.cat(ks), torch.cat(vs), True, sm_scale)[0])
    return torch.cat(outs)


def _poison_partials(backend: TritonBackend) -> None:
    """NaN in the backend's partial-state buffer: a row the levels promise but do not write shows."""
    if backend._part_o is not None:
        backend._part_o.fill_(math.nan)
        backend._part_lse.fill_(math.nan)


@pytest.mark.parametrize("kv_chunk_size", [None, 16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_three_levels(kv_chunk_size, page_size):
    gen = torch.Generator().manual_seed(21 + page_size)
    hq, hkv, d = 4, 2, 16
    q_lens = [1, 3, 1, 2, 0]  # planned order; one request with no new query tokens this step
    plan, q, kv_cache, seg_pages, segments, engine_off = _tree_batch(
        37, [20, 5], [[6, 9, 3], [17, 4]], q_lens, page_size, hq, hkv, d, torch.float32, DEVICE, gen
    )
    backend = TritonBackend(device=DEVICE, kv_chunk_size=kv_chunk_size)
    assert backend.name == "triton"
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    _poison_partials(backend)
    out = backend.run(q, kv_cache)
    ref = _ref_tree(q, kv_cache, seg_pages, segments, engine_off, d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.isfinite().all()
    torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[torch.float32], rtol=ATOL[torch.float32])
    # A second layer reuses the plan.
    q2 = torch.randn(q.shape, generator=gen).to(DEVICE)
    ref2 = _ref_tree(q2, kv_cache, seg_pages, segments, engine_off, d**-0.5)
    torch.testing.assert_close(backend.run(q2, kv_cache).cpu().double(), ref2, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_single_level_writes_output_directly(dtype):
    """One causal level without splits (plain paged attention) takes the path without a merge."""
    gen = torch.Generator().manual_seed(5)
    page_size, hq, hkv, d = 3, 6, 2, 16
    lengths, q_lens = [10, 4, 7], [2, 1, 3]
    kvp, idx, last = _pages_for(lengths, page_size, 12, gen)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    order = np.array([3, 4, 5, 0, 1, 2], dtype=np.int64)  # planned request 0 is the engine's last
    plan = CascadePlan(
        levels=(CascadeLevel(qo, kvp, idx, last, True),),
        request_order=np.array([2, 0, 1], np.int32),
        request_inverse=np.array([1, 2, 0], np.int32),
        query_order=order,
        page_size=page_size,
    )
    kv_cache = torch.randn(12, 2, page_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(6, hq, d, generator=gen).to(dtype).to(DEVICE)
    backend = TritonBackend(device=DEVICE)
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=0.2)
    assert backend._merges == 0
    out = backend.run(q, kv_cache)
    assert out.dtype == dtype
    ref_planned, _ = _ref_level(q[order], kv_cache, qo, kvp, idx, last, True, 0.2)
    ref = torch.empty_like(ref_planned)
    ref[order] = ref_planned
    torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_triton_backend_validates_inputs():
    plan = CascadePlan(
        levels=(CascadeLevel(np.array([0, 1], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
                             np.array([2], np.int32), True),),
        request_order=np.array([0], np.int32),
        request_inverse=np.array([0], np.int32),
        query_order=np.array([0], np.int64),
        page_size=4,
    )  # fmt: skip
    backend = TritonBackend(device=DEVICE)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.run(torch.randn(1, 2, 16, device=DEVICE), torch.randn(1, 2, 4, 1, 16, device=DEVICE))
    backend.plan(plan, num_qo_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="the plan needs"):
        backend.run(torch.randn(2, 2, 16, device=DEVICE), torch.randn(1, 2, 4, 1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="kv_cache"):
        backend.run(torch.randn(1, 2, 16, device=DEVICE), torch.randn(1, 2, 8, 1, 16, device=DEVICE))


def test_triton_backend_on_planner_output():
    """The planner's own plans (nested prefixes, prefill chunks, a request without queries)."""
    gen = torch.Generator().manual_seed(8)
    page_size, hq, hkv, d = 4, 6, 2, 16
    # Two conversations under one system prompt (pages 0-5), each branching into requests.
    system = list(range(6))
    convs = [[*system, 6, 7, 8], [*system, 9, 10]]
    tables, kv_lens, q_lens, nxt = [], [], [], 11
    for c, (own_pages, q_len) in enumerate([(2, 1), (3, 5), (1, 1), (2, 0), (2, 2)]):
        base = convs[c % 2]
        tables.append(np.array(base + list(range(nxt, nxt + own_pages)), dtype=np.int32))
        nxt += own_pages
        kv_lens.append(len(tables[-1]) * page_size - 1)
        q_lens.append(q_len)
    planner = CascadePlanner(min_shared_tokens=1, min_saved_tokens=0)
    plan = planner.plan(tables, kv_lens, q_lens, page_size)
    assert len(plan.levels) > 1, "the case must exercise shared levels"
    kv_cache = torch.randn(nxt, 2, page_size, hkv, d, generator=gen).to(DEVICE)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE)
    backend = TritonBackend(device=DEVICE)
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    _poison_partials(backend)
    out = backend.run(q, kv_cache)
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    for r, table in enumerate(tables):
        k, v = _gather_kv(kv_cache, table, kv_lens[r])
        ref, _ = _ref_attention(q[offsets[r] : offsets[r + 1]].cpu().double(), k, v, True, d**-0.5)
        torch.testing.assert_close(out[offsets[r] : offsets[r + 1]].cpu().double(), ref, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------------------
# GPU, realistic shapes (Llama-3-8B heads, page 16)


def _sdpa_ref(q, k, v, causal, sm_scale):
    """float64 reference on the GPU for long KV: q [Q, Hq, D], k/v [L, Hkv, D] -> (out [Q, Hq, D],
    lse [Q, Hq])."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * sm_scale
    if causal:
        nq, length = q.shape[0], k.shape[0]
        mask = (
            torch.arange(length, device=q.device)[None, :]
            > length - nq + torch.arange(nq, device=q.device)[:, None]
        )
        s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v), lse.T


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_queries", "causal"), [(1, False), (64, False), (300, True)])
def test_gpu_level_attention_long_kv_split(dtype, num_queries, causal):
    """One group, 20000 KV tokens: few M tiles, so the level splits the KV across programs. The
    output is compared relative to its own (small) magnitude and the LSE to 1e-4: a lost split or a
    skipped page fails."""
    gen = torch.Generator().manual_seed(num_queries)
    page_size, hq, hkv, d, length = 16, 32, 8, 128, 20000
    kvp, idx, last = _pages_for([length], page_size, 1400, gen)
    kv_cache = torch.randn(1400, 2, page_size, hkv, d, generator=gen).to(dtype).cuda()
    q = torch.randn(num_queries, hq, d, generator=gen).to(dtype).cuda()
    qo = np.array([0, num_queries], np.int32)
    sched = plan_level(
        qo, kvp, idx, last, causal=causal, page_size=page_size, num_qo_heads=hq, num_kv_heads=hkv,
        head_dim=d, device="cuda",
    )  # fmt: skip
    assert sched.splits.max() > 1
    out, lse = level_attention(q, kv_cache, qo, kvp, idx, last, causal=causal)
    pages = torch.as_tensor(idx, device="cuda").long()
    pos = torch.arange(length, device="cuda")
    kv = kv_cache[pages[pos // page_size], :, pos % page_size]
    ref_out, ref_lse = _sdpa_ref(q, kv[:, 0], kv[:, 1], causal, d**-0.5)
    _assert_close(out, lse, ref_out, ref_lse, ATOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_triton_backend_shared_prefix_decode(dtype):
    """4 branches x 8 requests under a 4000-token prefix; decode and short prefill chunks mixed."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, page_size = 32, 8, 128, 16
    suffixes = [[int(x) for x in torch.randint(17, 300, (8,), generator=gen)] for _ in range(4)]
    q_lens = [1 if i % 3 else 17 for i in range(32)]
    plan, q, kv_cache, seg_pages, segments, engine_off = _tree_batch(
        4000, [500, 33, 1000, 16], suffixes, q_lens, page_size, hq, hkv, d, dtype, "cuda", gen
    )
    backend = TritonBackend(device="cuda")
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    out = backend.run(q, kv_cache)
    ref = _ref_tree(q, kv_cache, seg_pages, segments, engine_off, d**-0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[dtype], rtol=ATOL[dtype])


@gpu
@pytest.mark.gpu
def test_gpu_triton_backend_relaunches_for_each_layout():
    """One plan run on q, KV and out of other strides, 16-byte alignments and layouts in turn, each
    against the reference: the compiled kernels are launched directly per specialization
    (``kernels/_launch.py``), and one reused for a layout it was not compiled for reads wrong data."""
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    suffixes = [[int(x) for x in torch.randint(17, 300, (8,), generator=gen)] for _ in range(2)]
    plan, q, kv_cache, seg_pages, segments, engine_off = _tree_batch(
        2000, [300, 40], suffixes, [1] * 16, page_size, hq, hkv, d, dtype, "cuda", gen
    )
    ref = _ref_tree(q, kv_cache, seg_pages, segments, engine_off, d**-0.5)

    def unaligned(x: torch.Tensor) -> torch.Tensor:
        """A copy of x one element into its storage: its address is not a multiple of 16 bytes."""
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = flat[1:].view(x.shape)
        view.copy_(x)
        return view

    wide = torch.zeros(q.shape[0], hq + 2 * hkv, d, dtype=dtype, device="cuda")
    wide[:, :hq] = q  # q as a view of a fused qkv projection: another row stride
    k, v = kv_cache[:, 0].contiguous(), kv_cache[:, 1].contiguous()
    variants = [
        ("contiguous", q, kv_cache, torch.empty_like(q)),
        ("contiguous again", q, kv_cache, torch.empty_like(q)),
        ("q of a wider tensor", wide[:, :hq], kv_cache, torch.empty_like(q)),
        ("unaligned q", unaligned(q), kv_cache, torch.empty_like(q)),
        ("unaligned out", q, kv_cache, unaligned(torch.empty_like(q))),
        ("separate K and V", q, (k, v), torch.empty_like(q)),
        ("unaligned K and V", q, (unaligned(k), unaligned(v)), torch.empty_like(q)),
        ("contiguous last", q, kv_cache, torch.empty_like(q)),
    ]
    backend = TritonBackend(device="cuda")
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
    for name, q_in, kv_in, out in variants:
        out.fill_(float("nan"))
        backend.run(q_in, kv_in, out=out)
        torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[dtype], rtol=ATOL[dtype], msg=name)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "page_size", "dtype"),
    [
        (32, 8, 128, 16, torch.float32),
        (12, 4, 64, 16, torch.bfloat16),
        (9, 3, 128, 1, torch.float16),
        (8, 1, 128, 16, torch.bfloat16),
        (16, 2, 96, 3, torch.bfloat16),
        (16, 8, 256, 16, torch.bfloat16),
        (8, 2, 256, 1, torch.float16),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_level_attention_shapes(hq, hkv, d, page_size, dtype, causal):
    """Many groups of mixed sizes (decode, prefill chunks, empty), auto splits, GPU block sizes."""
    groups = [(1, 700), (0, 50), (40, 300), (3, 0), (1, 2500), (130, 130), (7, 1)]
    _check_gpu_level(groups, hq, hkv, d, page_size, dtype, causal, seed=hq * d + page_size)


def _check_gpu_level(groups, hq, hkv, d, page_size, dtype, causal, seed):
    """One level of ``groups`` ((query tokens, KV tokens) each) over a random paged pool on the GPU,
    planned and split automatically, against the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [kv for _, kv in groups]
    num_pages = sum(-(-n // page_size) for n in lengths) + 10
    kvp, idx, last = _pages_for(lengths, page_size, num_pages, gen)
    qo = np.concatenate([[0], np.cumsum([n for n, _ in groups])]).astype(np.int32)
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype).cuda()
    q = torch.randn(int(qo[-1]), hq, d, generator=gen).to(dtype).cuda()
    out, lse, _ = _run_level(q, kv_cache, (qo, kvp, idx, last), causal, d**-0.5, None, dtype)
    ref_out, ref_lse = _ref_level(q, kv_cache, qo, kvp, idx, last, causal, d**-0.5)
    # fp32 runs the dots in full fp32 ("ieee"), so it gets the interpreter's tolerance.
    _assert_close(out, lse, ref_out, ref_lse, ATOL[dtype] if dtype != torch.float32 else 1e-4)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "page_size", "dtype"),
    [(16, 8, 256, 16, torch.bfloat16), (8, 2, 256, 1, torch.float16)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_level_attention_decode_tiles(hq, hkv, d, page_size, dtype, causal):
    """Groups of at most one tile of query tokens (16 rows: 16 / group size tokens; one per group
    when not causal, and one group without queries): the level takes the 16-row decode tile, which
    at head dim 256 reads 64 KV tokens per step, its whole KV tiles unmasked; long and ragged KV, so
    the masked tail, the causal diagonal inside a tile of several tokens and the splits are all
    exercised."""
    group = hq // hkv
    tile = tile_config(16, group, d, page_size)
    assert (tile.block_m, tile.block_n) == (16, 64)
    full = 16 // group if causal else 1
    groups = [(full, 2300), (min(2, full), 63), (0, 40), (1, 1), (full, 700), (full, 129)]
    _check_gpu_level(groups, hq, hkv, d, page_size, dtype, causal, seed=d + page_size)


@gpu
@pytest.mark.gpu
def test_gpu_append_kv_then_attend():
    gen = torch.Generator().manual_seed(2)
    page_size, hkv, d, n = 16, 8, 128, 1000
    cache = torch.randn(128, 2, page_size, hkv, d, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randperm(128 * page_size, generator=gen)[:n].cuda()
    slots[::7] = -1
    expected = cache.clone()
    keep = slots >= 0
    expected[slots[keep] // page_size, 0, slots[keep] % page_size] = k[keep]
    expected[slots[keep] // page_size, 1, slots[keep] % page_size] = v[keep]
    append_kv(cache, k, v, slots)
    assert torch.equal(cache, expected)


def test_offset_widths_where_a_view_spans_2_31_elements() -> None:
    """The kernel's K/V offsets are 32-bit only while every element of the K and V views lies within
    2**31 elements of the view's first: measured from each view's own start (vLLM's halves of a
    pool of twice that size stay 32-bit), over any strides (HND views), K or V alone. Past that the
    page's term is 64-bit, and the slot's term too only where (page_size - 1) x the slot stride
    reaches 2**31 by itself (slot-major pools). Meta tensors: shapes and strides without memory."""
    pages_at_limit = 2**31 // (2 * 16 * 8 * 128)  # NHD pool [pages, 2, 16, 8, 128] of 2**31 elements

    def pool(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    def widths(kv_cache) -> int:
        return offset_widths(*split_kv_cache(kv_cache))

    # NHD: K's and V's views of a 2**31-element pool end half a page short of 2**31 elements: 32
    # bits; one page more reaches past it, and only the page's term needs 64 bits.
    assert widths(pool(pages_at_limit, 2, 16, 8, 128)) == 0
    assert widths(pool(pages_at_limit + 1, 2, 16, 8, 128)) == 1
    # vLLM's [2, pages, ...]: each half is its own view, measured from its own first element: halves
    # of 2**31 elements each (a pool of 2**32) stay 32-bit.
    vllm = pool(2, 2 * pages_at_limit, 16, 8, 128)
    assert widths((vllm[0], vllm[1])) == 0
    vllm = pool(2, 2 * pages_at_limit + 1, 16, 8, 128)
    assert widths((vllm[0], vllm[1])) == 1
    # HND pools [pages, H, page_size, D] passed as transposed views: a 2**31-element pool's last
    # element sits at offset 2**31 - 1, the most 32 bits hold.
    hnd = pool(2 * pages_at_limit, 8, 16, 128)
    assert widths((hnd.transpose(1, 2), hnd.transpose(1, 2))) == 0
    hnd = pool(2 * pages_at_limit + 1, 8, 16, 128)
    assert widths((hnd.transpose(1, 2), hnd.transpose(1, 2))) == 1
    # Every axis counts: two entries along one axis over rows of 2**30 + 1 elements span 2**31 + 2;
    # along the slot axis that alone is the slot's term of 2**30 + 1 < 2**31.
    assert offset_widths(pool(1, 1, 1, 2**31), pool(1, 1, 1, 2**31)) == 0
    assert offset_widths(pool(1, 1, 1, 2**31 + 1), pool(1, 1, 1, 2**31 + 1)) == 1
    for shape in ((2, 1, 1, 2**30 + 1), (1, 2, 1, 2**30 + 1), (1, 1, 2, 2**30 + 1)):
        assert offset_widths(pool(*shape), pool(*shape)) == 1, shape
    # The slot's term alone at 2**31 - 1 and at 2**31 elements: one page of 2 slots.
    assert offset_widths(pool(1, 2, 1, 2**31 - 1), pool(1, 2, 1, 2**31 - 1)) == 1
    assert offset_widths(pool(1, 2, 1, 2**31), pool(1, 2, 1, 2**31)) == 2
    # A slot-major pool [page_size, pages, H, D] as [pages, page_size, H, D] views: its page axis
    # has the small stride, its slot axis the large one (15 slots x (2**27 + 2**10) elements < 2**31).
    slot_major = pool(16, 2**17 + 1, 8, 128).transpose(0, 1)
    assert offset_widths(slot_major, slot_major) == 1
    slot_major = pool(16, 2**17, 8, 128).transpose(0, 1)
    assert offset_widths(slot_major, slot_major) == 0
    slot_major = pool(16, 2**18, 8, 128).transpose(0, 1)  # 15 slots x 2**28 elements >= 2**31
    assert offset_widths(slot_major, slot_major) == 2
    # Separate K and V tensors: either one past the limit is enough (here a contiguous K of 2**31
    # elements, and V a view with twice its page stride), and either one's slot term.
    k = pool(2 * pages_at_limit, 16, 8, 128)
    v = pool(2 * pages_at_limit, 2, 16, 8, 128)[:, 1]
    assert offset_widths(k, v) == offset_widths(v, k) == 1 and offset_widths(k, k) == 0
    assert offset_widths(k, slot_major) == offset_widths(slot_major, k) == 2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nhd", "vllm", "slot-major"])
def test_gpu_kv_pool_over_2_31_elements(layout):
    """A pool of 2.3e9 elements (4.6 GB bf16): pages near its end sit past element 2**31, so the
    page's term of every offset is computed in 64 bits (``offset_widths``; the vLLM layout's halves
    are views of 1.15e9 elements each and run on 32-bit offsets, relative to each half's start).
    Slot-major: separate K and V tensors of [page_size, pages, H, D], 2.3e9 elements each, passed
    as [pages, page_size, H, D] views: there the slot's term alone (slot x a stride of 1.43e8)
    passes 2**31 for the last slots of a page, so it is 64-bit too."""
    page_size, hq, hkv, d, num_pages = 16, 32, 8, 128, 70000
    if layout == "slot-major":
        num_pages *= 2
        assert (page_size - 1) * num_pages * hkv * d > 2**31
    assert num_pages * 2 * page_size * hkv * d > 2**31
    gen = torch.Generator(device="cuda").manual_seed(5)
    if layout == "slot-major":  # K and V: two tensors of their own
        pool = [
            torch.empty(page_size, num_pages, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)
        ]
    else:
        shape = (num_pages, 2, page_size, hkv, d) if layout == "nhd" else (2, num_pages, page_size, hkv, d)
        pool = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    used = torch.arange(num_pages - 300, num_pages, device="cuda")  # the last 300 pages, shuffled
    used = used[torch.randperm(300, generator=gen, device="cuda")]
    values = torch.randn(300, 2, page_size, hkv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    if layout == "nhd":
        pool[used] = values
        kv_cache = pool
    elif layout == "vllm":
        pool[0, used], pool[1, used] = values[:, 0], values[:, 1]
        kv_cache = (pool[0], pool[1])
    else:
        pool[0][:, used], pool[1][:, used] = values[:, 0].transpose(0, 1), values[:, 1].transpose(0, 1)
        kv_cache = (pool[0].transpose(0, 1), pool[1].transpose(0, 1))
    # Each layout takes one of the three kernels (``offset_widths``).
    assert offset_widths(*split_kv_cache(kv_cache)) == {"vllm": 0, "nhd": 1, "slot-major": 2}[layout]
    tables = [used[:200].cpu().numpy(), used[200:].cpu().numpy()]
    kv_lens, qo_lens = [200 * page_size - 5, 100 * page_size], [1, 37]
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, page_size)
    backend = TritonBackend("cuda")
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.bfloat16)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = backend.run(q, kv_cache)
    row = 0
    by_page = {int(p): i for i, p in enumerate(used.tolist())}
    for table, kv_len, qo_len in zip(tables, kv_lens, qo_lens, strict=True):
        local = torch.tensor([by_page[int(p)] for p in table], device="cuda")
        kv = values[local].transpose(0, 1).flatten(1, 2)[:, :kv_len]  # [2, kv_len, Hkv, D]
        ref, _ = _sdpa_ref(q[row : row + qo_len], kv[0], kv[1], True, d**-0.5)
        got = out[row : row + qo_len].double()
        torch.testing.assert_close(got, ref, atol=ATOL[torch.bfloat16] * float(ref.abs().max()), rtol=0)
        row += qo_len


def _random_batch(rng: np.random.Generator, page_size: int, num_pages: int, max_requests: int):
    """A batch under a random sharing tree (system prompt, conversations, samples) over distinct
    random pages: (block_tables, kv_lens, qo_lens)."""
    free = list(rng.permutation(num_pages))
    tables, kv_lens, qo_lens = [], [], []
    system = [free.pop() for _ in range(int(rng.integers(0, 40)))]
    while len(tables) < max_requests:
        conversation = system + [free.pop() for _ in range(int(rng.integers(0, 20)))]
        for _ in range(int(rng.integers(1, 6))):
            if len(tables) == max_requests:
                break
            own = int(rng.integers(1, 4 * page_size))
            table = conversation + [free.pop() for _ in range(-(-own // page_size))]
            tables.append(np.array(table, dtype=np.int32))
            kv_lens.append(len(conversation) * page_size + own)
            qo_lens.append(int(min(rng.choice([1, 1, 1, 3, 9]), own)))
    return tables, kv_lens, qo_lens


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_cuda_graph_replays_across_plans(dtype):
    """Capture ``run`` once per ``graph_key`` (the narrow launch alone, with the middle tile's, with
    the wide tile's), then re-plan batches of other sizes, trees and depths and replay the plan's
    key: each replay matches the float64 reference; a batch over the capacity is refused."""
    from attention_reference import reference_attention

    page_size, hq, hkv, d, num_pages, max_tokens = 16, 32, 8, 128, 6000, 96
    rng = np.random.default_rng(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen, device="cuda").to(dtype)
    backend = TritonBackend("cuda", capacity=GraphCapacity(max_query_tokens=max_tokens, max_pages=4000))
    planners = [CascadePlanner(min_shared_tokens=16, min_saved_tokens=0, max_levels=m) for m in (1, 2, 3, 4)]
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)
    q = torch.zeros(max_tokens, hq, d, device="cuda", dtype=dtype)
    out = torch.zeros_like(q)
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    depths, replayed = set(), {}
    for step in range(14):
        tables, kv_lens, qo_lens = _random_batch(rng, page_size, num_pages, int(rng.integers(1, 11)))
        if step in (5, 10):  # one prefill chunk of 40-47 tokens, 160-188 rows: the wide tile
            tables = [rng.choice(num_pages, 8, replace=False).astype(np.int32)]
            kv_lens, qo_lens = [int(rng.integers(113, 129))], [int(rng.integers(40, 48))]
        plan = planners[step % 4].plan(tables, kv_lens, qo_lens, page_size)
        depths.add(len(plan.levels))
        backend.plan(plan, **heads)
        nq = plan.num_query_tokens
        q.normal_(generator=gen)
        key = backend.graph_key
        if key not in graphs:
            backend.run(q, kv_cache, out=out)  # compile outside the capture
            torch.cuda.synchronize()
            graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[key]):
                backend.run(q, kv_cache, out=out)
        out.fill_(float("nan"))
        graphs[key].replay()
        replayed[key] = replayed.get(key, 0) + 1
        expected = reference_attention(q[:nq], kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        tol = 1e-4 if dtype == torch.float32 else ATOL[dtype]
        got = out[:nq].double()
        assert got.isfinite().all() and out[nq:].isnan().all()
        torch.testing.assert_close(got, expected, atol=tol * float(expected.abs().max()), rtol=0)
    assert len(depths) >= 3, "the steps must differ in depth"
    assert sorted(replayed) == ["triton", "triton-mid", "triton-narrow"], replayed
    assert min(replayed.values()) >= 2, replayed
    too_many = CascadePlanner().plan([[i] for i in range(max_tokens + 1)], [9] * 97, [1] * 97, page_size)
    with pytest.raises(ValueError, match="97 query tokens, over the backend's capacity"):
        backend.plan(too_many, **heads)


def _check_fresh_queries(backend, tables, kv_lens, qo_lens, num_pages, page_size, hkv, d) -> None:
    """Run ``backend``'s bf16 plan eagerly and captured once in a CUDA graph, three times each with
    fresh queries and ``out`` set to NaN: each output matches the float64 reference. A merge that
    read partial rows before the attention launches wrote them would read the previous queries'."""
    from attention_reference import reference_attention

    gen = torch.Generator(device="cuda").manual_seed(1)
    kv_cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.zeros(int(sum(qo_lens)), backend.num_qo_heads, d, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    backend.run(q, kv_cache, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.run(q, kv_cache, out=out)
    for run in (lambda: backend.run(q, kv_cache, out=out), graph.replay) * 3:
        q.normal_(generator=gen)
        out.fill_(float("nan"))
        run()
        expected = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
        assert out.isfinite().all()
        tol = ATOL[torch.bfloat16] * float(expected.abs().max())
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=0)


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_of_an_exact_plan_with_two_launches():
    """An exact plan whose shared level takes the wide tile (48 decodes x 4 heads = 192 rows) beside
    the decode launch, captured once: the second launch runs on a side stream inside the graph, and
    every replay with fresh queries matches the float64 reference, so the merge waits for both."""
    page_size, hq, hkv, d, requests = 16, 32, 8, 128, 48
    rng = np.random.default_rng(1)
    pages = rng.permutation(64 + 4 * requests).astype(np.int32)
    tables = [np.r_[pages[:64], pages[64 + 4 * r : 68 + 4 * r]] for r in range(requests)]
    kv_lens, qo_lens = [64 * page_size + 50] * requests, [1] * requests
    plan = CascadePlanner(cost_model=None).plan(tables, kv_lens, qo_lens, page_size)
    backend = TritonBackend("cuda")
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.bfloat16)
    assert [int(launch.num_work.item()) > 0 for launch in backend._launches] == [True, True]
    _check_fresh_queries(backend, tables, kv_lens, qo_lens, len(pages), page_size, hkv, d)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("hq, d", [(32, 128), (16, 256)])
def test_gpu_merge_after_one_launch_waits_for_it(hq, d):
    """A plan of one attention launch whose tokens are split (8 unshared decodes of 1024 tokens):
    on Hopper its merge is a programmatic dependent launch that starts before the attention launch
    ends and waits for it in the kernel. Eager and replayed with fresh queries, every output
    matches the float64 reference (without the wait the merge read the previous queries' partial
    rows on the H200: relative errors 0.5-3). At d256 the launch has more programs than work, the
    extra ones idle (the fixed plans' grid)."""
    page_size, hkv, requests = 16, 8, 8
    pages = np.random.default_rng(2).permutation(64 * requests).astype(np.int32)
    tables = [pages[64 * r : 64 * (r + 1)] for r in range(requests)]
    kv_lens, qo_lens = [64 * page_size] * requests, [1] * requests
    plan = CascadePlanner().plan(tables, kv_lens, qo_lens, page_size)
    backend = TritonBackend("cuda")
    backend.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=torch.bfloat16)
    assert len(backend._launches) == 1 and backend._merges > 0
    (launch,) = backend._launches
    assert (launch.num_programs > int(launch.num_work.item()) * hkv) == (d > 128)
    _check_fresh_queries(backend, tables, kv_lens, qo_lens, len(pages), page_size, hkv, d)

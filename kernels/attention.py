"""Attention over a paged KV cache for a list of work items, with natural-log LSE.

One program computes, for one KV head, a tile of BLOCK_M rows = (query tokens of one group) x (the
GROUP_SIZE query heads that share that KV head), so ``tl.dot`` runs on tensor cores and every KV
tile is read once for all of the tile's rows: a prefix shared by a whole group is read once per
group, KV head and M tile. Decode (one query per group), causal prefill chunks and non-causal shared
levels are the same kernel; causality is a per-item diagonal (``work.py``), so the items of several
levels run in one launch.

The grid is persistent-capable: programs loop over (work item, KV head) pairs up to a count read
from device memory, so a launch with a fixed grid (a CUDA graph) runs whatever work a later plan
writes into the same buffers. Long KV segments with few programs are split across programs
(split-KV); each split writes a partial (out, lse) row and ``merge_state`` combines them.

K and V are addressed through strides, so any layout whose last axis (head_dim) is contiguous works:
FlashInfer's ``[pages, 2, page_size, H, D]``, vLLM's ``[2, pages, page_size, H, D]``, separate K and V
tensors, or HND views (see ``prefix_cache.attention.kv_layout``). They may be fp8 (e4m3, with a K
and a V scale per layer): each tile is converted to q's dtype in registers after its load (exact),
the K scale folded into the softmax scale and the V scale into the output's normalisation, so an fp8
cache reads half the bytes and changes nothing else (the dots run in q's dtype, on the exact fp8
values).

Host side for one level: ``plan_level`` builds its work list once per batch, ``launch_level`` runs
it per layer, ``level_attention`` does both and the merge, for one-off calls. The triton backend
schedules whole cascade plans itself from ``work.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from prefix_cache.kernels._common import (
    LOG2E,
    check_runnable,
    gdc_launch_dependents,
    interpreting,
    next_pow2,
    num_sms,
)
from prefix_cache.kernels._launch import BoundKernel, CachedSpecialization, specialization
from prefix_cache.kernels.merge_state import merge_states_varlen
from prefix_cache.kernels.work import (
    WORK_COLS,
    TileConfig,
    check_level,
    level_work,
    longest_first,
    tile_config,
)

from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, KVCache, check_kv_scales, split_kv_cache
from prefix_cache.planner.kv_split import min_split_tokens


@triton.jit
def _e4m3_to_f16(x):
    """fp8 (e4m3) to fp16, exact, two values per instruction. As inline assembly with side effects
    the conversion stays where it is written, in registers right after the tile's load: the tile
    then goes to shared memory as 16-bit values and reaches the tensor cores through ``ldmatrix``.
    Written as ``x.to(...)``, Triton moves the conversion past the shared-memory copy and reads
    the fp8 tiles from shared memory a byte at a time (V, the transposed operand, wholly so): fp8
    decode then ran slower than bf16 (benchmarks/NOTES.md, "fp8 tiles converted before shared
    memory")."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x], dtype=tl.float16, is_pure=False, pack=2
    )


@triton.jit
def _kv_tile(
    acc, m_i, l_i, q, start, kv_hi, tok, diag, kv_indices_ptr, page0, k_head, v_head,
    stride_k_page, stride_k_slot, stride_v_page, stride_v_slot, qk_scale,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK: tl.constexpr,  # False: every KV position of the tile is < kv_hi and visible to every row
    WIDE_OFFSETS: tl.constexpr,  # which K/V offset terms are 64-bit (see _attention_kernel)
):  # fmt: skip
    """One KV tile of the online softmax: (acc, m, l) updated with KV tokens [start, start + BLOCK_N)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < kv_hi
    # Token n of the segment lives in page kv_indices[page0 + n // PAGE_SIZE], slot n % PAGE_SIZE.
    if MASK:
        page = tl.load(kv_indices_ptr + page0 + offs_n // PAGE_SIZE, mask=n_ok, other=0)
    else:
        page = tl.load(kv_indices_ptr + page0 + offs_n // PAGE_SIZE)
    slot = offs_n % PAGE_SIZE
    if WIDE_OFFSETS > 0:
        page = page.to(tl.int64)
    if WIDE_OFFSETS > 1:
        # Only where the slot's term alone reaches 2**31 (slot-major pools): on an NHD pool past
        # 2**31 elements a one-level decode ran markedly slower with both terms in 64 bits than with
        # the page's alone (benchmarks/NOTES.md, "only the page's term in 64 bits").
        slot = slot.to(tl.int64)
    k_ptrs = k_head + (page * stride_k_page + slot * stride_k_slot)[:, None] + offs_d[None, :]
    v_ptrs = v_head + (page * stride_v_page + slot * stride_v_slot)[:, None] + offs_d[None, :]
    if MASK:
        kv_mask = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM != BLOCK_D:
        d_mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=d_mask, other=0.0)
        v = tl.load(v_ptrs, mask=d_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    # fp8 K/V are dequantized in registers to q's dtype (fp32 when upcast); their scales are folded
    # into qk_scale and the output's scale. A no-op for K/V of q's dtype.
    if not UPCAST and k.dtype == tl.float8e4nv:
        k = _e4m3_to_f16(k)
        v = _e4m3_to_f16(v)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASK:
        # Non-causal items carry a diagonal beyond every KV position (work.NO_MASK).
        valid = n_ok[None, :] & (offs_n[None, :] <= (tok + diag)[:, None])
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no KV yet keep m = -inf; shifting them by 0 keeps p and alpha at 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attention_kernel(
    q_ptr,  # [*, Hq, D]
    q_rows_ptr,  # [nq] int32/int64: row of q holding planned query token t
    k_ptr,  # K of page p, slot s, head h at p * stride_k_page + s * stride_k_slot + h * stride_k_head
    v_ptr,  # same for V
    kv_indices_ptr,  # int32 page ids
    work_ptr,  # int32 [W, 8], see work.py
    num_work_ptr,  # int32 [1]: items of work_ptr to run (W at most)
    o_rows_ptr,  # int32/int64: row of o/lse for token t's split 0 at a level (work column OROW);
    # -1 - r: the token's only partial state is its final output, row r of final_ptr (no LSE)
    o_ptr,  # [*, Hq, D]
    lse_ptr,  # [*, Hq] float32
    final_ptr,  # [*, Hq, D]: the output rows of tokens with a negative o_rows entry
    qk_scale,  # sm_scale * k_scale * log2(e)
    v_scale,  # the output's factor: an fp8 cache's V scale, else 1
    stride_q_row,
    stride_q_head,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_o_row,
    stride_o_head,
    stride_lse_row,
    stride_final_row,
    stride_final_head,
    NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    TILE_Q: tl.constexpr,  # query tokens per M tile: BLOCK_M // GROUP_SIZE
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (interpreter, fp32 inputs)
    # "ieee" for fp32 dots (no tf32 rounding); "tf32", Triton's default, has no effect on fp16/bf16.
    DOT_PRECISION: tl.constexpr,
    # Launched before a merge with programmatic dependent launch: the merge's programs may start
    # once every program here has (``dependent_launches``).
    LAUNCH_DEPENDENTS: tl.constexpr,
    # K and V offsets from the KV head's first element (page x page stride + slot x slot stride):
    # 0, both terms in 32 bits; 1, the page's term in 64; 2, the slot's too (``offset_widths``).
    # The head's offset is 64-bit either way.
    WIDE_OFFSETS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    num_items = tl.load(num_work_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Consecutive programs take consecutive items of one KV head: the M tiles of one KV chunk run
    # side by side and share it in L2.
    for pair in range(tl.program_id(0), num_items * NUM_KV_HEADS, tl.num_programs(0)):
        kv_head = pair // num_items
        item = work_ptr + (pair % num_items).to(tl.int64) * 8
        q0 = tl.load(item + 0)
        q1 = tl.load(item + 1)
        page0 = tl.load(item + 2)
        kv0 = tl.load(item + 3)
        kv1 = tl.load(item + 4)
        split = tl.load(item + 5)
        diag = tl.load(item + 6)
        orow = tl.load(item + 7)

        # Row r of the tile: query token q0 + r // GROUP_SIZE, head kv_head * GROUP_SIZE + r % GROUP_SIZE.
        tok = q0 + offs_m // GROUP_SIZE
        head = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE
        row_ok = (offs_m < TILE_Q * GROUP_SIZE) & (tok < q1)
        q_row = tl.load(q_rows_ptr + tok, mask=row_ok, other=0).to(tl.int64)
        q = tl.load(
            q_ptr + q_row[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        # The tile's last token (q1 - 1) sees the most KV; nothing past its diagonal is loaded.
        kv_hi = tl.minimum(kv1, q1 + diag)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
        v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head
        # KV tiles that every row of the tile sees whole (before kv_hi and at or below the first
        # token's diagonal) run without masks; the rest (the diagonal, the ragged end) with them.
        # Only for tiles of many rows (prefill, shared levels) and d256 decode tiles (on 4 warps),
        # where it measured faster; decode tiles of 16 rows up to head dim 128 keep the one masked
        # loop, which measured faster on long decodes (benchmarks/NOTES.md, "KV tiles without
        # masks" and "32-bit K/V offsets; d256 decode tiles on 4 warps").
        full_hi = kv0
        if BLOCK_M > 16 or BLOCK_D > 128:
            full_hi = kv0 + tl.maximum(tl.minimum(kv_hi, q0 + diag + 1) - kv0, 0) // BLOCK_N * BLOCK_N
        for start in range(kv0, full_hi, BLOCK_N):
            acc, m_i, l_i = _kv_tile(
                acc, m_i, l_i, q, start, kv_hi, tok, diag, kv_indices_ptr, page0, k_head, v_head,
                stride_k_page, stride_k_slot, stride_v_page, stride_v_slot, qk_scale,
                PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, UPCAST, DOT_PRECISION, False, WIDE_OFFSETS,
            )  # fmt: skip
        for start in range(full_hi, kv_hi, BLOCK_N):
            acc, m_i, l_i = _kv_tile(
                acc, m_i, l_i, q, start, kv_hi, tok, diag, kv_indices_ptr, page0, k_head, v_head,
                stride_k_page, stride_k_slot, stride_v_page, stride_v_slot, qk_scale,
                PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, UPCAST, DOT_PRECISION, True, WIDE_OFFSETS,
            )  # fmt: skip

        empty = l_i == 0.0
        out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
        # m_i and log2(l_i) are in log2 units; the LSE is returned in natural log (times ln 2).
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        o_row = tl.load(o_rows_ptr + orow + tok, mask=row_ok, other=0).to(tl.int64)
        # A token whose state is final (one level, one split) skips the partial rows and the merge.
        final = row_ok & (o_row < 0)
        partial = row_ok & (o_row >= 0)
        f_row = -1 - o_row
        o_row += split
        tl.store(
            o_ptr + o_row[:, None] * stride_o_row + head[:, None] * stride_o_head + offs_d[None, :],
            out,
            mask=partial[:, None] & d_ok[None, :],
        )
        tl.store(lse_ptr + o_row * stride_lse_row + head, lse, mask=partial)
        f_offs = f_row[:, None] * stride_final_row + head[:, None] * stride_final_head + offs_d[None, :]
        tl.store(
            final_ptr + f_offs,
            out,
            mask=final[:, None] & d_ok[None, :],
        )


class AttentionLaunch:
    """One attention launch with everything but the layer's tensors fixed when it is made (once per
    plan): the grid and the compile-time constants. Calling it reads the tensors' strides and
    launches the compiled kernel without Triton's per-call path (``BoundKernel``); no checks
    (callers validate once per plan and per layer). ``before_merge``: a merge launched with
    ``after_attention`` follows it, and may start while this launch ends (``dependent_launches``).
    """

    def __init__(
        self,
        *,
        num_programs: int,
        group_size: int,
        tile: TileConfig,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        before_merge: bool = False,
    ) -> None:
        upcast = interpreting() or dtype == torch.float32
        constants = dict(
            NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, GROUP_SIZE=group_size,
            TILE_Q=tile.block_m // group_size, HEAD_DIM=head_dim, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, BLOCK_D=max(16, next_pow2(head_dim)), UPCAST=upcast,
            DOT_PRECISION="ieee" if upcast else "tf32", LAUNCH_DEPENDENTS=before_merge,
            num_warps=tile.num_warps,
            # fp32 tiles are twice the bytes of the fp16/bf16 ones the block sizes were chosen for:
            # no multi-stage KV buffering, so they still fit in shared memory (fp32 is for checks).
            num_stages=1 if dtype == torch.float32 else tile.num_stages,
        )  # fmt: skip
        # By the KV pool of the layer (``offset_widths``): 32-bit offsets, a 64-bit page term, both
        # terms 64-bit. Each compiles on its first launch.
        self._kernels = tuple(
            BoundKernel(_attention_kernel, (num_programs,), dict(constants, WIDE_OFFSETS=wide))
            for wide in range(3)
        )
        self._plan_key = CachedSpecialization()

    def __call__(
        self,
        q: torch.Tensor,
        q_rows: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_indices: torch.Tensor,
        work: torch.Tensor,
        num_work: torch.Tensor,
        o_rows: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        final: torch.Tensor,
        qk_scale: float,
        v_scale: float = 1.0,
    ) -> None:
        """Run ``num_work[0]`` items of ``work``: see ``launch_attention`` for the arguments."""
        sq, sk, sv, so, sf = q.stride(), k.stride(), v.stride(), out.stride(), final.stride()
        scalars = (
            qk_scale, v_scale, sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1],
            lse.stride(0), sf[0], sf[1],
        )  # fmt: skip
        # The plan's buffers are the same objects for every layer: only the layer's tensors are read.
        plan = (q_rows, kv_indices, work, num_work, o_rows, out, lse)
        key = (self._plan_key(*plan), *specialization((q, k, v, final)), *scalars)
        kernel = self._kernels[offset_widths(k, v)]
        kernel.launch(key, (q, q_rows, k, v, kv_indices, work, num_work, o_rows, out, lse, final, *scalars))


def offset_widths(k: torch.Tensor, v: torch.Tensor) -> int:
    """Which terms of the K and V offsets (page x page stride + slot x slot stride) the attention
    kernel computes in 64 bits for these K and V views ``[num_pages, page_size, H, D]``: 0, none,
    while the last element of each lies less than 2**31 elements past its first (offsets are taken
    from each view's own first element, wherever its storage starts); 1, the page's term, past that;
    2, the slot's term too, where (page_size - 1) x the slot stride alone reaches 2**31 (slot-major
    pools). 32-bit offsets are cheaper to compute than 64-bit ones, most of all in prefill, and
    where they suffice the kernel uses them (benchmarks/NOTES.md, "32-bit K/V offsets")."""
    if _extent(k.shape, k.stride()) <= 2**31 and _extent(v.shape, v.stride()) <= 2**31:
        return 0
    slot_span = max((k.shape[1] - 1) * k.stride()[1], (v.shape[1] - 1) * v.stride()[1])
    return 2 if slot_span >= 2**31 else 1


def _extent(shape: torch.Size, stride: tuple[int, ...]) -> int:
    """One past the offset of a 4-D view's last element from its first (torch strides are not
    negative)."""
    return (shape[0] - 1) * stride[0] + (shape[1] - 1) * stride[1] + (shape[2] - 1) * stride[2] + shape[3]


def launch_attention(
    q: torch.Tensor,
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    work: torch.Tensor,
    num_work: torch.Tensor,
    o_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    final: torch.Tensor | None = None,
    qk_scale: float,
    v_scale: float = 1.0,
    num_programs: int,
    group_size: int,
    tile: TileConfig,
) -> None:
    """One launch over ``num_work[0]`` items of ``work`` (no checks: callers validate once per plan).

    k, v: [num_pages, page_size, Hkv, D] views (``split_kv_cache``), q's dtype or fp8;
    qk_scale: sm_scale * k_scale * log2(e); v_scale: the output's factor (an fp8 cache's V scale, else 1);
    num_programs: grid size; programs loop over (item, KV head) pairs, so any size >= 1 is correct.
    Query token t of an item at level offset OROW writes its (out, lse) partial state to row
    ``o_rows[OROW + t] + split`` of ``out`` / ``lse``, or, where that entry is ``-1 - r``, its output
    alone to row r of ``final`` [*, Hq, D] (default ``out``).
    """
    launch = AttentionLaunch(
        num_programs=num_programs, group_size=group_size, tile=tile, num_kv_heads=k.shape[2],
        page_size=k.shape[1], head_dim=q.shape[2], dtype=q.dtype,
    )  # fmt: skip
    final = out if final is None else final
    launch(q, q_rows, k, v, kv_indices, work, num_work, o_rows, out, lse, final, qk_scale, v_scale)


# ----------------------------------------------------------------------------------------------
# One level on its own


@dataclass(frozen=True)
class LevelSchedule:
    """A level's work list on the device, built once per batch by ``plan_level``.

    work: int32 [W, 8] on the device, one row per (M tile, split); num_work: int32 [1] = W.
    kv_indices: int32 [num_pages_in_level] on the device.
    splits: int32 [num_query_tokens] on the host: partial states this level writes for each token
        (rows ``o_rows[t] + 0 .. splits[t] - 1`` of the output, see ``launch_level``); 0 for the
        tokens of a group without KV, which the level does not write at all.
    max_page: largest page id referenced (-1 if none), checked against the cache at launch.
    """

    work: torch.Tensor
    num_work: torch.Tensor
    kv_indices: torch.Tensor
    splits: np.ndarray
    max_page: int
    num_query_tokens: int
    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    tile: TileConfig

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def block_m(self) -> int:
        return self.tile.block_m

    @property
    def tile_q(self) -> int:
        """Query tokens per M tile."""
        return self.tile.block_m // self.group_size


def plan_level(
    qo_indptr: np.ndarray | torch.Tensor,
    kv_indptr: np.ndarray | torch.Tensor,
    kv_indices: np.ndarray | torch.Tensor,
    kv_last_page_len: np.ndarray | torch.Tensor,
    *,
    causal: bool,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
    kv_chunk_size: int | None = None,
) -> LevelSchedule:
    """Build the work list of one level (host work, one upload).

    qo_indptr, kv_indptr: [G + 1]; kv_indices: [>= kv_indptr[-1]]; kv_last_page_len: [G] (tokens in a
    group's last page, 1..page_size; ignored for a group with no page). Integer numpy arrays or
    tensors (copied to the host). Groups must cover query tokens 0..qo_indptr[-1] in order.
    causal: mask bottom-right aligned: query j of a group with Q queries and Lk KV tokens sees KV
        positions <= Lk - Q + j.
    kv_chunk_size: KV tokens per split (rounded up to a multiple of the KV tile); None picks splits
        from the KV lengths and the device's SM count, splitting only when there are too few programs.
    """
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    level = check_level(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
    group_size = num_qo_heads // num_kv_heads
    tile = tile_config(level.max_rows_per_group * group_size, group_size, head_dim, page_size)
    device = torch.device(device)
    work, splits = level_work(
        level, causal=causal, group_size=group_size, num_kv_heads=num_kv_heads, tile=tile,
        sms=num_sms(device), kv_chunk_size=kv_chunk_size,
        min_split=min_split_tokens(1, tile.block_m, head_dim),  # a one-level plan's, as the backend's
    )  # fmt: skip
    work = longest_first(work)
    return LevelSchedule(
        work=torch.from_numpy(work.astype(np.int32).reshape(-1, WORK_COLS)).to(device),
        num_work=torch.tensor([work.shape[0]], dtype=torch.int32).to(device),
        kv_indices=torch.from_numpy(level.kv_indices.astype(np.int32)).to(device),
        splits=splits.astype(np.int32),
        max_page=level.max_page,
        num_query_tokens=level.num_query_tokens,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        causal=causal,
        tile=tile,
    )


def _check_inputs(sched: LevelSchedule, q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape[1:] != (sched.num_qo_heads, sched.head_dim):
        raise ValueError(
            f"q must be [num_tokens, {sched.num_qo_heads}, {sched.head_dim}], got {tuple(q.shape)}"
        )
    want = (sched.page_size, sched.num_kv_heads, sched.head_dim)
    if k.shape[1:] != want:
        raise ValueError(f"the KV cache has pages of {tuple(k.shape[1:])}, the plan needs {want}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if k.dtype != q.dtype and k.dtype != FP8_KV_DTYPE:
        raise ValueError(f"kv_cache dtype {k.dtype} is neither q's {q.dtype} nor {FP8_KV_DTYPE}")
    if q.stride(-1) != 1:
        raise ValueError("the head_dim axis of q must be contiguous")
    if sched.max_page >= k.shape[0]:
        raise ValueError(f"plan references page {sched.max_page}, the cache has {k.shape[0]} pages")


def launch_level(
    sched: LevelSchedule,
    q: torch.Tensor,
    kv_cache: KVCache,
    *,
    sm_scale: float,
    q_rows: torch.Tensor,
    o_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Run a planned level: for planned query token t (0 <= t < sched.num_query_tokens) and split
    s < sched.splits[t], write its normalised output to ``out[o_rows[t] + s]`` and its natural-log
    LSE to ``lse[o_rows[t] + s]`` (``-inf`` and 0 when the causal mask leaves it no KV). Tokens of
    groups without KV are not written.

    q: [*, Hq, D] fp16/bf16/fp32; planned token t is row ``q_rows[t]`` (int64 [nq], device).
    kv_cache: see ``split_kv_cache``, q's dtype or fp8 (``FP8_KV_DTYPE``).
    o_rows: int64 [nq] on the device. out: [*, Hq, D] float (fp32 for partial states); lse: [*, Hq] fp32.
    k_scale, v_scale: an fp8 cache's dequantization scales (``check_kv_scales``).
    """
    k, v = split_kv_cache(kv_cache)
    _check_inputs(sched, q, k)
    k_scale, v_scale = check_kv_scales(k.dtype, k_scale, v_scale)
    if out.stride(-1) != 1 or lse.stride(-1) != 1 or lse.dtype != torch.float32:
        raise ValueError("out and lse need a contiguous last axis, lse float32")
    check_runnable(q, k, v, q_rows, o_rows, out, lse, sched.work)
    num_items = sched.work.shape[0]
    if num_items == 0:
        return
    launch_attention(
        q, q_rows, k, v, sched.kv_indices, sched.work, sched.num_work, o_rows, out, lse,
        qk_scale=sm_scale * k_scale * LOG2E, v_scale=v_scale, num_programs=num_items * sched.num_kv_heads,
        group_size=sched.group_size, tile=sched.tile,
    )  # fmt: skip


def level_attention(
    q: torch.Tensor,
    kv_cache: KVCache,
    qo_indptr: np.ndarray | torch.Tensor,
    kv_indptr: np.ndarray | torch.Tensor,
    kv_indices: np.ndarray | torch.Tensor,
    kv_last_page_len: np.ndarray | torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None = None,
    out_dtype: torch.dtype = torch.float32,
    kv_chunk_size: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one level in one call (plans, launches, merges splits; the index arrays are
    copied to the host, so prefer ``plan_level`` + ``launch_level`` in a loop over layers).

    q: [nq, Hq, D] fp16/bf16/fp32, queries in the level's order; kv_cache: see ``split_kv_cache``.
    Index arrays and ``causal``/``kv_chunk_size``: see ``plan_level``. sm_scale defaults to D**-0.5.
    k_scale, v_scale: an fp8 cache's dequantization scales (``check_kv_scales``).
    Returns (out [nq, Hq, D] in out_dtype, lse [nq, Hq] float32, natural log; -inf and out 0 for
    queries with no KV).
    """
    k, _ = split_kv_cache(kv_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [nq, Hq, D], got {tuple(q.shape)}")
    nq, num_qo_heads, head_dim = q.shape
    sched = plan_level(
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
        causal=causal, page_size=k.shape[1], num_qo_heads=num_qo_heads,
        num_kv_heads=k.shape[2], head_dim=head_dim, device=q.device, kv_chunk_size=kv_chunk_size,
    )  # fmt: skip
    if sched.num_query_tokens != nq:
        raise ValueError(f"qo_indptr covers {sched.num_query_tokens} query tokens, q has {nq}")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = torch.empty((nq, num_qo_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((nq, num_qo_heads), dtype=torch.float32, device=q.device)
    rows = torch.arange(nq, dtype=torch.int64, device=q.device)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if (sched.splits == 1).all():
        launch_level(sched, q, kv_cache, sm_scale=scale, q_rows=rows, o_rows=rows, out=out, lse=lse, **scales)
        return out, lse
    starts = np.cumsum(sched.splits, dtype=np.int64) - sched.splits
    num_rows = int(sched.splits.sum())
    part_o = torch.empty((num_rows, num_qo_heads, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_rows, num_qo_heads), dtype=torch.float32, device=q.device)
    starts_t = torch.from_numpy(starts).to(q.device)
    launch_level(
        sched, q, kv_cache, sm_scale=scale, q_rows=rows, o_rows=starts_t, out=part_o, lse=part_lse, **scales
    )
    counts = torch.from_numpy(sched.splits).to(q.device)  # int32
    merge_states_varlen(part_o, part_lse, starts_t, counts, out, out_lse=lse)
    return out, lse

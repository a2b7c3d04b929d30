"""Attention of one cascade level over a paged KV cache, with natural-log LSE.

A level is a list of groups; group g owns query tokens ``qo_indptr[g]:qo_indptr[g+1]`` and KV pages
``kv_indices[kv_indptr[g]:kv_indptr[g+1]]`` (the last one holding ``kv_last_page_len[g]`` tokens).
One program computes, for one KV head, a tile of BLOCK_M rows = (query tokens of one group) x (the
GROUP_SIZE query heads that share that KV head), so ``tl.dot`` runs on tensor cores and every KV
tile is read once for all of the tile's rows: a prefix shared by a whole group is read once per
group, KV head and M tile. Decode (one query per group) and causal prefill chunks use the same kernel.

Long KV segments with few programs are split across programs ("split-KV"); each split writes a
partial (out, lse) row and ``merge_state`` combines them.

Host side: ``plan_level`` turns a level's index arrays into a work list (one row per program along
grid axis 0) once per batch; ``launch_level`` runs it per layer; ``level_attention`` does both and
the merge, for one-off calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from prefix_cache.kernels._common import LOG2E, cdiv, check_runnable, interpreting, next_pow2, num_sms
from prefix_cache.kernels.merge_state import merge_states_varlen

# Columns of a work item (int32): query tokens [Q0, Q1) of the tile, the group's first entry in
# kv_indices, KV token range [KV0, KV1) of this split, the split's index, and the causal diagonal:
# query token t may see KV positions <= t + DIAG.
_Q0, _Q1, _PAGE0, _KV0, _KV1, _SPLIT, _DIAG = range(7)
_WORK_COLS = 7

# Split-KV: never give a split fewer KV tokens than this (below it, the partial rows and the merge
# cost more than the parallelism gains), nor a group more splits than _MAX_SPLITS.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64


@triton.jit
def _level_attention_kernel(
    q_ptr,  # [*, Hq, D]
    q_rows_ptr,  # [nq] int64: row of q holding planned query token t
    kv_ptr,  # [P, 2, page_size, Hkv, D]
    kv_indices_ptr,  # int32 page ids
    work_ptr,  # int32 [W, 7], see _Q0.._DIAG
    o_rows_ptr,  # [nq] int64: row of o/lse for token t's split 0 (split s at + s)
    o_ptr,  # [*, Hq, D]
    lse_ptr,  # [*, Hq] float32
    qk_scale,  # sm_scale * log2(e)
    stride_q_row,
    stride_q_head,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_o_row,
    stride_o_head,
    stride_lse_row,
    PAGE_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    TILE_Q: tl.constexpr,  # query tokens per M tile: BLOCK_M // GROUP_SIZE
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (interpreter, fp32 inputs)
    # "ieee" for fp32 dots (no tf32 rounding); "tf32", Triton's default, has no effect on fp16/bf16.
    DOT_PRECISION: tl.constexpr,
):
    item = work_ptr + tl.program_id(0).to(tl.int64) * 7
    kv_head = tl.program_id(1)
    q0 = tl.load(item + 0)
    q1 = tl.load(item + 1)
    page0 = tl.load(item + 2)
    kv0 = tl.load(item + 3)
    kv1 = tl.load(item + 4)
    split = tl.load(item + 5)
    diag = tl.load(item + 6)

    # Row r of the tile is query token q0 + r // GROUP_SIZE, head kv_head * GROUP_SIZE + r % GROUP_SIZE.
    offs_m = tl.arange(0, BLOCK_M)
    tok = q0 + offs_m // GROUP_SIZE
    head = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE
    row_ok = (offs_m < TILE_Q * GROUP_SIZE) & (tok < q1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_row = tl.load(q_rows_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    kv_hi = kv1
    if CAUSAL:
        # The tile's last token (q1 - 1) sees the most KV; nothing past its diagonal is loaded.
        kv_hi = tl.minimum(kv1, q1 + diag)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv0, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        # Token n of the segment lives in page kv_indices[page0 + n // PAGE_SIZE], slot n % PAGE_SIZE.
        page = tl.load(kv_indices_ptr + page0 + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot + kv_head * stride_kv_head
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv_kv + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        valid = n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= (tok + diag)[:, None])
        s = tl.where(valid, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no KV yet keep m = -inf; shifting them by 0 keeps p and alpha at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # m_i and log2(l_i) are in log2 units; the LSE is returned in natural log (times ln 2).
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_row = tl.load(o_rows_ptr + tok, mask=row_ok, other=0).to(tl.int64) + split
    tl.store(
        o_ptr + o_row[:, None] * stride_o_row + head[:, None] * stride_o_head + offs_d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + o_row * stride_lse_row + head, lse, mask=row_ok)


@dataclass(frozen=True)
class LevelSchedule:
    """A level's work list on the device, built once per batch by ``plan_level``.

    work: int32 [W, 7] on the device; row w is program w of grid axis 0 (axis 1 is the KV head).
    kv_indices: int32 [num_pages_in_level] on the device.
    splits: int32 [num_query_tokens] on the host: partial states this level writes for each token
        (rows ``o_rows[t] + 0 .. splits[t] - 1`` of the output, see ``launch_level``); 0 for the
        tokens of a group without KV, which the level does not write at all.
    max_page: largest page id referenced (-1 if none), checked against the cache at launch.
    """

    work: torch.Tensor
    kv_indices: torch.Tensor
    splits: np.ndarray
    max_page: int
    num_query_tokens: int
    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def tile_q(self) -> int:
        """Query tokens per M tile."""
        return self.block_m // self.group_size


def _as_int_array(name: str, a: np.ndarray | torch.Tensor) -> np.ndarray:
    arr = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def _block_config(max_rows: int, group_size: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a level whose largest group has ``max_rows``
    query rows (tokens x group_size). tl.dot needs every block dimension >= 16."""
    block_d = max(16, next_pow2(head_dim))
    floor_m = max(16, next_pow2(group_size))
    if interpreting():
        # The interpreter is slow per operation, not per element; small KV tiles still exercise
        # multi-tile loops in tests at tiny sizes.
        return max(floor_m, min(next_pow2(max_rows), 64)), 16, 1, 1
    cap_m = 128 if block_d <= 128 else 64
    block_m = max(floor_m, min(next_pow2(max_rows), cap_m))
    block_n = 64 if block_d <= 128 else 32
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 3 if block_d <= 128 else 2
    return block_m, block_n, num_warps, num_stages


def _split_length(kv_len: np.ndarray, splits: np.ndarray, multiple: int) -> np.ndarray:
    """Per group: KV tokens per split, ceil(kv_len / splits) rounded up to a multiple of the KV tile."""
    per = -(-kv_len // splits)
    return np.maximum(-(-per // multiple) * multiple, multiple)


def _auto_chunk(kv_len: np.ndarray, programs: np.ndarray, block_m: int, block_n: int, sms: int) -> int:
    """KV tokens per split for a level whose group g runs ``programs[g]`` programs (M tiles x KV
    heads) over ``kv_len[g]`` tokens. Splits only when the unsplit level leaves SMs idle.

    Model: programs resident per SM by tile height (registers and shared memory of the sm_90 builds:
    1 at 128 rows, 2 at 64, 4 below); a wave of resident programs takes as long as its longest
    chunk. Among chunk lengths that cut the longest group into 1..64 equal parts, pick the fewest
    waves x chunk, moving to more splits only for a clear gain.
    """
    slots = sms * (1 if block_m >= 128 else 2 if block_m >= 64 else 4)
    unsplit = np.iinfo(np.int32).max
    if int(programs.sum()) >= slots or kv_len.size == 0:
        return unsplit
    longest = int(kv_len.max())
    best_cost, best_chunk = longest, unsplit  # one wave of the unsplit level
    for parts in range(2, _MAX_SPLITS + 1):
        chunk = cdiv(cdiv(longest, parts), block_n) * block_n
        if chunk < _MIN_SPLIT_TOKENS:
            break
        total = int((programs * np.maximum(-(-kv_len // chunk), 1)).sum())
        cost = cdiv(total, slots) * chunk
        # More splits must win clearly: each also costs partial rows to write and merge.
        if cost < 0.9 * best_cost:
            best_cost, best_chunk = cost, chunk
    return best_chunk


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
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    qo = _as_int_array("qo_indptr", qo_indptr)
    kvp = _as_int_array("kv_indptr", kv_indptr)
    idx = _as_int_array("kv_indices", kv_indices)
    last = _as_int_array("kv_last_page_len", kv_last_page_len)
    num_groups = last.shape[0]
    if qo.shape[0] != num_groups + 1 or kvp.shape[0] != num_groups + 1:
        raise ValueError(
            f"qo_indptr {qo.shape}, kv_indptr {kvp.shape} and kv_last_page_len {last.shape} "
            "disagree on the group count"
        )
    q_len = np.diff(qo)
    num_pages = np.diff(kvp)
    if qo[0] != 0 or (q_len < 0).any() or (num_pages < 0).any() or kvp[0] < 0 or kvp[-1] > idx.shape[0]:
        raise ValueError("qo_indptr must start at 0, indptrs must be non-decreasing and within kv_indices")
    has_kv = num_pages > 0
    if ((last < 1) | (last > page_size))[has_kv].any():
        raise ValueError(f"kv_last_page_len must be in 1..{page_size} for groups with pages")
    used = idx[kvp[0] : kvp[-1]]
    if used.size and used.min() < 0:
        raise ValueError("kv_indices holds negative page ids")
    kv_len = np.where(has_kv, (num_pages - 1) * page_size + last, 0)

    group_size = num_qo_heads // num_kv_heads
    max_rows = int(q_len.max(initial=0)) * group_size
    block_m, block_n, num_warps, num_stages = _block_config(max_rows, group_size, head_dim)
    tile_q = block_m // group_size
    m_tiles = -(-q_len // tile_q)  # 0 for a group without queries: it writes nothing

    device = torch.device(device)
    if kv_chunk_size is None:
        chunk = _auto_chunk(kv_len, m_tiles * num_kv_heads, block_m, block_n, num_sms(device))
    else:
        if kv_chunk_size <= 0:
            raise ValueError(f"kv_chunk_size must be positive, got {kv_chunk_size}")
        chunk = kv_chunk_size
    chunk = min(cdiv(chunk, block_n) * block_n, np.iinfo(np.int32).max // 2)
    # A group without KV gets no program and no partial row: the merge turns "no rows" into out 0
    # and lse -inf. Groups capped at _MAX_SPLITS take longer chunks instead of more splits.
    splits = np.where(kv_len > 0, np.clip(-(-kv_len // chunk), 1, _MAX_SPLITS), 0)
    group_chunk = _split_length(kv_len, np.maximum(splits, 1), block_n)

    items = splits * m_tiles
    total = int(items.sum())
    g = np.repeat(np.arange(num_groups), items)
    local = np.arange(total) - np.repeat(np.cumsum(items) - items, items)
    # m-tiles innermost: the programs that read the same KV chunk run side by side and share it in L2.
    s = local // m_tiles[g]
    m = local % m_tiles[g]
    work = np.empty((total, _WORK_COLS), dtype=np.int64)
    work[:, _Q0] = qo[g] + m * tile_q
    work[:, _Q1] = np.minimum(qo[g] + (m + 1) * tile_q, qo[g + 1])
    work[:, _PAGE0] = kvp[g]
    work[:, _KV0] = np.minimum(s * group_chunk[g], kv_len[g])
    work[:, _KV1] = np.minimum((s + 1) * group_chunk[g], kv_len[g])
    work[:, _SPLIT] = s
    work[:, _DIAG] = kv_len[g] - q_len[g] - qo[g]
    if work.size and (np.abs(work).max() >= 2**31 or idx.max(initial=0) >= 2**31):
        raise ValueError("level too large for int32 work items")

    return LevelSchedule(
        work=torch.from_numpy(work.astype(np.int32)).to(device),
        kv_indices=torch.from_numpy(idx.astype(np.int32)).to(device),
        splits=np.repeat(splits, q_len).astype(np.int32),
        max_page=int(used.max(initial=-1)),
        num_query_tokens=int(qo[-1]),
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        causal=causal,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _check_inputs(sched: LevelSchedule, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape[1:] != (sched.num_qo_heads, sched.head_dim):
        raise ValueError(
            f"q must be [num_tokens, {sched.num_qo_heads}, {sched.head_dim}], got {tuple(q.shape)}"
        )
    want = (2, sched.page_size, sched.num_kv_heads, sched.head_dim)
    if kv_cache.dim() != 5 or kv_cache.shape[1:] != want:
        raise ValueError(
            f"kv_cache must be [num_pages, {', '.join(map(str, want))}], got {tuple(kv_cache.shape)}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from q's {q.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of q and kv_cache must be contiguous")
    if sched.max_page >= kv_cache.shape[0]:
        raise ValueError(f"plan references page {sched.max_page}, the cache has {kv_cache.shape[0]} pages")


def launch_level(
    sched: LevelSchedule,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    sm_scale: float,
    q_rows: torch.Tensor,
    o_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Run a planned level: for planned query token t (0 <= t < sched.num_query_tokens) and split
    s < sched.splits[t], write its normalised output to ``out[o_rows[t] + s]`` and its natural-log
    LSE to ``lse[o_rows[t] + s]`` (``-inf`` and 0 when the causal mask leaves it no KV). Tokens of
    groups without KV are not written.

    q: [*, Hq, D] fp16/bf16/fp32; planned token t is row ``q_rows[t]`` (int64 [nq], device).
    kv_cache: [num_pages, 2, page_size, Hkv, D], q's dtype.
    o_rows: int64 [nq] on the device. out: [*, Hq, D] float (fp32 for partial states); lse: [*, Hq] fp32.
    """
    _check_inputs(sched, q, kv_cache)
    if out.stride(-1) != 1 or lse.stride(-1) != 1 or lse.dtype != torch.float32:
        raise ValueError("out and lse need a contiguous last axis, lse float32")
    check_runnable(q, kv_cache, q_rows, o_rows, out, lse, sched.work)
    num_items = sched.work.shape[0]
    if num_items == 0:
        return
    upcast = interpreting() or q.dtype == torch.float32
    # fp32 tiles are twice the bytes of the fp16/bf16 ones the block sizes were chosen for: no
    # multi-stage KV buffering, so they still fit in shared memory (fp32 is for checks, not speed).
    num_stages = 1 if q.dtype == torch.float32 else sched.num_stages
    _level_attention_kernel[(num_items, sched.num_kv_heads)](
        q, q_rows, kv_cache, sched.kv_indices, sched.work, o_rows, out, lse,
        sm_scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1), lse.stride(0),
        PAGE_SIZE=sched.page_size, GROUP_SIZE=sched.group_size, TILE_Q=sched.tile_q,
        HEAD_DIM=sched.head_dim, BLOCK_M=sched.block_m, BLOCK_N=sched.block_n,
        BLOCK_D=max(16, next_pow2(sched.head_dim)), CAUSAL=sched.causal, UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
        num_warps=sched.num_warps, num_stages=num_stages,
    )  # fmt: skip


def level_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_indptr: np.ndarray | torch.Tensor,
    kv_indptr: np.ndarray | torch.Tensor,
    kv_indices: np.ndarray | torch.Tensor,
    kv_last_page_len: np.ndarray | torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None = None,
    out_dtype: torch.dtype = torch.float32,
    kv_chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one level in one call (plans, launches, merges splits; the index arrays are
    copied to the host, so prefer ``plan_level`` + ``launch_level`` in a loop over layers).

    q: [nq, Hq, D] fp16/bf16/fp32, queries in the level's order; kv_cache: [P, 2, page_size, Hkv, D].
    Index arrays and ``causal``/``kv_chunk_size``: see ``plan_level``. sm_scale defaults to D**-0.5.
    Returns (out [nq, Hq, D] in out_dtype, lse [nq, Hq] float32, natural log; -inf and out 0 for
    queries with no KV).
    """
    if q.dim() != 3 or kv_cache.dim() != 5:
        raise ValueError(
            f"q must be [nq, Hq, D] and kv_cache 5-D, got {tuple(q.shape)} and {tuple(kv_cache.shape)}"
        )
    nq, num_qo_heads, head_dim = q.shape
    sched = plan_level(
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
        causal=causal, page_size=kv_cache.shape[2], num_qo_heads=num_qo_heads,
        num_kv_heads=kv_cache.shape[3], head_dim=head_dim, device=q.device, kv_chunk_size=kv_chunk_size,
    )  # fmt: skip
    if sched.num_query_tokens != nq:
        raise ValueError(f"qo_indptr covers {sched.num_query_tokens} query tokens, q has {nq}")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = torch.empty((nq, num_qo_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((nq, num_qo_heads), dtype=torch.float32, device=q.device)
    rows = torch.arange(nq, dtype=torch.int64, device=q.device)
    if (sched.splits == 1).all():
        launch_level(sched, q, kv_cache, sm_scale=scale, q_rows=rows, o_rows=rows, out=out, lse=lse)
        return out, lse
    starts = np.cumsum(sched.splits, dtype=np.int64) - sched.splits
    num_rows = int(sched.splits.sum())
    part_o = torch.empty((num_rows, num_qo_heads, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_rows, num_qo_heads), dtype=torch.float32, device=q.device)
    starts_t = torch.from_numpy(starts).to(q.device)
    launch_level(sched, q, kv_cache, sm_scale=scale, q_rows=rows, o_rows=starts_t, out=part_o, lse=part_lse)
    counts = torch.from_numpy(sched.splits).to(q.device)  # int32
    merge_states_varlen(part_o, part_lse, starts_t, counts, out, out_lse=lse)
    return out, lse

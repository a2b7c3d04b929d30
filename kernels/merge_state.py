"""Merging partial attention states (out_i, lse_i) of disjoint KV segments into one.

For segments i of one query's KV with natural-log sum-exp ``lse_i`` and normalised output ``out_i``:
``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i``. A segment with
``lse_i = -inf`` (no KV) contributes nothing, whatever its ``out_i`` holds; a query whose segments
are all empty gets ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefix_cache.kernels._common import check_runnable, gdc_wait, next_pow2, num_sms
from prefix_cache.kernels._launch import BoundKernel, CachedSpecialization, specialization


@triton.jit
def _fold_rows(
    m, denom, acc, o_ptr, lse_ptr, start, count, step, stride_o_row, stride_o_head, stride_lse_row,
    offs_h, offs_d, h_ok, hd_ok,
    LSE_SCALE: tl.constexpr,  # 1.0 for natural-log LSEs, ln 2 for base-2 ones
):  # fmt: skip
    """Fold the ``count`` partial rows ``start + i * step`` into the running (max, denominator,
    weighted sum) of a tile of heads. Two rows per step: both loads are in flight at once, which
    halves the chain of dependent loads of a token with many rows, which shortens plans of few
    tokens split many ways and leaves batches of hundreds of tokens as they were
    (benchmarks/NOTES.md, "two partial rows per step")."""
    for i in range(0, count, 2):
        row = start + i * step
        s0, o0 = _load_row(
            o_ptr, lse_ptr, row, stride_o_row, stride_o_head, stride_lse_row, offs_h, offs_d, h_ok, hd_ok,
            LSE_SCALE,
        )  # fmt: skip
        # The second row exists unless count is odd and this is the last step (a vector: the
        # interpreter masks with tensors only).
        two = (offs_h * 0 + i + 1) < count
        s1, o1 = _load_row(
            o_ptr, lse_ptr, row + step, stride_o_row, stride_o_head, stride_lse_row, offs_h, offs_d,
            h_ok & two, hd_ok & two[:, None], LSE_SCALE,
        )  # fmt: skip
        m, denom, acc = _fold_row(m, denom, acc, s0, o0)
        m, denom, acc = _fold_row(m, denom, acc, s1, o1)
    return m, denom, acc


@triton.jit
def _load_row(
    o_ptr, lse_ptr, row, stride_o_row, stride_o_head, stride_lse_row, offs_h, offs_d, h_ok, hd_ok,
    LSE_SCALE: tl.constexpr,
):  # fmt: skip
    """(lse [BLOCK_H] in natural log, out [BLOCK_H, BLOCK_D]) of one partial row, fp32; masked heads
    read -inf and 0."""
    s = tl.load(lse_ptr + row * stride_lse_row + offs_h, mask=h_ok, other=float("-inf")).to(tl.float32)
    o = tl.load(
        o_ptr + row * stride_o_row + offs_h[:, None] * stride_o_head + offs_d[None, :],
        mask=hd_ok,
        other=0.0,
    ).to(tl.float32)
    return s * LSE_SCALE, o


@triton.jit
def _fold_row(m, denom, acc, s, o):
    """Fold one partial state (lse ``s``, output ``o``) into the running (max, denominator, sum)."""
    m_new = tl.maximum(m, s)
    # A head with only empty segments so far keeps m = -inf; shifting by 0 avoids (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(s - m_safe)
    # An empty segment's output is never read into the sum, so garbage there cannot become NaN.
    acc = acc * alpha[:, None] + tl.where(w[:, None] > 0.0, o * w[:, None], 0.0)
    denom = denom * alpha + w
    return m_new, denom, acc


@triton.jit
def _merge_states_kernel(
    o_ptr,  # [R, H, D] partial outputs
    lse_ptr,  # [R, H] partial natural-log LSE
    starts_ptr,  # [T] int: first partial row of token t (VARLEN)
    counts_ptr,  # [T] int: partial rows of token t (VARLEN)
    out_rows_ptr,  # [T] int64: output row of token t (SCATTER)
    out_ptr,  # [*, H, D]
    out_lse_ptr,  # [*, H] float32 (WRITE_LSE)
    ext_o_ptr,  # [R2, H, D] more partial outputs, any float dtype (EXTRA)
    ext_lse_ptr,  # [R2, H] their base-2 LSE (FlashInfer's convention) (EXTRA)
    ext_ptr,  # [3, T] int32: token t's first row in ext_o, rows between its states, its states (EXTRA)
    num_heads,
    fixed_count,  # partial rows per token when not VARLEN
    row_step,  # distance in rows between a token's consecutive partial rows
    num_tokens,  # T (EXTRA: the row length of ext_ptr)
    stride_o_row,
    stride_o_head,
    stride_lse_row,
    stride_out_row,
    stride_out_head,
    stride_out_lse_row,
    stride_ext_row,
    stride_ext_head,
    stride_ext_lse_row,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr,
    SCATTER: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    EXTRA: tl.constexpr,
    # Launched with programmatic dependent launch after the attention launch: its partial rows are
    # read only once that launch has finished and its writes are visible.
    WAIT_PRIOR: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    hd_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]

    if VARLEN:
        start = tl.load(starts_ptr + t).to(tl.int64)
        count = tl.load(counts_ptr + t)
    else:
        start = t.to(tl.int64)
        count = fixed_count

    if EXTRA:
        ext_start = tl.load(ext_ptr + t).to(tl.int64)
        ext_step = tl.load(ext_ptr + num_tokens + t)
        ext_count = tl.load(ext_ptr + 2 * num_tokens + t)
    out_row = tl.load(out_rows_ptr + t).to(tl.int64) if SCATTER else t.to(tl.int64)
    # Everything above is the plan's; the partial rows below are the attention launch's.
    if WAIT_PRIOR:
        gdc_wait()

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m, denom, acc = _fold_rows(
        m, denom, acc, o_ptr, lse_ptr, start, count, row_step, stride_o_row, stride_o_head,
        stride_lse_row, offs_h, offs_d, h_ok, hd_ok, 1.0,
    )  # fmt: skip
    if EXTRA:
        m, denom, acc = _fold_rows(
            m, denom, acc, ext_o_ptr, ext_lse_ptr, ext_start, ext_count, ext_step, stride_ext_row,
            stride_ext_head, stride_ext_lse_row, offs_h, offs_d, h_ok, hd_ok, 0.6931471805599453,
        )  # fmt: skip

    empty = denom == 0.0
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    # A negative output row is a padding token of a fixed-size (CUDA-graph) launch: nothing to write.
    keep = (offs_h * 0 + out_row) >= 0  # as a vector: the interpreter masks with tensors only
    tl.store(
        out_ptr + out_row * stride_out_row + offs_h[:, None] * stride_out_head + offs_d[None, :],
        out,
        mask=hd_ok & keep[:, None],
    )
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, denom)))
        tl.store(out_lse_ptr + out_row * stride_out_lse_row + offs_h, lse, mask=h_ok & keep)


#: A merge launch cuts a token's heads into tiles until it has this many programs per SM (or its
#: tiles reach ``MIN_BLOCK_H`` heads): few tokens with many partial rows each are a chain of
#: dependent loads per program, and one program per token leaves most SMs idle.
PROGRAMS_PER_SM = 2
MIN_BLOCK_H = 4


def _block_h(num_tokens: int, num_heads: int, block_d: int, sms: int) -> int:
    """Heads per merge program: about 4K fp32 accumulator elements (all heads of a token for
    head_dim <= 128), fewer while the launch has under ``PROGRAMS_PER_SM`` programs per SM."""
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    while block_h > MIN_BLOCK_H and num_tokens * -(-num_heads // block_h) < PROGRAMS_PER_SM * sms:
        block_h //= 2
    return block_h


def merge_states(
    o: torch.Tensor, lse: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial states per query into one.

    o: [N, T, H, D] partial outputs (any float dtype), lse: [N, T, H] natural-log LSE (-inf: empty).
    Returns (out [T, H, D] in ``out_dtype`` (default o's dtype), lse [T, H] float32).
    """
    if o.dim() != 4 or lse.shape != o.shape[:3]:
        raise ValueError(
            f"expected o [N, T, H, D] and lse [N, T, H], got {tuple(o.shape)} and {tuple(lse.shape)}"
        )
    check_runnable(o, lse)
    n, t, h, d = o.shape
    o = o if o.stride(-1) == 1 else o.contiguous()
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    out = torch.empty((t, h, d), dtype=out_dtype or o.dtype, device=o.device)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=o.device)
    if t == 0 or h == 0:
        return out, out_lse
    # Partial row (i, t) of the [N*T] flattening is t + i*T; strides across N must be uniform.
    if n > 1 and (o.stride(0) != t * o.stride(1) or lse.stride(0) != t * lse.stride(1)):
        o, lse = o.contiguous(), lse.contiguous()
    block_d = max(16, next_pow2(d))
    block_h = _block_h(t, h, block_d, num_sms(o.device))
    _merge_states_kernel[(t, triton.cdiv(h, block_h))](
        o, lse, o, o, o, out, out_lse, o, lse, o,
        h, n, t, t,
        o.stride(1), o.stride(2), lse.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0), 0, 0, 0,
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, VARLEN=False, SCATTER=False,
        WRITE_LSE=True, EXTRA=False, WAIT_PRIOR=False,
    )  # fmt: skip
    return out, out_lse


def merge_states_varlen(
    o: torch.Tensor,
    lse: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    out: torch.Tensor,
    *,
    out_rows: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> None:
    """Merge a variable number of partial states per query, writing into ``out`` in place.

    o: [R, H, D] partial outputs, lse: [R, H] natural-log LSE; query t owns the rows
    ``starts[t] : starts[t] + counts[t]`` (int32/int64 [T], on o's device; a count of 0 gives out 0).
    out: [*, H, D], any float dtype; query t is written to row ``out_rows[t]`` (int32/int64 [T];
    default t; a negative row skips the query), which lets the merge undo a permutation of the
    queries. out_lse: optional [*, H] float32, same rows.
    """
    t = starts.shape[0]
    h, d = o.shape[1], o.shape[2]
    if lse.shape != o.shape[:2] or counts.shape != starts.shape or out.shape[1:] != o.shape[1:]:
        raise ValueError("merge_states_varlen: inconsistent shapes")
    if o.stride(-1) != 1 or out.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError("merge_states_varlen: the last dimension of o, lse and out must be contiguous")
    check_runnable(o, lse, starts, counts, out)
    if t == 0 or h == 0:
        return
    block_d = max(16, next_pow2(d))
    block_h = _block_h(t, h, block_d, num_sms(o.device))
    lse_out = out_lse if out_lse is not None else lse
    _merge_states_kernel[(t, triton.cdiv(h, block_h))](
        o, lse, starts, counts, out_rows if out_rows is not None else starts, out, lse_out, o, lse, starts,
        h, 0, 1, t,
        o.stride(0), o.stride(1), lse.stride(0),
        out.stride(0), out.stride(1), lse_out.stride(0), 0, 0, 0,
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, VARLEN=True,
        SCATTER=out_rows is not None, WRITE_LSE=out_lse is not None, EXTRA=False,
        WAIT_PRIOR=False,
    )  # fmt: skip


class MergeLaunch:
    """``merge_states_varlen`` with ``out_rows`` and without its checks (the triton backend checks once
    per plan), its grid and constants fixed when made: one program per query token and tile of heads.

    sms: the device's SMs (the tile of heads shrinks while the grid would leave them idle). extra:
    the tokens also have states in a second pair of buffers (another kernel's output in its own
    dtype and base-2 LSE; see ``__call__``'s ``ext``). after_attention: launched with programmatic
    dependent launch (``dependent_launches``), its programs start while the attention launch before
    it (``AttentionLaunch``'s ``before_merge``) ends and wait in the kernel for its results (they
    read the plan's tables before the wait): part of the gap between the two launches is hidden
    (benchmarks/NOTES.md, "the merge launched as a dependent of its attention launch").
    """

    def __init__(
        self,
        num_tokens: int,
        num_heads: int,
        head_dim: int,
        *,
        sms: int,
        extra: bool = False,
        after_attention: bool = False,
    ) -> None:
        block_d = max(16, next_pow2(head_dim))
        block_h = _block_h(num_tokens, num_heads, block_d, sms)
        self.num_heads, self.num_tokens = num_heads, num_tokens
        self._kernel = BoundKernel(
            _merge_states_kernel,
            (num_tokens, -(-num_heads // block_h)),
            dict(
                HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, VARLEN=True,
                SCATTER=True, WRITE_LSE=False, EXTRA=extra, WAIT_PRIOR=after_attention,
                # Only when set: a Triton before 3.4 rejects the option, even as False.
                **({"launch_pdl": True} if after_attention else {}),
            ),
        )  # fmt: skip
        self._plan_key = CachedSpecialization()

    def __call__(
        self,
        o: torch.Tensor,
        lse: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        out_rows: torch.Tensor,
        ext: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """ext (with ``extra``): (ext_o [R2, H, D], ext_lse [R2, H] base 2, rows [3, num_tokens] int32):
        token t's states there are rows ``rows[0, t] + i * rows[1, t]`` for i < ``rows[2, t]``."""
        ext_o, ext_lse, ext_rows = ext if ext is not None else (o, lse, starts)
        so, sout, slse, se = o.stride(), out.stride(), lse.stride(0), ext_o.stride()
        scalars = (
            self.num_heads, 0, 1, self.num_tokens, so[0], so[1], slse, sout[0], sout[1], slse, se[0], se[1],
            ext_lse.stride(0),
        )  # fmt: skip
        # Everything but ``out`` is the plan's, the same objects for every layer.
        plan_args = (o, lse, starts, counts, out_rows, ext_o, ext_lse, ext_rows)
        key = (self._plan_key(*plan_args), *specialization((out,)), *scalars)
        args = (o, lse, starts, counts, out_rows, out, lse, ext_o, ext_lse, ext_rows, *scalars)
        self._kernel.launch(key, args)

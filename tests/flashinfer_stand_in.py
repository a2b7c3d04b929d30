"""A stand-in for FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, for CPU tests of the code that pads
plans for its CUDA-graph mode (``prefix_cache.attention.flashinfer_graphs``) and of the code that splits
shared levels into its requests (``prefix_cache.attention.flashinfer_levels``: both modes, its base-2
LSE).

It keeps the contract of FlashInfer 0.6.8's wrapper that the padding relies on, from its
documentation and source: in CUDA-graph mode a fixed batch size (``len(qo_indptr_buf) - 1``) that
every plan must have and a first plan that fixes the most query rows later plans may have; ``run``
taking q with exactly the plan's rows; a request's KV length ``max(pages - 1, 0) * page_size +
last_page_len`` (its last page length 1..page_size, 0 without pages); causal masks aligned
bottom-right; zeros for the rows of a request without KV; and FA2's split results in the float
workspace, sized for the fixed shape (``PrefillPlan`` in FlashInfer's scheduler: 2 programs per SM);
an fp8 KV cache planned as ``kv_data_type`` (refused by FA3 beside a 16-bit q) and read as stored
value x ``k_scale`` / ``v_scale`` given to ``run``.
Attention is computed in float64 from the wrapper's own index buffers, request by request.
"""

from __future__ import annotations

import math

import torch

#: The SM count ``prefix_cache.kernels._common.num_sms`` gives CPU tensors (an H200's).
NUM_SMS = 132


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, workspace, kv_layout, *, use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 backend="auto"):  # fmt: skip
        assert kv_layout == "NHD" and backend in ("fa2", "fa3", "auto")
        self.workspace, self.backend, self.graph = workspace, backend, use_cuda_graph
        self.max_rows = None
        if not use_cuda_graph:
            return
        self.batch = qo_indptr_buf.shape[0] - 1
        assert (
            paged_kv_indptr_buf.shape[0] == self.batch + 1
            and paged_kv_last_page_len_buf.shape[0] == self.batch
        )
        self.qo, self.kv, self.indices, self.last = (
            qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf
        )  # fmt: skip

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, causal, sm_scale, q_data_type, kv_data_type):  # fmt: skip
        rows = int(qo_indptr[-1])
        if not self.graph:  # plain mode: the plan's own arrays, any batch size
            self.batch = qo_indptr.shape[0] - 1
            self.qo, self.kv, self.indices, self.last = qo_indptr, kv_indptr, kv_indices, last_page_len
        if qo_indptr.shape[0] - 1 != self.batch:
            raise ValueError(f"batch size {qo_indptr.shape[0] - 1} != fixed {self.batch}")
        if self.graph and self.max_rows is None:
            self.max_rows = rows
        elif self.graph and rows > self.max_rows:
            raise ValueError(f"{rows} rows over the first plan's {self.max_rows}")
        if kv_indices.shape[0] > self.indices.shape[0]:
            raise ValueError("paged_kv_indices over the buffer")
        if self.backend == "fa3" and kv_data_type == torch.float8_e4m3fn and q_data_type != kv_data_type:
            raise ValueError("FA3 takes an fp8 KV cache only with an fp8 q")
        assert bool((qo_indptr.diff() >= 0).all()) and bool((kv_indptr.diff() >= 0).all())
        assert int(kv_indptr[-1]) <= kv_indices.shape[0]
        pages = kv_indptr.diff()
        last = last_page_len
        if not bool(torch.where(pages > 0, (last >= 1) & (last <= page_size), last == 0).all()):
            raise ValueError("kv_last_page_len must be 1..page_size with pages, 0 without")
        if self.backend == "fa2":  # its split results, sized in CUDA-graph mode for the fixed shape
            group = num_qo_heads // num_kv_heads
            tile = 16 if group <= 16 else 64 if group <= 64 else 128
            most_rows = self.max_rows if self.graph else rows
            grid = max(-(-most_rows * group // tile) + self.batch - 1, 2 * NUM_SMS // num_kv_heads)
            self.need = need = num_qo_heads * grid * tile * (head_dim + 1) * 4
            if need > self.workspace.numel():
                raise RuntimeError(f"workspace of {self.workspace.numel()} bytes, {need} needed")
        if self.graph:
            self.qo.copy_(qo_indptr)
            self.kv.copy_(kv_indptr)
            self.indices[: kv_indices.shape[0]].copy_(kv_indices)
            self.last.copy_(last_page_len)
        self.rows, self.page_size, self.causal, self.sm_scale = rows, page_size, causal, sm_scale
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtypes = (q_data_type, kv_data_type)

    def run(self, q, paged, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        """out (q's dtype), and with ``return_lse`` the base-2 LSE (float32, [rows, Hq]; ``lse`` if given)."""
        if q.shape[0] != self.rows:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({self.rows})")
        k_cache, v_cache = (paged[:, 0], paged[:, 1]) if isinstance(paged, torch.Tensor) else paged
        if (q.dtype, k_cache.dtype) != self.dtypes:
            raise ValueError(f"q and KV of {q.dtype}, {k_cache.dtype}; planned for {self.dtypes}")
        k_scale = 1.0 if k_scale is None else k_scale
        v_scale = 1.0 if v_scale is None else v_scale
        if out is None:
            out = torch.empty_like(q)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        assert lse is None or (lse.shape == q.shape[:2] and lse.dtype == torch.float32)
        group = self.heads[0] // self.heads[1]
        for r in range(self.batch):
            q0, q1 = int(self.qo[r]), int(self.qo[r + 1])
            p0, p1 = int(self.kv[r]), int(self.kv[r + 1])
            kv_len = max(p1 - p0 - 1, 0) * self.page_size + int(self.last[r])
            if q1 == q0:
                continue
            if kv_len == 0:
                out[q0:q1] = 0
                if lse is not None:
                    lse[q0:q1] = float("-inf")
                continue
            pages = self.indices[p0:p1].long()
            k = k_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, dim=1) * k_scale
            v = v_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, dim=1) * v_scale
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * self.sm_scale
            if self.causal:
                visible = (
                    torch.arange(kv_len)[None, :] <= (kv_len - (q1 - q0) + torch.arange(q1 - q0))[:, None]
                )
                scores = scores.masked_fill(~visible, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(out.dtype)
            if lse is not None:
                lse[q0:q1] = (torch.logsumexp(scores, dim=-1) / math.log(2)).T.float()
        return (out, lse) if return_lse else out

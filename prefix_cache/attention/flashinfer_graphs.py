"""FlashInfer's paged kernels for one-level plans under a ``GraphCapacity`` (CUDA only).

FlashInfer's paged prefill wrapper, made with ``use_cuda_graph=True`` over fixed index buffers,
replays one captured ``run`` after any later ``plan`` that keeps its batch size (the number of
requests) and does not exceed the total query rows of its first plan. So every plan is padded to
the capacity's query tokens as requests (padding requests have no KV, and no queries except where
FA3 needs every row, see ``_launch_rows``), and each wrapper's first plan is a sizing plan of the
capacity's query rows. Two wrappers, each its own CUDA graph:

- ``decode`` (every request one query token): FlashInfer's FA2 kernels, which pack a KV head's
  query heads into one tile (what its decode wrapper runs with tensor cores);
- ``prefill``: FlashInfer's default kernels for the device (FA3 on Hopper).

An fp8 cache runs on the ``decode`` wrapper only (planned with ``kv_data_type`` fp8, ``run`` given
the layer's scales; the auto backend keeps such prefill plans on Triton).
"""

from __future__ import annotations

import numpy as np
import torch

from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, flashinfer_page_ids
from prefix_cache.attention.triton_backend import GraphCapacity
from prefix_cache.kernels._common import num_sms
from prefix_cache.kernels.work import check_level
from prefix_cache.planner.plan import CascadeLevel


class OneLevelGraphs:
    """FlashInfer's CUDA-graph prefill wrappers for one-level causal plans of ``capacity``.

    flashinfer: the imported module. workspace_bytes: the float workspace of the prefill wrapper
    (FA3 keeps no split results); the decode wrapper's is sized from the capacity
    (``_split_workspace_bytes``). Each is allocated when its wrapper is first planned.
    """

    def __init__(
        self, flashinfer, device: torch.device, capacity: GraphCapacity, workspace_bytes: int
    ) -> None:
        self._flashinfer = flashinfer
        self._device = device
        self._capacity = capacity
        self._workspace_bytes = workspace_bytes
        self._wrappers: dict[str, object] = {}
        self._row_ids = torch.arange(capacity.max_query_tokens, dtype=torch.int32, device=device)
        self._planned_rows = torch.zeros((), dtype=torch.int32, device=device)
        self._buffers: dict[str, torch.Tensor] = {}  # q and output of the capacity's rows (``run``)
        self._shape: tuple | None = None
        self._rows = 0  # query rows of the current plan
        self.max_page = -1  # the largest page id the current plan reads

    def plan(
        self,
        kind: str,
        level: CascadeLevel,
        page_size: int,
        heads: dict,
        dtypes: tuple[torch.dtype, torch.dtype],
    ) -> None:
        """Plan ``level`` (causal, its groups in the engine's order, every group with queries) on the
        ``kind`` wrapper. heads: num_qo_heads, num_kv_heads, head_dim, sm_scale; dtypes: q's and the
        KV cache's (q's, or fp8 for ``decode``). Raises ValueError when the level does not fit the
        capacity; the wrapper then keeps its previous plan."""
        if dtypes[1] == FP8_KV_DTYPE and kind != "decode":
            raise ValueError(f"an fp8 KV cache runs on the decode wrapper only, not {kind!r}")
        cap = self._capacity
        arrays = check_level(
            level.qo_indptr, level.kv_indptr, level.kv_indices, level.kv_last_page_len, page_size
        )
        rows, groups = arrays.num_query_tokens, arrays.q_len.shape[0]
        pages = int(level.kv_indptr[-1])
        # FlashInfer's fixed batch size is the capacity's query tokens: every request owns a row.
        batch = cap.max_query_tokens
        for what, need, have in (
            ("query tokens", rows, batch),
            ("requests", groups, batch),
            ("pages", pages, cap.max_pages),
        ):
            if need > have:
                raise ValueError(f"the plan has {need} {what}, over the backend's capacity of {have}")
        shape = (*heads.values(), page_size, dtypes)
        if self._shape is not None and shape != self._shape:
            raise ValueError(
                f"a fixed-capacity backend's FlashInfer launches keep their heads, head_dim, sm_scale, "
                f"page_size and dtype {self._shape}; got {shape}: make a new backend"
            )
        wrapper = self._wrappers.get(kind) or self._make(kind, page_size, heads, dtypes)
        qo = np.full(batch + 1, self._launch_rows(kind, rows), dtype=np.int32)
        qo[: groups + 1] = level.qo_indptr
        kv = np.full(batch + 1, pages, dtype=np.int32)
        kv[: groups + 1] = level.kv_indptr
        last = np.zeros(batch, dtype=np.int32)
        last[:groups] = level.kv_last_page_len
        indices = level.kv_indices[:pages].astype(np.int32)
        self._plan_wrapper(wrapper, qo, kv, indices, last, page_size, heads, dtypes, kind != "decode")
        self._planned_rows.fill_(rows)
        self._shape = shape
        self._rows = rows
        self.max_page = arrays.max_page

    def _launch_rows(self, kind: str, rows: int) -> int:
        """The query rows FlashInfer is given: the plan's for FA2 (decode), whose kernels read the row
        count from the planned device buffers, so a replay takes the current plan's; the capacity's
        for FA3 (prefill), whose TMA layouts take q's row count at launch (a graph keeps the captured
        one): there, a padding request owns the rows past the plan's, with no KV (FA3 writes zeros)."""
        return rows if kind == "decode" else self._capacity.max_query_tokens

    def run(self, kind: str, q: torch.Tensor, paged, out: torch.Tensor, scales: tuple[float, float]) -> None:
        """Write the planned rows of ``out`` (engine order). Rows past the plan's are left as they
        were, except on the prefill wrapper into a contiguous ``out`` of the capacity's rows, which
        writes the padding request's rows (zeros with FA3). FA2 writes a contiguous output only, and
        FA3 needs q and its output with the capacity's rows: any other ``q`` or ``out`` goes through
        buffers of the capacity's rows, the planned rows selected by a count on the device (a replay
        selects the current plan's). scales: an fp8 cache's (k_scale, v_scale)."""
        wrapper = self._wrappers[kind]
        fp8 = {"k_scale": scales[0], "v_scale": scales[1]} if self._shape[-1][1] == FP8_KV_DTYPE else {}
        launch = self._launch_rows(kind, self._rows)
        if q.shape[0] < launch:
            q_in = self._buffer("q", q)
            q_in[: q.shape[0]].copy_(q)
        else:
            q_in = q[:launch]
        if out.is_contiguous() and out.shape[0] >= launch:
            wrapper.run(q_in, paged, out=out[:launch], **fp8)
            return
        result = self._buffer("out", out)
        wrapper.run(q_in, paged, out=result[:launch], **fp8)
        n = out.shape[0]
        planned = self._row_ids[:n] < self._planned_rows
        torch.where(planned[:, None, None], result[:n], out, out=out)

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A contiguous buffer of the capacity's rows shaped like ``like``'s rows, made once (heads,
        head_dim and dtype are fixed by ``plan``)."""
        if name not in self._buffers:
            shape = (self._capacity.max_query_tokens, *like.shape[1:])
            self._buffers[name] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self._buffers[name]

    def _make(self, kind: str, page_size: int, heads: dict, dtypes: tuple[torch.dtype, torch.dtype]):
        cap, device = self._capacity, self._device
        batch = cap.max_query_tokens
        wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(
                self._workspace_bytes if kind == "prefill" else self._split_workspace_bytes(heads),
                dtype=torch.uint8,
                device=device,
            ),
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buf=torch.zeros(cap.max_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buf=torch.zeros(batch, dtype=torch.int32, device=device),
            backend="fa2" if kind == "decode" else "auto",
        )
        # FlashInfer fixes the grid from the first plan's total query rows: size it for the capacity
        # (request 0 holds every row; nothing runs this plan).
        qo = np.full(batch + 1, batch, dtype=np.int32)
        qo[0] = 0
        zeros = np.zeros(batch + 1, dtype=np.int32)
        causal = kind != "decode"
        self._plan_wrapper(wrapper, qo, zeros, zeros[:0], zeros[:batch], page_size, heads, dtypes, causal)
        self._wrappers[kind] = wrapper
        return wrapper

    def _split_workspace_bytes(self, heads: dict) -> int:
        """The float workspace of the FA2 (decode) wrapper. In CUDA-graph mode FlashInfer's scheduler
        (0.6.8, ``PrefillPlan``) always splits the KV and sizes its partial results for the capacity,
        not the plan: float32 rows of ``num_qo_heads * (head_dim + 1)`` for tiles of ``tile`` packed
        rows (16 for a group of at most 16 query heads per KV head, 64 up to 64, else 128) over a grid
        of ``ceil(T * group / tile) + T - 1`` programs (T the capacity's query tokens: one per
        request), or of 2 programs per SM per KV head where that is more. Taken here with 4 per SM,
        and 1.25x in all."""
        tokens = self._capacity.max_query_tokens
        group = heads["num_qo_heads"] // heads["num_kv_heads"]
        tile = 16 if group <= 16 else 64 if group <= 64 else 128
        grid = max(
            -(-tokens * group // tile) + tokens - 1, 4 * num_sms(self._device) // heads["num_kv_heads"]
        )
        return heads["num_qo_heads"] * grid * tile * (heads["head_dim"] + 1) * 4 * 5 // 4

    def _plan_wrapper(
        self, wrapper, qo, kv, indices, last, page_size: int, heads: dict, dtypes: tuple, causal: bool
    ) -> None:
        # Decode (one query per request) sees all of its KV: planned without the causal mask's
        # work, as FlashInfer's decode wrapper does.
        wrapper.plan(
            torch.from_numpy(qo),
            torch.from_numpy(kv),
            flashinfer_page_ids(indices, self._device),
            torch.from_numpy(last),
            heads["num_qo_heads"],
            heads["num_kv_heads"],
            heads["head_dim"],
            page_size,
            causal=causal,
            sm_scale=heads["sm_scale"],
            q_data_type=dtypes[0],
            kv_data_type=dtypes[1],
        )

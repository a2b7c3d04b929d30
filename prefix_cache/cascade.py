"""Cascade attention plans: a batch's page tables split into shared-prefix levels and a unique level.

The layout is FlashInfer's multi-level cascade layout. Every level covers every query token of the
batch, in *planned order* (requests permuted so that the queries of one group are contiguous). A
level is a list of groups; group g owns query tokens ``qo_indptr[g]:qo_indptr[g+1]`` (planned order)
and KV pages ``kv_indices[kv_indptr[g]:kv_indptr[g+1]]``, whose last page holds
``kv_last_page_len[g]`` tokens (0 when the group has no KV at this level).

``prefix_cache.cascade_planner.CascadePlanner`` makes these plans from a batch's page tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CascadeLevel:
    """One level of a cascade plan. All arrays are int32 numpy arrays.

    qo_indptr: [num_groups + 1] query-token offsets, planned order.
    kv_indptr: [num_groups + 1] offsets into ``kv_indices``.
    kv_indices: [num_pages_in_level] physical page ids.
    kv_last_page_len: [num_groups] tokens in each group's last page, 1..page_size, or 0 if it has no page.
    causal: False for shared levels (every query of a group comes after the shared KV); True for the
        last (unique) level, where a request's own new tokens are masked bottom-right aligned.
    """

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    causal: bool


@dataclass(frozen=True)
class CascadePlan:
    """The output of ``CascadePlanner.plan``: levels plus the request permutation they assume.

    levels: shared levels first (non-causal), the unique level last (causal); at least one level.
    request_order: int32 [batch]; planned position p holds the engine's request ``request_order[p]``.
    request_inverse: int32 [batch]; the engine's request i sits at planned position ``request_inverse[i]``.
    query_order: int64 [num_query_tokens]; planned query token t is the engine's query token
        ``query_order[t]`` (queries of one request are contiguous in both orders), so
        ``q_planned = q[query_order]`` and ``out[query_order] = out_planned``. A plan of one level from
        ``CascadePlanner`` keeps the engine's request order, so its query_order is the identity.
    page_size: tokens per page.
    """

    levels: tuple[CascadeLevel, ...]
    request_order: np.ndarray
    request_inverse: np.ndarray
    query_order: np.ndarray
    page_size: int

    @property
    def num_query_tokens(self) -> int:
        return int(self.query_order.shape[0])

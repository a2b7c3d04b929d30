"""Cascade attention plans: a batch's page tables split into shared-prefix levels and a unique level.

The layout is FlashInfer's multi-level cascade layout. Every level covers every query token of the
batch, in *planned order* (requests permuted so that the queries of one group are contiguous). A
level is a list of groups; group g owns query tokens ``qo_indptr[g]:qo_indptr[g+1]`` (planned order)
and KV pages ``kv_indices[kv_indptr[g]:kv_indptr[g+1]]``, whose last page holds
``kv_last_page_len[g]`` tokens (0 when the group has no KV at this level).

``prefix_cache.planner.planner.CascadePlanner`` makes these plans from a batch's page tables.
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
        The last level has one group per request, in planned order.
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


def one_level_decode(plan: CascadePlan) -> CascadePlan | None:
    """The one-level plan of a decode batch planned as a cascade: each request one group of all its
    pages (its shared levels' first, in level order), in the engine's request order, so that
    ``query_order`` is the identity. Requests without a query keep no pages, as no level gives them
    any. None where ``plan`` has a single level, is not a decode plan (a request with more than one
    query token) or a query would get no KV, and where a request's pages would not concatenate (a
    segment ending in a partial page before the last), or where it would hold 2**31 pages or more.
    Raises ValueError where the last level does not have one group per request."""
    if len(plan.levels) < 2:
        return None
    last = plan.levels[-1]
    if last.kv_last_page_len.shape[0] != plan.request_order.shape[0]:
        raise ValueError(
            f"the last level has {last.kv_last_page_len.shape[0]} groups, the plan "
            f"{plan.request_order.shape[0]} requests: it must have one group per request"
        )
    if int(np.diff(last.qo_indptr).max(initial=0)) > 1:
        return None
    rows = plan.num_query_tokens
    # Planned query row t, the engine's query token query_order[t], is the only one of the request
    # at planned position row_request[t]; ``by_token`` lists the planned rows in the engine's order.
    row_request = np.repeat(np.arange(last.kv_last_page_len.shape[0]), np.diff(last.qo_indptr))
    by_token = np.argsort(plan.query_order, kind="stable")
    counts, starts, last_lens = [], [], []
    for level in plan.levels:
        group = np.repeat(np.arange(level.kv_last_page_len.shape[0]), np.diff(level.qo_indptr))[by_token]
        counts.append(np.diff(level.kv_indptr).astype(np.int64)[group])
        starts.append(level.kv_indptr[:-1].astype(np.int64)[group])
        last_lens.append(level.kv_last_page_len[group])
    counts_after = np.zeros(rows, dtype=np.int64)
    page_len = np.zeros(rows, dtype=np.int32)
    for count, length in zip(reversed(counts), reversed(last_lens), strict=True):
        if ((count > 0) & (counts_after > 0) & (length != plan.page_size)).any():
            return None
        page_len = np.where((counts_after == 0) & (count > 0), length, page_len)
        counts_after += count
    if rows and int(counts_after.min()) == 0:
        return None
    token_indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts_after, out=token_indptr[1:])
    if token_indptr[-1] >= 2**31:  # the shared pages are repeated per request: int32 offsets
        return None
    indices = np.empty(int(token_indptr[-1]), dtype=np.int32)
    offset = token_indptr[:-1].copy()
    for level, count, start in zip(plan.levels, counts, starts, strict=True):
        # Each token's pages of this level, copied after its pages of the levels before.
        within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        indices[np.repeat(offset, count) + within] = level.kv_indices[np.repeat(start, count) + within]
        offset += count
    # Groups by request in the engine's order: a request without a query has no rows and no pages.
    batch = plan.request_order.shape[0]
    request = plan.request_order[row_request[by_token]].astype(np.int64)
    qo_len = np.zeros(batch, dtype=np.int64)
    qo_len[request] = 1
    pages = np.zeros(batch, dtype=np.int64)
    pages[request] = counts_after
    last_len = np.zeros(batch, dtype=np.int32)
    last_len[request] = page_len
    identity = np.arange(batch, dtype=np.int32)
    level = CascadeLevel(
        qo_indptr=np.concatenate([[0], np.cumsum(qo_len)]).astype(np.int32),
        kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(np.int32),
        kv_indices=indices,
        kv_last_page_len=last_len,
        causal=True,
    )
    return CascadePlan(
        levels=(level,),
        request_order=identity,
        request_inverse=identity.copy(),
        query_order=np.arange(rows, dtype=np.int64),
        page_size=plan.page_size,
    )

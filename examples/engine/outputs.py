"""A request's output as its token events arrive: text decoded incrementally, stop strings cut, token
ids and logprobs kept per sample. Runs in a worker thread (the tokenizer is slow for the event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .chat import ChatFormat

#: How many tokens back incremental decoding re-decodes: enough for a character split over tokens.
_WINDOW = 6


@dataclass
class SampleOutput:
    """One sample's output so far. ``text`` is what may be shown (stop strings cut, a possible stop
    string's beginning held back until it is known); ``sent`` how much of it went out."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[int], list[float]]] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    sent_ids: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    done_sent: bool = False  # the piece with the finish reason went out
    _decoded: int = 0  # ids[:_decoded] are in ``text`` (the rest wait for a whole character)
    _prefix: int = 0  # decoding restarts at ids[_prefix:] so that merges across tokens come out right


class RequestOutput:
    """All samples of a request. ``add`` takes the worker's token events; ``pieces`` returns what is
    new per sample since the last call."""

    def __init__(
        self, chat: ChatFormat, n: int, stop: tuple[str, ...], stop_token_ids: frozenset[int]
    ) -> None:
        self.chat, self.stop, self.stop_token_ids = chat, stop, stop_token_ids
        self.samples = [SampleOutput() for _ in range(n)]
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def add(self, index: int, token: int, reason: str | None, logprob: tuple | None) -> bool:
        """Take one token of sample ``index``; True when a stop string ended that sample just now
        (the caller stops it in the engine)."""
        s = self.samples[index]
        if s.finish_reason is not None:
            return False  # a token the engine made before it heard the sample had stopped
        s.ids.append(token)
        if logprob is not None:
            s.logprobs.append(logprob)
        # A stop token ends the reply; it is not part of its text.
        end = len(s.ids) - (reason == "stop" and token in self.stop_token_ids)
        if end > s._decoded:
            before = self.chat.decode(s.ids[s._prefix : s._decoded])
            after = self.chat.decode(s.ids[s._prefix : end])
            if reason is not None or not after.endswith("\ufffd"):
                s.text += after[len(before) :]
                s._decoded, s._prefix = end, max(0, end - _WINDOW)
        if self.stop:
            # A stop string cannot begin before what went out: that text was followed by ``hold``
            # more characters, enough to complete any stop string begun there.
            start = s.sent_text
            hits = [i for i in (s.text.find(stop, start) for stop in self.stop) if i >= 0]
            if hits:
                s.text, s.finish_reason = s.text[: min(hits)], "stop"
                return True
        s.finish_reason = reason
        return False

    def pieces(self) -> list[tuple[int, str, list[int], list[tuple], str | None]]:
        """(index, new text, new token ids, new logprob entries, finish reason once finished) of each
        sample with something new."""
        out = []
        for i, s in enumerate(self.samples):
            if s.done_sent:
                continue
            finished = s.finish_reason is not None
            visible = len(s.text) if finished else max(s.sent_text, len(s.text) - self.hold)
            if visible == s.sent_text and s.sent_ids == len(s.ids) and not finished:
                continue
            piece = (i, s.text[s.sent_text : visible], s.ids[s.sent_ids :], s.logprobs[s.sent_logprobs :])
            out.append((*piece, s.finish_reason))
            s.sent_text, s.sent_ids, s.sent_logprobs, s.done_sent = (
                visible,
                len(s.ids),
                len(s.logprobs),
                finished,
            )
        return out

    def token_text(self, token: int) -> str:
        return self.chat.decode([token])

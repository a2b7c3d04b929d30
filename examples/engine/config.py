"""Model shapes: SmolLM2-135M (real weights from GGUF) and Llama-3.1-8B / Llama-3.2-1B (dummy weights)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-architecture model."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    context_length: int  # the most tokens (prompt and output) a sequence may have

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V of one token over all layers, for a KV dtype of ``element_size`` bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


SMOLLM2_135M = ModelConfig(
    name="smollm2-135m",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_qo_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    context_length=8192,
)

#: Llama-3.1-8B's shapes (its rope scaling for long context is left out: dummy weights only).
LLAMA_8B = ModelConfig(
    name="dummy-llama-3.1-8b",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    context_length=131072,
)

#: Llama-3.2-1B's shapes.
LLAMA_1B = ModelConfig(
    name="dummy-llama-3.2-1b",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    context_length=131072,
)

#: Names the command lines accept: "smollm2" loads real weights, the others are random at real shapes.
MODELS = {"smollm2": SMOLLM2_135M, "dummy-8b": LLAMA_8B, "dummy-1b": LLAMA_1B}

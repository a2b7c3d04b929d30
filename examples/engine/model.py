"""A Llama-architecture forward pass over a paged KV pool, attention through a prefix-cache backend.

Embedding, then per layer: RMSNorm, fused QKV projection, RoPE (half-split rotation, as in Hugging
Face's Llama), the new tokens' K/V written into their pages, attention of the batch's cascade plan,
output projection, RMSNorm, SwiGLU MLP; a final RMSNorm and the LM head on the rows that are sampled.

The KV pool is one tensor per layer, ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, all
indexed by the same page ids, in the model's dtype or in fp8 (``torch.float8_e4m3fn``): then each
layer's K and V are stored divided by that layer's scales (``kv_scales``) and read back times them.

A tensor-parallel shard (``tensor_parallel.shard_model``) holds some of the heads and of the MLP's
columns: its ``num_qo_heads``/``num_kv_heads`` are its own, and the partial sums of the attention's
output projection and of the MLP's down projection are all-reduced over ``tp_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from prefix_cache.attention import AttentionBackend
from prefix_cache.attention.kv_layout import FP8_KV_DTYPE, quantize_fp8

from .config import ModelConfig


class LlamaModel:
    """Weights and the forward pass. Built by ``from_gguf_weights`` or ``dummy``."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[dict[str, torch.Tensor]],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        heads: tuple[int, int] | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """heads: (query heads, KV heads) that ``layers`` hold, default the config's (a whole model);
        tp_group: the ranks whose partial sums are all-reduced (a tensor-parallel shard), or None."""
        self.config = config
        self.num_qo_heads, self.num_kv_heads = heads or (config.num_qo_heads, config.num_kv_heads)
        self.tp_group = tp_group
        self.layers = layers  # per layer: attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down
        self.embed = embed  # [vocab, hidden]
        self.final_norm = final_norm  # [hidden]
        self.lm_head = lm_head  # [vocab, hidden]; the embedding itself when tied
        self.device, self.dtype = embed.device, embed.dtype
        exponents = torch.arange(0, config.head_dim, 2, device=self.device).float() / config.head_dim
        self._inv_freq = 1.0 / config.rope_theta**exponents  # [head_dim / 2] float32
        #: Per layer, (k_scale, v_scale) of an fp8 KV pool: 1 unless a checkpoint's calibration is set.
        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * config.num_layers

    @classmethod
    def from_gguf_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LlamaModel:
        """From tensors named as in a llama.cpp GGUF file (see ``gguf_file.load_weights``)."""

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device, dtype)

        layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            layers.append(
                {
                    "attn_norm": get(p + "attn_norm.weight"),
                    "wqkv": torch.cat(
                        [get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")]
                    ),
                    "wo": get(p + "attn_output.weight"),
                    "ffn_norm": get(p + "ffn_norm.weight"),
                    "w_gate_up": torch.cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]),
                    "w_down": get(p + "ffn_down.weight"),
                }
            )
        embed = get("token_embd.weight")
        lm_head = embed if "output.weight" not in weights else get("output.weight")
        return cls(config, layers, embed, get("output_norm.weight"), lm_head)

    @classmethod
    def dummy(
        cls,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> LlamaModel:
        """Random weights at the config's shapes: outputs are meaningless, timings are real."""
        gen = torch.Generator(device=device).manual_seed(seed)
        h, hd = config.hidden_size, config.head_dim
        qkv_rows = (config.num_qo_heads + 2 * config.num_kv_heads) * hd

        def rand(rows: int, cols: int) -> torch.Tensor:
            w = torch.empty(rows, cols, device=device, dtype=dtype)
            return w.normal_(0.0, cols**-0.5, generator=gen)

        def ones() -> torch.Tensor:
            return torch.ones(h, device=device, dtype=dtype)

        layers = [
            {
                "attn_norm": ones(),
                "wqkv": rand(qkv_rows, h),
                "wo": rand(h, config.num_qo_heads * hd),
                "ffn_norm": ones(),
                "w_gate_up": rand(2 * config.intermediate_size, h),
                "w_down": rand(h, config.intermediate_size),
            }
            for _ in range(config.num_layers)
        ]
        embed = rand(config.vocab_size, h)
        lm_head = embed if config.tie_word_embeddings else rand(config.vocab_size, h)
        return cls(config, layers, embed, ones(), lm_head)

    def attention_shape(self, kv_dtype: torch.dtype | None = None) -> dict:
        """The keyword arguments of an attention backend's ``plan`` for this model over a KV pool of
        ``kv_dtype`` (default the model's): its heads, head dim and dtypes (with the dtypes the
        backend finishes planning in ``plan``)."""
        return dict(
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.config.head_dim,
            q_dtype=self.dtype,
            kv_dtype=kv_dtype or self.dtype,
        )  # fmt: skip

    def new_kv_pool(
        self, num_pages: int, page_size: int, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Per layer, ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (this model's KV heads: a
        shard's own) in ``dtype``: the model's (default) or fp8, half the bytes of bf16 per page.
        The layers are views of one ``[num_layers, ...]`` tensor, so the host tier's mover gathers a
        page of every layer in one op rather than one per layer (docs/offload.md)."""
        c = self.config
        dtype = dtype or self.dtype
        if dtype not in (self.dtype, FP8_KV_DTYPE):
            raise ValueError(
                f"a KV pool holds the model's dtype ({self.dtype}) or {FP8_KV_DTYPE}, not {dtype}"
            )
        shape = (num_pages, 2, page_size, self.num_kv_heads, c.head_dim)
        return list(torch.zeros((c.num_layers, *shape), device=self.device, dtype=dtype))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` ([T] int64), each [T, 1, head_dim] in the model's dtype. Computed
        from the positions on the device (no table to grow, no host sync: CUDA graphs capture it)."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of ``partial`` over the tensor-parallel ranks (itself without a group)."""
        if self.tp_group is not None:
            dist.all_reduce(partial, group=self.tp_group)
        return partial

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_pool: list[torch.Tensor],
        backend: AttentionBackend,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """One step over a batch already planned on ``backend``.

        tokens, positions, slots: int64 [T] on the model's device, in the engine's request order; a
            token's KV goes to page ``slot // page_size`` at offset ``slot % page_size`` (slot -1: not
            stored, a padding token of a CUDA-graph bucket; CUDA only, on the CPU every slot is a
            real one).
        logit_rows: int64 [R], the rows of the batch whose next-token logits are wanted.
        Returns float32 logits [R, vocab].
        """
        hq, hkv, hd = self.num_qo_heads, self.num_kv_heads, self.config.head_dim
        cos, sin = self._rope(positions)
        if not kv_pool[0].is_cuda:  # torch indexing writes the KV on the CPU
            page_size = kv_pool[0].shape[2]
            pages, offsets = slots // page_size, slots % page_size
        x = F.embedding(tokens, self.embed)
        fp8 = kv_pool[0].dtype == FP8_KV_DTYPE
        for layer, kv, (k_scale, v_scale) in zip(self.layers, kv_pool, self.kv_scales, strict=True):
            h = self._rms_norm(x, layer["attn_norm"])
            qkv = F.linear(h, layer["wqkv"])
            q = qkv[:, : hq * hd].view(-1, hq, hd)
            k = qkv[:, hq * hd : (hq + hkv) * hd].view(-1, hkv, hd)
            v = qkv[:, (hq + hkv) * hd :].view(-1, hkv, hd)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            scales = dict(k_scale=k_scale, v_scale=v_scale) if fp8 else {}
            if kv.is_cuda:
                from prefix_cache.kernels import append_kv

                append_kv(kv, k, v.contiguous(), slots, **scales)
            elif fp8:
                kv[pages, 0, offsets] = quantize_fp8(k, k_scale)
                kv[pages, 1, offsets] = quantize_fp8(v, v_scale)
            else:
                kv[pages, 0, offsets] = k
                kv[pages, 1, offsets] = v
            attn = backend.run(q.contiguous(), kv, **scales)
            x = x + self._all_reduce(F.linear(attn.reshape(-1, hq * hd), layer["wo"]))
            h = self._rms_norm(x, layer["ffn_norm"])
            gate, up = F.linear(h, layer["w_gate_up"]).chunk(2, dim=-1)
            x = x + self._all_reduce(F.linear(F.silu(gate) * up, layer["w_down"]))
        x = self._rms_norm(x[logit_rows], self.final_norm)
        return F.linear(x, self.lm_head).float()

"""Llama-family decoder in Flax NNX: Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral (no
sliding window) and Qwen2 (q/k/v bias). Tied or untied embeddings.

The forward runs over a flat batch of T tokens (any mix of prefill chunks and decodes) and the
paged KV cache, which it returns updated. The decoder layers are one module with a leading
layer axis on every weight, run with `lax.scan`: XLA compiles the layer body once, which keeps
compiling every bucket at start-up affordable (30 unrolled layers took 3-5 s per bucket on
the 2-core CPU). Attention lives in `jllm/models/attention.py`, so the model does not care
which backend runs it.

Glossary: T tokens, R requests, D model dim, N query heads, K kv heads, H head dim, F ffn,
V vocab, B blocks, S block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.models.attention import AttentionMetadata, paged_attention
from jllm.models.rope import RopeConfig, apply_rope


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf) -> LlamaConfig:
        arch = getattr(hf, "model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(
                f"Model type {arch!r} is not supported by jllm yet "
                "(supported: llama, mistral, qwen2)."
            )
        if arch == "mistral" and getattr(hf, "sliding_window", None):
            if hf.sliding_window < hf.max_position_embeddings:
                raise ValueError("Mistral with a sliding window is not supported by jllm yet.")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=RopeConfig.from_hf(hf, head_dim),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            max_position_embeddings=hf.max_position_embeddings,
        )


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale=0.02) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale, logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x):  # [T, D]
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        return (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype) * self.weight[...]


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.wq = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), dtype)
        self.wk = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), dtype)
        self.wv = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), dtype)
        self.wo = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), dtype)
        if cfg.attention_bias:
            self.bq = nnx.Param(jnp.zeros((N, H), dtype), logical_axes=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((K, H), dtype), logical_axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((K, H), dtype), logical_axes=("kv_heads", "head_dim"))

    def __call__(self, x, positions, kv_cache, layer, md: AttentionMetadata, backend: str):
        q = jnp.einsum("TD,DNH->TNH", x, self.wq[...])  # [T, N, H]
        k = jnp.einsum("TD,DKH->TKH", x, self.wk[...])  # [T, K, H]
        v = jnp.einsum("TD,DKH->TKH", x, self.wv[...])  # [T, K, H]
        if self.cfg.attention_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = apply_rope(q, positions, self.cfg.rope)
        k = apply_rope(k, positions, self.cfg.rope)
        o, kv_cache = paged_attention(q, k, v, kv_cache, layer, md, backend)  # [T, N, H]
        return jnp.einsum("TNH,NHD->TD", o, self.wo[...]), kv_cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), dtype)
        self.w_up = _param(rngs, (D, F), ("embed", "mlp"), dtype)
        self.w_down = _param(rngs, (F, D), ("mlp", "embed"), dtype)

    def __call__(self, x):  # [T, D]
        h = jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])  # [T, F]
        return h @ self.w_down[...]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, kv_cache, layer, md, backend):
        h, kv_cache = self.attn(self.input_norm(x), positions, kv_cache, layer, md, backend)
        x = x + h
        return x + self.mlp(self.post_attn_norm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def stacked_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs)

        self.layers = stacked_layers(rngs)  # every weight has a leading [num_layers] axis
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype
            )

    def __call__(self, token_ids, positions, kv_cache, md: AttentionMetadata, backend: str):
        """Hidden states [T, D] after the final norm, and the updated cache [L, B, S, 2K, H]."""
        x = self.embed[...][token_ids]  # [T, D]
        graphdef, layer_states = nnx.split(self.layers)

        def body(carry, inputs):
            x, kv_cache = carry
            layer_state, index = inputs
            layer = nnx.merge(graphdef, layer_state)
            x, kv_cache = layer(x, positions, kv_cache, index, md, backend)
            return (x, kv_cache), None

        layers = jnp.arange(self.cfg.num_layers)
        # Not unrolled: with the stacked cache an unrolled scan copies the cache per layer.
        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (layer_states, layers))
        return self.norm(x), kv_cache

    def compute_logits(self, hidden):  # [R, D] -> [R, V] float32, whatever the model's dtype
        f32 = jnp.float32
        if self.cfg.tie_word_embeddings:
            return jnp.einsum("RD,VD->RV", hidden, self.embed[...], preferred_element_type=f32)
        return jnp.matmul(hidden, self.lm_head[...], preferred_element_type=f32)

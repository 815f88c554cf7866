"""The Llama-family decoder in Flax NNX: Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral
(no sliding window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Tied or untied
embeddings. `models/registry.py` maps a checkpoint's config to this module and its flags.

The forward runs over a flat batch of T tokens (any mix of prefill chunks and decodes) and the
paged KV cache, which it returns updated. The decoder layers are one module with a leading
layer axis on every weight, run with `lax.scan`: XLA compiles the layer body once, which keeps
compiling every bucket at start-up affordable (30 unrolled layers took 3-5 s per bucket on
the 2-core CPU). Attention lives in `jllm/models/attention.py`, so the model does not care
which backend runs it. Submodules carry transformers' names (`self_attn.q_proj`, ...), so a
checkpoint tensor's name is its path here.

Glossary: T tokens, R requests, D model dim, N query heads, K kv heads, H head dim, F ffn,
V vocab, B blocks, S block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.models import bf16_matmul, f32_matmul
from jllm.models.attention import paged_attention
from jllm.models.layers import Linear, RMSNorm, StackedWeight, gated_product, param
from jllm.models.rope import RopeConfig, apply_rope
from jllm.quantization.weights import QuantizedWeight, matmul, take_rows


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
    max_position_embeddings: int
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # Qwen3

    @classmethod
    def from_hf(cls, hf, **flags) -> LlamaConfig:
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
            max_position_embeddings=hf.max_position_embeddings,
            **flags,
        )


def _stays_stacked(dtype):
    """A filter for a Linear's weight of `dtype` (not quantized): a CPU kernel reads it in
    the stack."""

    def stays(path, variable) -> bool:
        if not isinstance(variable, nnx.Param) or variable.get_metadata().get("contract") is None:
            return False
        value = variable.get_value()
        return isinstance(value, jax.Array) and value.dtype == dtype

    return stays


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        qkv_bias = 2 if cfg.qkv_bias else 0
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q_proj = Linear("TD,DNH->TNH", (D, N, H), q_axes, dtype, rngs, qkv_bias)
        self.k_proj = Linear("TD,DKH->TKH", (D, K, H), kv_axes, dtype, rngs, qkv_bias)
        self.v_proj = Linear("TD,DKH->TKH", (D, K, H), kv_axes, dtype, rngs, qkv_bias)
        o_axes = ("heads", "head_dim", "embed")
        self.o_proj = Linear("TNH,NHD->TD", (N, H, D), o_axes, dtype, rngs, int(cfg.o_bias))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)

    def __call__(self, x, positions, kv_cache, layer, md, backend: str):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, N|K, H]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.cfg.rope)
        k = apply_rope(k, positions, self.cfg.rope)
        o, kv_cache = paged_attention(q, k, v, kv_cache, layer, md, backend)  # [T, N, H]
        return self.o_proj(o), kv_cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, F, b = cfg.hidden_size, cfg.intermediate_size, int(cfg.mlp_bias)
        self.gate_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.up_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.down_proj = Linear("TF,FD->TD", (F, D), ("mlp", "embed"), dtype, rngs, b)

    def __call__(self, x):  # [T, D]
        return self.down_proj(gated_product(self.gate_proj, self.up_proj, x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, kv_cache, layer, md, backend):
        h, kv_cache = self.self_attn(
            self.input_layernorm(x), positions, kv_cache, layer, md, backend
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)  # activations' dtype, whatever the weights are stored in
        self.embed_tokens = param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def stacked_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs)

        self.layers = stacked_layers(rngs)  # every weight has a leading [num_layers] axis
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            shape, axes = (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab")
            self.lm_head = Linear("RD,DV->RV", shape, axes, dtype, rngs)

    def __call__(self, token_ids, positions, kv_cache, md, backend: str):
        """Hidden states [T, D] after the final norm, and the updated cache [L, B, S, 2K, H]."""
        table = self.embed_tokens.get_value()
        if isinstance(table, QuantizedWeight):  # a GGUF file's quantized embedding
            x = take_rows(table, token_ids, self.dtype)
        else:
            x = table[token_ids]  # [T, D]
        # The projections a CPU kernel runs (bf16 or float32) stay stacked, outside the
        # scan's inputs: each layer's Linear gets the whole stack and its index
        # (StackedWeight), so that the scan never copies those weights out per layer.
        # Everything else is scanned. The kernels skip the step's padding tokens (those
        # whose K/V write is dropped).
        kernel = bf16_matmul.applies(self.dtype) or f32_matmul.applies(self.dtype)
        in_place = _stays_stacked(jnp.dtype(self.dtype)) if kernel else nnx.Nothing
        graphdef, stacked, layer_states = nnx.split(self.layers, in_place, ...)
        live = md.slot_mapping < kv_cache.shape[1] * kv_cache.shape[2]  # [T]: not B * S

        def body(carry, inputs):
            x, kv_cache = carry
            layer_state, index = inputs
            views = jax.tree.map(lambda stack: StackedWeight(stack, index, live), stacked)
            layer = nnx.merge(graphdef, views, layer_state)
            x, kv_cache = layer(x, positions, kv_cache, index, md, backend)
            return (x, kv_cache), None

        layers = jnp.arange(self.cfg.num_layers)
        # Not unrolled: with the stacked cache an unrolled scan copies the cache per layer.
        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (layer_states, layers))
        return self.norm(x), kv_cache

    def compute_logits(self, hidden, live=None):
        """[R, D] -> [R, V] float32, whatever the model's dtype. live: [R] bool, the rows
        whose logits are used (None: all); on the float32 kernel the others are not computed
        and come out zero."""
        f32 = jnp.float32
        if self.cfg.tie_word_embeddings:
            table = self.embed_tokens.get_value()
            if isinstance(table, QuantizedWeight):  # [V, D]: the [Out, In] layout
                return matmul(hidden, table, f32)
            if table.dtype == hidden.dtype and f32_matmul.applies(hidden.dtype):
                product = f32_matmul.f32_matmul
                return product(hidden, table, live=live, transposed=True, out_dtype=f32)
            return jnp.einsum("RD,VD->RV", hidden, table, preferred_element_type=f32)
        w = self.lm_head.weight.get_value()
        kernel = isinstance(w, jax.Array) and w.dtype == hidden.dtype
        if kernel and f32_matmul.applies(hidden.dtype):
            return f32_matmul.f32_matmul(hidden, w, live=live, out_dtype=f32)  # [D, V], no bias
        return self.lm_head(hidden, out_dtype=f32)

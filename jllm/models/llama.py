"""The Llama-family decoder in Flax NNX: Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral
(no sliding window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Tied or untied
embeddings. `models/registry.py` maps a checkpoint's config to this module and its flags.

The family is its config and its decoder layer; the embedding, the layer scan, the final norm
and the LM head are the shared decoder's (`models/decoder.py`). The forward runs over a flat
batch of T tokens (any mix of prefill chunks and decodes) and the paged KV cache, which it
returns updated; the step context (`models/context.py`) carries the positions, the attention
metadata and the layer's place in the cache. Attention is the backend object's
(`jllm/attention/`, through `ctx.attend`), so the model does not care which backend runs
it. Submodules carry transformers' names (`self_attn.q_proj`, ...), so a checkpoint tensor's
name is its path here.

Glossary: T tokens, R requests, D model dim, N query heads, K kv heads, H head dim, F ffn,
V vocab, B blocks, S block size.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from jllm.models.context import StepContext
from jllm.models.decoder import CausalLM
from jllm.models.layers import Linear, RMSNorm, gated_product
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


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.scale = H**-0.5
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

    def __call__(self, x, ctx: StepContext, kv_caches):
        q, k, v = self.q_proj(x, ctx), self.k_proj(x, ctx), self.v_proj(x, ctx)  # [T, N|K, H]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, ctx.positions, self.cfg.rope)
        k = apply_rope(k, ctx.positions, self.cfg.rope)
        o, kv_caches = ctx.attend(q, k, v, kv_caches, scale=self.scale)  # [T, N, H]
        return self.o_proj(o, ctx), kv_caches


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, F, b = cfg.hidden_size, cfg.intermediate_size, int(cfg.mlp_bias)
        self.gate_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.up_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.down_proj = Linear("TF,FD->TD", (F, D), ("mlp", "embed"), dtype, rngs, b)

    def __call__(self, x, ctx: StepContext):  # [T, D]
        return self.down_proj(gated_product(self.gate_proj, self.up_proj, x, ctx), ctx)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, kind=None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, ctx: StepContext, kv_caches):
        h, kv_caches = self.self_attn(self.input_layernorm(x), ctx, kv_caches)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), ctx), kv_caches


class LlamaForCausalLM(CausalLM):
    layer_cls = DecoderLayer

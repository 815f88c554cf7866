"""The Llama-family decoder in Flax NNX: Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral
(with its sliding window), Qwen2 (q/k/v bias; a window on the layers from
`max_window_layers` when `use_sliding_window`), Qwen3 (per-head q/k RMSNorm) and Phi-3 (its
fused projections split on load, LongRoPE, partial rotary). Tied or untied embeddings.
`models/registry.py` maps a checkpoint's config to this module and its flags.

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

import jax.numpy as jnp
from flax import nnx

from jllm.attention.options import AttentionOptions
from jllm.models.context import StepContext
from jllm.models.decoder import CausalLM
from jllm.models.layers import Linear, RMSNorm, gated_product
from jllm.models.moe import MoE
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
    sliding_window: int | None = None  # the window of the layers marked "sliding_attention"
    # Per layer: "sliding_attention" or "full_attention" (transformers' `layer_types`).
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (Gemma: tanh GELU)
    # Gemma's flags (models/gemma.py): scores scaled by query_pre_attn_scalar ** -0.5 instead
    # of head_dim ** -0.5 and soft-capped; RMSNorm scaling by (1 + w); the sliding layers'
    # own rotation (Gemma 3's local base); embeddings times sqrt(hidden); logits soft-capped.
    query_pre_attn_scalar: float | None = None
    attn_soft_cap: float | None = None
    norm_unit_offset: bool = False
    local_rope: RopeConfig | None = None
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    # Mixtures of experts (models/moe.py): per layer whether its MLP is sparse (None: none
    # is), the experts, how many each token takes, their width, and whether the top-k
    # routing weights are renormalised (Mixtral always; Qwen3-MoE's norm_topk_prob).
    moe_layers: tuple[bool, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    expert_parallel: bool = False  # whole experts per device (enable_expert_parallel)
    # A vision-language model's encoder, projector and image placeholders (models/vision.py)
    vision: object | None = None
    # Per-layer scales for a float8 KV cache (model_loader/kv_scales.py): the engine sets it
    # when the checkpoint or quantization_param_path gives them; without, no scale exists.
    kv_scales: bool = False
    # Pipeline stages (models/pipeline.py): the repeats of the layer pattern each stage
    # holds; None without stages. Unequal counts pad the layer stacks (decoder.py).
    stage_repeats: tuple[int, ...] | None = None

    @classmethod
    def from_hf(cls, hf, **flags) -> LlamaConfig:
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        flags.setdefault("rope", RopeConfig.from_hf(hf, head_dim))
        flags.setdefault("hidden_act", getattr(hf, "hidden_act", None) or "silu")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            **flags,
        )


class Attention(nnx.Module):
    """`kind`: the layer's entry in `layer_types`; a "sliding_attention" layer attends over
    the config's window (unless windows are off) with the sliding layers' rotation."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, kind=None):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        sliding = kind == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.rope = cfg.local_rope if sliding and cfg.local_rope is not None else cfg.rope
        self.scale = (cfg.query_pre_attn_scalar or H) ** -0.5
        self.options = AttentionOptions(
            scale=self.scale, window=self.window, soft_cap=cfg.attn_soft_cap
        )
        qkv_bias = 2 if cfg.qkv_bias else 0
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q_proj = Linear("TD,DNH->TNH", (D, N, H), q_axes, dtype, rngs, qkv_bias)
        self.k_proj = Linear("TD,DKH->TKH", (D, K, H), kv_axes, dtype, rngs, qkv_bias)
        self.v_proj = Linear("TD,DKH->TKH", (D, K, H), kv_axes, dtype, rngs, qkv_bias)
        o_axes = ("heads", "head_dim", "embed")
        self.o_proj = Linear("TNH,NHD->TD", (N, H, D), o_axes, dtype, rngs, int(cfg.o_bias))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, cfg.norm_unit_offset)
        if cfg.kv_scales:  # float32 whatever the model's dtype; 1.0 unless loaded
            self.k_scale = nnx.Param(jnp.ones((), jnp.float32), logical_axes=(), kv_scale=True)
            self.v_scale = nnx.Param(jnp.ones((), jnp.float32), logical_axes=(), kv_scale=True)

    def __call__(self, x, ctx: StepContext, kv_caches):
        q, k, v = self.q_proj(x, ctx), self.k_proj(x, ctx), self.v_proj(x, ctx)  # [T, N|K, H]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, ctx.positions, self.rope)
        k = apply_rope(k, ctx.positions, self.rope)
        kv_scales = (self.k_scale[...], self.v_scale[...]) if self.cfg.kv_scales else None
        o, kv_caches = ctx.attend(
            q,
            k,
            v,
            kv_caches,
            options=self.options,
            kv_scales=kv_scales,
        )
        return self.o_proj(o, ctx), kv_caches  # o: [T, N, H]


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        D, F, b = cfg.hidden_size, cfg.intermediate_size, int(cfg.mlp_bias)
        self.gate_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.up_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.down_proj = Linear("TF,FD->TD", (F, D), ("mlp", "embed"), dtype, rngs, b)
        self.act = cfg.hidden_act

    def __call__(self, x, ctx: StepContext):  # [T, D]
        h = gated_product(self.gate_proj, self.up_proj, x, ctx, self.act)
        return self.down_proj(h, ctx)


def mlp_block(cfg: LlamaConfig, dtype, rngs: nnx.Rngs, sparse: bool):
    """A layer's MLP: the dense gated one, or the mixture of experts."""
    if not sparse:
        return MLP(cfg, dtype, rngs)
    D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    k, norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
    shared = cfg.shared_expert_intermediate_size
    return MoE(D, F, E, k, norm, cfg.hidden_act, dtype, rngs, cfg.expert_parallel, shared)


def split_kind(kind) -> tuple:
    """A layer kind -> (its `layer_types` entry or None, whether its MLP is sparse)."""
    return kind if isinstance(kind, tuple) else (kind, False)


class DecoderLayer(nnx.Module):
    """`kind`: the layer's entry in `layer_types` (None: full attention), paired with
    whether its MLP is a mixture of experts in a model that has some."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, kind=None):
        attn_kind, sparse = split_kind(kind)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, attn_kind)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp_block(cfg, dtype, rngs, sparse)

    def __call__(self, x, ctx: StepContext, kv_caches):
        h, kv_caches = self.self_attn(self.input_layernorm(x), ctx, kv_caches)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), ctx), kv_caches


class LlamaForCausalLM(CausalLM):
    layer_cls = DecoderLayer

    @classmethod
    def layer_kinds(cls, cfg: LlamaConfig):
        types = cfg.layer_types or (None,) * cfg.num_layers
        if cfg.moe_layers is None:
            return types
        return tuple(zip(types, cfg.moe_layers, strict=True))

    @classmethod
    def attention_kind(cls, cfg: LlamaConfig, kind):
        return cfg.sliding_window if split_kind(kind)[0] == "sliding_attention" else None

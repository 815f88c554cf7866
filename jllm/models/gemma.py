"""Gemma 2 and Gemma 3 (text): the shared blocks with Gemma's flags, and its layer.

What Gemma changes against Llama: scores scaled by `query_pre_attn_scalar ** -0.5` and
soft-capped (Gemma 2), RMSNorm scaling by `1 + w`, a tanh-GELU gated MLP, embeddings times
sqrt(hidden), final logits soft-capped (Gemma 2), local (sliding-window) and global layers by
the config's `layer_types`; Gemma 3 adds per-head q/k norms and a second RoPE base for its
local layers (global layers keep their own, with the config's scaling). Its layer wraps both
blocks in norms on either side (`pre_feedforward_layernorm`, `post_feedforward_layernorm`
beside Llama's two). The shared decoder reads `embed_scale`, `final_logit_softcap` and
`norm_unit_offset` (models/decoder.py).

Glossary: T tokens, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    GgufFamily,
    attention_weights,
    mlp_weights,
)
from jllm.models.blocks import Attention, GatedMLP, layer_window
from jllm.models.config import DecoderConfig
from jllm.models.context import StepContext
from jllm.models.layers import RMSNorm
from jllm.models.llama import LlamaForCausalLM
from jllm.models.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class GemmaConfig(DecoderConfig):
    query_pre_attn_scalar: float
    attn_soft_cap: float | None = None
    attention_bias: bool = False
    qk_norm: bool = False  # Gemma 3
    local_rope: RopeConfig | None = None  # Gemma 3's sliding layers' rotation
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    norm_unit_offset: bool = True

    @classmethod
    def from_hf(cls, hf, gemma3: bool) -> GemmaConfig:
        """Gemma 2's (`gemma2`) or Gemma 3's text (`gemma3_text`) config."""
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma with use_bidirectional_attention (an embedding model) is not supported "
                "by jllm: it serves causal language models."
            )
        head_dim = hf.head_dim
        params = getattr(hf, "rope_parameters", None) or {}
        by_type = "full_attention" in params
        fields = DecoderConfig.fields_of(hf, windows=False)
        return cls(
            **fields
            | dict(
                rope=RopeConfig.from_hf(hf, head_dim, "full_attention" if by_type else None),
                sliding_window=hf.sliding_window,
                layer_types=tuple(hf.layer_types),
                hidden_act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
            ),
            local_rope=RopeConfig.from_hf(hf, head_dim, "sliding_attention") if by_type else None,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            qk_norm=gemma3,
            query_pre_attn_scalar=hf.query_pre_attn_scalar,
            attn_soft_cap=getattr(hf, "attn_logit_softcapping", None),
            embed_scale=hf.hidden_size**0.5,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
        )


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg: GemmaConfig, dtype, rngs: nnx.Rngs, kind=None):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        local = kind == "sliding_attention"
        self.input_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.self_attn = Attention(
            cfg,
            dtype,
            rngs,
            rope=cfg.local_rope if local and cfg.local_rope is not None else cfg.rope,
            window=layer_window(cfg, kind),
            scale=cfg.query_pre_attn_scalar**-0.5,
            soft_cap=cfg.attn_soft_cap,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            norm_offset=True,
        )
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.mlp = GatedMLP(D, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        self.post_feedforward_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)

    def __call__(self, x, ctx: StepContext, kv_caches):  # x [T, D]
        h, kv_caches = self.self_attn(self.input_layernorm(x), ctx, kv_caches)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), ctx)
        return x + self.post_feedforward_layernorm(h), kv_caches


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer


def layer_weights(cfg: GemmaConfig) -> dict:
    bias = cfg.attention_bias
    names = attention_weights(qkv_bias=bias, o_bias=bias, qk_norm=cfg.qk_norm)
    names |= mlp_weights() | LAYER_NORMS
    return names | {
        "pre_feedforward_layernorm.weight": None,
        "post_feedforward_layernorm.weight": None,
    }


def _architecture(name: str, gemma3: bool) -> Architecture:
    return Architecture(
        name=name,
        config=lambda hf: GemmaConfig.from_hf(hf, gemma3),
        module=GemmaForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )


ARCHITECTURES = {
    "Gemma2ForCausalLM": _architecture("Gemma2ForCausalLM", gemma3=False),
    "Gemma3ForCausalLM": _architecture("Gemma3ForCausalLM", gemma3=True),
}

# llama.cpp's Gemma names: its `ffn_norm` is the norm before the MLP, not after attention.
_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF = {
    "gemma2": GgufFamily(
        model_type="gemma2",
        class_name="Gemma2ForCausalLM",
        layer_names=_GGUF_NAMES,
        norm_plus_one=True,
    ),
    "gemma3": GgufFamily(
        model_type="gemma3_text",
        class_name="Gemma3ForCausalLM",
        layer_names=_GGUF_NAMES,
        norm_plus_one=True,
    ),
}

"""Gemma 2 and Gemma 3 (text): the Llama family's blocks with Gemma's flags, and its layer.

What Gemma changes against Llama (`models/llama.py` holds the flags, so the blocks stay one):
scores scaled by `query_pre_attn_scalar ** -0.5` and soft-capped (Gemma 2), RMSNorm scaling
by `1 + w`, a tanh-GELU gated MLP, embeddings times sqrt(hidden), final logits soft-capped
(Gemma 2), local (sliding-window) and global layers by the config's `layer_types`; Gemma 3
adds per-head q/k norms and a second RoPE base for its local layers (global layers keep their
own, with the config's scaling). Its layer wraps both blocks in norms on either side
(`pre_feedforward_layernorm`, `post_feedforward_layernorm` beside Llama's two).

Glossary: T tokens, D model dim.
"""

from __future__ import annotations

from flax import nnx

from jllm.models.context import StepContext
from jllm.models.layers import RMSNorm
from jllm.models.llama import MLP, Attention, LlamaConfig, LlamaForCausalLM
from jllm.models.rope import RopeConfig


def gemma_config(hf, gemma3: bool) -> LlamaConfig:
    """Gemma 2's (`gemma2`) or Gemma 3's text (`gemma3_text`) config as Llama's with flags."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(
            "Gemma with use_bidirectional_attention (an embedding model) is not supported by "
            "jllm: it serves causal language models."
        )
    head_dim = hf.head_dim
    params = getattr(hf, "rope_parameters", None) or {}
    by_type = "full_attention" in params
    bias = bool(getattr(hf, "attention_bias", False))
    return LlamaConfig.from_hf(
        hf,
        rope=RopeConfig.from_hf(hf, head_dim, "full_attention" if by_type else None),
        local_rope=RopeConfig.from_hf(hf, head_dim, "sliding_attention") if by_type else None,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=gemma3,
        sliding_window=hf.sliding_window,
        layer_types=tuple(hf.layer_types),
        hidden_act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
        query_pre_attn_scalar=hf.query_pre_attn_scalar,
        attn_soft_cap=getattr(hf, "attn_logit_softcapping", None),
        norm_unit_offset=True,
        embed_scale=hf.hidden_size**0.5,
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
    )


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, kind=None):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.self_attn = Attention(cfg, dtype, rngs, kind)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.mlp = MLP(cfg, dtype, rngs)
        self.post_feedforward_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)

    def __call__(self, x, ctx: StepContext, kv_caches):  # x [T, D]
        h, kv_caches = self.self_attn(self.input_layernorm(x), ctx, kv_caches)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), ctx)
        return x + self.post_feedforward_layernorm(h), kv_caches


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer

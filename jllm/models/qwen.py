"""Qwen2 (q/k/v biases; a window on the layers from `max_window_layers` when
`use_sliding_window`) and Qwen3 (per-head q/k RMSNorm, `attention_bias`): the pre-norm
decoder of shared blocks (`models/blocks.py`) with Qwen's attention flags.

Glossary: T tokens, D model dim.
"""

from __future__ import annotations

import dataclasses
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
from jllm.models.blocks import Attention, DecoderLayer, GatedMLP, layer_window
from jllm.models.config import DecoderConfig
from jllm.models.llama import LlamaForCausalLM
from jllm.models.rope import mrope_rows


@dataclass(frozen=True, kw_only=True)
class QwenConfig(DecoderConfig):
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3

    @classmethod
    def qwen2(cls, hf) -> QwenConfig:
        return cls(**DecoderConfig.fields_of(hf), qkv_bias=True)

    @classmethod
    def qwen3(cls, hf) -> QwenConfig:
        bias = bool(getattr(hf, "attention_bias", False))
        return cls(**DecoderConfig.fields_of(hf), qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def qwen3_vl(cls, hf) -> QwenConfig:
        """Qwen3-VL's text model: Qwen3's with M-RoPE's rows interleaved, as transformers
        runs it whatever `mrope_interleaved` says."""
        return interleaved_mrope(cls.qwen3(hf), hf)


def interleaved_mrope(cfg, hf):
    """`cfg` with its M-RoPE rows interleaved (Qwen3-VL's: models/rope.py `mrope_rows`)."""
    section = (getattr(hf, "rope_parameters", None) or {}).get("mrope_section")
    if section is None:
        return cfg
    rope = dataclasses.replace(cfg.rope, mrope_rows=mrope_rows(section, True))
    return dataclasses.replace(cfg, rope=rope)


def qwen_attention(cfg, dtype, rngs: nnx.Rngs, kind) -> Attention:
    """The attention of a Qwen layer of `kind` (the MoE variants' too: models/qwen_moe.py)."""
    return Attention(
        cfg,
        dtype,
        rngs,
        rope=cfg.rope,
        window=layer_window(cfg, kind),
        qkv_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        qk_norm=cfg.qk_norm,
    )


def qwen_attention_weights(cfg) -> dict:
    return attention_weights(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm)


class QwenDecoderLayer(DecoderLayer):
    def __init__(self, cfg: QwenConfig, dtype, rngs: nnx.Rngs, kind=None):
        attention = qwen_attention(cfg, dtype, rngs, kind)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class QwenForCausalLM(LlamaForCausalLM):
    layer_cls = QwenDecoderLayer


def layer_weights(cfg: QwenConfig) -> dict:
    return qwen_attention_weights(cfg) | mlp_weights() | LAYER_NORMS


def _architecture(name: str, config) -> Architecture:
    return Architecture(
        name=name,
        config=config,
        module=QwenForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )


ARCHITECTURES = {
    "Qwen2ForCausalLM": _architecture("Qwen2ForCausalLM", QwenConfig.qwen2),
    "Qwen3ForCausalLM": _architecture("Qwen3ForCausalLM", QwenConfig.qwen3),
    "Qwen3VLTextModel": _architecture("Qwen3VLTextModel", QwenConfig.qwen3_vl),
}

GGUF = {
    "qwen2": GgufFamily(model_type="qwen2", class_name="Qwen2ForCausalLM"),
    "qwen3": GgufFamily(model_type="qwen3", class_name="Qwen3ForCausalLM"),
}

"""Llama 2/3 (llama3 RoPE scaling), SmolLM2 and Mistral (with its sliding window): the
pre-norm decoder of shared blocks (`models/blocks.py`), attention and MLP biases where the
checkpoint has them (`attention_bias`, `mlp_bias`). Tied or untied embeddings.

The embedding, the layer scan, the final norm and the LM head are the shared decoder's
(`models/decoder.py`); this file is the family's config, its layer and its weight map.
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
from jllm.models.blocks import Attention, DecoderLayer, GatedMLP, layer_window
from jllm.models.config import DecoderConfig
from jllm.models.decoder import CausalLM


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    attention_bias: bool = False  # q/k/v and output biases
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, hf) -> LlamaConfig:
        return cls(
            **DecoderConfig.fields_of(hf),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        )


class LlamaDecoderLayer(DecoderLayer):
    """`kind`: the layer's `layer_types` entry (None: full attention)."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, kind=None):
        bias = cfg.attention_bias
        attention = Attention(
            cfg,
            dtype,
            rngs,
            rope=cfg.rope,
            window=layer_window(cfg, kind),
            qkv_bias=bias,
            o_bias=bias,
        )
        mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs, cfg.mlp_bias
        )
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer

    @classmethod
    def layer_kinds(cls, cfg: DecoderConfig):
        return cfg.layer_types or (None,) * cfg.num_layers

    @classmethod
    def attention_kind(cls, cfg: DecoderConfig, kind):
        return layer_window(cfg, kind)


def layer_weights(cfg: LlamaConfig) -> dict:
    bias = cfg.attention_bias
    return (
        attention_weights(qkv_bias=bias, o_bias=bias) | mlp_weights(bias=cfg.mlp_bias) | LAYER_NORMS
    )


def _architecture(name: str) -> Architecture:
    return Architecture(
        name=name,
        config=LlamaConfig.from_hf,
        module=LlamaForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )


ARCHITECTURES = {name: _architecture(name) for name in ("LlamaForCausalLM", "MistralForCausalLM")}

GGUF = {"llama": GgufFamily(model_type="llama", class_name="LlamaForCausalLM", permuted=True)}

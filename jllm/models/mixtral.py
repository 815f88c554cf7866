"""Mixtral: Llama's attention (with Mistral's window where the config has one) and a mixture
of experts in every layer (`models/moe.py`), whose checkpoint names the experts `w1`/`w2`/`w3`
under `block_sparse_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    attention_weights,
    expert_weights,
)
from jllm.models.blocks import Attention, DecoderLayer, layer_window, split_kind
from jllm.models.config import DecoderConfig
from jllm.models.moe import MoE, MoeConfig, MoeForCausalLM


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(DecoderConfig):
    moe: MoeConfig

    @classmethod
    def from_hf(cls, hf) -> MixtralConfig:
        moe = MoeConfig.from_hf(
            hf,
            sparse_layers=(True,) * hf.num_hidden_layers,
            num_experts=hf.num_local_experts,
            intermediate_size=hf.intermediate_size,
            norm_topk_prob=True,
        )
        return cls(**DecoderConfig.fields_of(hf), moe=moe)


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, cfg: MixtralConfig, dtype, rngs: nnx.Rngs, kind=None):
        attn_kind, _ = split_kind(kind)
        window = layer_window(cfg, attn_kind)
        attention = Attention(cfg, dtype, rngs, rope=cfg.rope, window=window)
        mlp = MoE.of(cfg.hidden_size, cfg.moe, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class MixtralForCausalLM(MoeForCausalLM):
    layer_cls = MixtralDecoderLayer


_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def layer_weights(cfg: MixtralConfig) -> dict:
    experts = {p: f"block_sparse_moe.experts.*.{w}.weight" for p, w in _EXPERTS.items()}
    moe = expert_weights("block_sparse_moe.gate.weight", experts)
    return attention_weights() | LAYER_NORMS | moe


ARCHITECTURES = {
    "MixtralForCausalLM": Architecture(
        name="MixtralForCausalLM",
        config=MixtralConfig.from_hf,
        module=MixtralForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )
}

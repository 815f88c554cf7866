"""Qwen2-MoE and Qwen3-MoE: Qwen's attention (`models/qwen.py`) and a mixture of experts in
every `decoder_sparse_step`-th layer but `mlp_only_layers`, which keep the dense gated MLP;
Qwen2-MoE adds a shared expert behind a sigmoid gate (`models/moe.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    expert_weights,
    mlp_weights,
)
from jllm.models.blocks import DecoderLayer, GatedMLP, split_kind
from jllm.models.config import DecoderConfig
from jllm.models.moe import MoE, MoeConfig, MoeForCausalLM
from jllm.models.qwen import QwenConfig, qwen_attention, qwen_attention_weights


def sparse_layers(hf) -> tuple[bool, ...]:
    """Qwen-MoE's sparse layers: every `decoder_sparse_step`-th but `mlp_only_layers`."""
    only_dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in only_dense and hf.num_experts > 0 and (i + 1) % step == 0
        for i in range(hf.num_hidden_layers)
    )


@dataclass(frozen=True, kw_only=True)
class QwenMoeConfig(QwenConfig):
    moe: MoeConfig

    @classmethod
    def from_hf(cls, hf, qwen3: bool) -> QwenMoeConfig:
        moe = MoeConfig.from_hf(
            hf,
            sparse_layers=sparse_layers(hf),
            num_experts=hf.num_experts,
            intermediate_size=hf.moe_intermediate_size,
            norm_topk_prob=hf.norm_topk_prob,
            shared=0 if qwen3 else hf.shared_expert_intermediate_size,
        )
        if qwen3:
            bias = bool(getattr(hf, "attention_bias", False))
            flags = dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
        else:
            flags = dict(qkv_bias=bool(getattr(hf, "qkv_bias", True)))
        return cls(**DecoderConfig.fields_of(hf), **flags, moe=moe)


class QwenMoeDecoderLayer(DecoderLayer):
    """`kind`: (the layer's `layer_types` entry, whether its MLP is sparse)."""

    def __init__(self, cfg: QwenMoeConfig, dtype, rngs: nnx.Rngs, kind=None):
        attn_kind, sparse = split_kind(kind)
        attention = qwen_attention(cfg, dtype, rngs, attn_kind)
        D, act = cfg.hidden_size, cfg.hidden_act
        if sparse:
            mlp = MoE.of(D, cfg.moe, act, dtype, rngs)
        else:
            mlp = GatedMLP(D, cfg.intermediate_size, act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class QwenMoeForCausalLM(MoeForCausalLM):
    layer_cls = QwenMoeDecoderLayer


def mlp_names(moe: MoeConfig | None) -> dict:
    """The MLPs' names of a Qwen model with experts `moe` (None: all dense): the dense MLP's
    where some layers are dense, the router and experts where some are sparse, and the
    shared expert where there is one (Qwen2-MoE's, Qwen3-Next's)."""
    sparse = moe.sparse_layers if moe is not None else ()
    names = {} if sparse and all(sparse) else mlp_weights()
    if any(sparse):
        experts = {p: f"mlp.experts.*.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        names |= expert_weights("mlp.gate.weight", experts)
        if moe.shared_expert_intermediate_size:
            names |= mlp_weights("mlp.shared_expert")
            names["mlp.shared_expert_gate.weight"] = "t"
    return names


def layer_weights(cfg: QwenMoeConfig) -> dict:
    """Qwen's attention and the MLPs' names (`mlp_names`)."""
    return qwen_attention_weights(cfg) | LAYER_NORMS | mlp_names(cfg.moe)


def _architecture(name: str, qwen3: bool) -> Architecture:
    return Architecture(
        name=name,
        config=lambda hf: QwenMoeConfig.from_hf(hf, qwen3),
        module=QwenMoeForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )


ARCHITECTURES = {
    "Qwen2MoeForCausalLM": _architecture("Qwen2MoeForCausalLM", qwen3=False),
    "Qwen3MoeForCausalLM": _architecture("Qwen3MoeForCausalLM", qwen3=True),
}

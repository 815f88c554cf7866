"""Qwen2-MoE and Qwen3-MoE: Qwen's attention (`models/qwen.py`) and a mixture of experts in
every `decoder_sparse_step`-th layer but `mlp_only_layers`, which keep the dense gated MLP;
Qwen2-MoE adds a shared expert behind a sigmoid gate (`models/moe.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from flax import nnx

from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    cut_stacked_experts,
    expert_weights,
    mlp_weights,
)
from jllm.models.blocks import DecoderLayer, GatedMLP, split_kind
from jllm.models.config import DecoderConfig
from jllm.models.moe import MoE, MoeConfig, MoeForCausalLM
from jllm.models.qwen import (
    QwenConfig,
    interleaved_mrope,
    qwen_attention,
    qwen_attention_weights,
)


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
            # Qwen3-VL-MoE's config has no flag: its router always renormalises the top k
            norm_topk_prob=getattr(hf, "norm_topk_prob", True),
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


_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def stacked_experts(weights, cfg):
    """Qwen3-VL-MoE's checkpoints stack each layer's experts (`experts.gate_up_proj`
    [E, D, 2F], gate first, and `experts.down_proj` [E, F, D]): cut per expert. Files
    transformers saves hold its modules' layout instead ([E, 2F, D] and [E, D, F]), which
    the model's width tells apart (transformers' loader transposes by shape too)."""
    for name, w in weights:
        m = _STACKED.fullmatch(name)
        if m is None:
            yield name, w
            continue
        w = np.asarray(w)
        module_layout = (
            w.shape[2] == cfg.hidden_size
            if m.group(2) == "gate_up_proj"
            else (w.shape[1] == cfg.hidden_size)
        )
        if module_layout:
            w = w.transpose(0, 2, 1)
        yield from cut_stacked_experts(m.group(1), m.group(2), w, False)


def _architecture(name: str, qwen3: bool, vl: bool = False) -> Architecture:
    def config(hf):
        cfg = QwenMoeConfig.from_hf(hf, qwen3)
        return interleaved_mrope(cfg, hf) if vl else cfg

    return Architecture(
        name=name,
        config=config,
        module=QwenMoeForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
        regroup=stacked_experts if vl else (lambda weights, cfg: weights),
    )


ARCHITECTURES = {
    "Qwen2MoeForCausalLM": _architecture("Qwen2MoeForCausalLM", qwen3=False),
    "Qwen3MoeForCausalLM": _architecture("Qwen3MoeForCausalLM", qwen3=True),
    # Qwen3-VL-MoE's language model: Qwen3-MoE's with interleaved M-RoPE
    "Qwen3VLMoeTextModel": _architecture("Qwen3VLMoeTextModel", qwen3=True, vl=True),
}

"""gpt-oss (`GptOssForCausalLM`): grouped-query attention with biases and learned attention
sinks (a per-head logit in each softmax's denominator), its layers alternating between a
sliding window and full attention (`layer_types`), YaRN rotary positions, and a mixture of
experts in every layer whose router has a bias, whose experts have biases, and whose gated
half is the clamped SwiGLU (`moe.SwigluOai`: `swiglu_limit`, `swiglu_alpha`). The router
takes the top k of its logits and a softmax over them, which is `moe.route`'s renormalised
top k.

The checkpoint stacks each layer's experts (`mlp.experts.gate_up_proj` [E, D, 2F], gate and
up interleaved column by column, `down_proj` [E, F, D], and their `_bias`es); `regroup` cuts
them into one transformers-layout tensor per expert and projection, which the loader stacks
as every family's (so online fp8 quantization and expert parallelism apply unchanged). The
released MXFP4 checkpoints store the experts [E, Out, In] in 4 bits (quantization/mxfp4.py:
one QuantizedWeight per stacked tensor, gate and up interleaved row by row): cut the same way,
they stay in 4 bits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    GgufFamily,
    attention_weights,
    cut_stacked_experts,
    unstacked_experts,
)
from jllm.models.blocks import Attention, DecoderLayer, layer_window, split_kind
from jllm.models.config import DecoderConfig
from jllm.models.moe import MoE, MoeConfig, MoeForCausalLM, SwigluOai
from jllm.quantization.weights import QuantizedWeight


@dataclass(frozen=True, kw_only=True)
class GptOssConfig(DecoderConfig):
    moe: MoeConfig
    swiglu: SwigluOai
    attention_bias: bool = True

    @classmethod
    def from_hf(cls, hf) -> GptOssConfig:
        moe = MoeConfig(
            sparse_layers=(True,) * hf.num_hidden_layers,
            num_experts=int(hf.num_local_experts),
            num_experts_per_tok=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size),
            norm_topk_prob=True,
            router_bias=True,
            expert_bias=True,
        )
        swiglu = SwigluOai(
            alpha=float(getattr(hf, "swiglu_alpha", None) or 1.702),
            limit=float(getattr(hf, "swiglu_limit", None) or 7.0),
        )
        bias = bool(getattr(hf, "attention_bias", True))
        return cls(**DecoderConfig.fields_of(hf), moe=moe, swiglu=swiglu, attention_bias=bias)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: GptOssConfig, dtype, rngs: nnx.Rngs, kind=None):
        window = layer_window(cfg, split_kind(kind)[0])
        bias = cfg.attention_bias
        attention = Attention(
            cfg, dtype, rngs, rope=cfg.rope, window=window, sinks=True, qkv_bias=bias, o_bias=bias
        )
        mlp = MoE.of(cfg.hidden_size, cfg.moe, cfg.swiglu, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class GptOssForCausalLM(MoeForCausalLM):
    layer_cls = GptOssDecoderLayer


_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def regroup(weights, cfg=None):
    """The stacked experts as one tensor per expert and projection, transformers' [Out, In]
    (`mlp.experts.{e}.gate_proj.weight`, ...; biases `...gate_proj.bias`)."""
    for name, w in weights:
        m = _STACKED.fullmatch(name)
        if m is None:
            yield name, w
            continue
        prefix, proj, bias = m.group(1), m.group(2), m.group(3)
        if isinstance(w, QuantizedWeight):  # MXFP4's [E, Out, In]: gate and up by rows
            yield from _quantized_experts(prefix, proj, w)
            continue
        w = np.asarray(w)  # gate in the even columns, up in the odd
        yield from cut_stacked_experts(prefix, proj, w, interleaved=True, bias=bool(bias))


def _quantized_experts(prefix: str, proj: str, w: QuantizedWeight):
    for e in range(w.codes.shape[0]):
        if proj == "down_proj":
            parts = {"down_proj": jax.tree.map(lambda a, e=e: a[e], w)}
        else:
            parts = {
                "gate_proj": jax.tree.map(lambda a, e=e: a[e, 0::2], w),
                "up_proj": jax.tree.map(lambda a, e=e: a[e, 1::2], w),
            }
        for part, value in parts.items():
            yield f"{prefix}.{e}.{part}.weight", value


def layer_weights(cfg: GptOssConfig) -> dict:
    bias = cfg.attention_bias
    names = attention_weights(qkv_bias=bias, o_bias=bias) | LAYER_NORMS
    names["self_attn.sinks"] = None
    names["mlp.router.weight"] = ("mlp.gate.weight", "t")
    names["mlp.router.bias"] = ("mlp.gate.bias", None)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"mlp.experts.*.{proj}.weight"] = (f"mlp.experts.{proj}", "t")
        bias_name = proj.replace("_proj", "_bias")
        names[f"mlp.experts.*.{proj}.bias"] = (f"mlp.experts.{bias_name}", None)
    return names


def _gguf_regroup(weights, gf):
    """llama.cpp's `gpt-oss` tensors as per-expert checkpoint tensors (its converter,
    GptOssModel, undone): the sinks named without `.weight`; each layer's experts stacked
    [E, Out, In] with gate and up apart (`ffn_gate_exps`, `ffn_up_exps`) or fused with
    the gate's rows first (`ffn_gate_up_exps`), biases alike; MXFP4 experts come as
    QuantizedWeights (gguf_io.py) and are cut alike."""
    for name, w in weights:
        if name.endswith("self_attn.sinks.weight"):
            yield name.removesuffix(".weight"), w
        elif ".mlp.experts.gate_up_proj." in name:  # [E, 2F, D] weights, [E, 2F] biases
            for i, proj in enumerate(("gate_proj", "up_proj")):
                half = jax.tree.map(lambda a, i=i: np.split(np.asarray(a), 2, axis=1)[i], w)
                yield from unstacked_experts(name.replace("gate_up_proj", proj), half)
        elif ".mlp.experts." in name:
            yield from unstacked_experts(name, w)
        else:
            yield name, w


GGUF = {
    "gpt-oss": GgufFamily(
        model_type="gpt_oss",
        class_name="GptOssForCausalLM",
        layer_names={
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
            **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down", "gate_up")},
        },
        regroup=_gguf_regroup,
    )
}

ARCHITECTURES = {
    "GptOssForCausalLM": Architecture(
        name="GptOssForCausalLM",
        config=GptOssConfig.from_hf,
        module=GptOssForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
        regroup=regroup,
    )
}

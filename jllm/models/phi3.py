"""Phi-3 (and Phi-4-mini): Llama's layer with LongRoPE and partial rotary (both in its
`RopeConfig`), an optional window on every layer, and fused projections in its checkpoint
(`qkv_proj`, `gate_up_proj`) that the loader splits by rows into the projections the shared
blocks have, so that tensor parallelism shards them as Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

from jllm.models.architecture import TOP_WEIGHTS, Architecture, GgufFamily
from jllm.models.config import DecoderConfig
from jllm.models.llama import LlamaConfig, LlamaForCausalLM, layer_weights


@dataclass(frozen=True, kw_only=True)
class Phi3Config(LlamaConfig):
    """Llama's fields; Phi-3 has neither attention nor MLP biases."""

    @classmethod
    def from_hf(cls, hf) -> Phi3Config:
        return cls(**DecoderConfig.fields_of(hf))


def fused_weights(cfg: Phi3Config) -> dict[str, tuple[tuple[str, int], ...]]:
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.qkv_proj.weight": (
            ("self_attn.q_proj.weight", q),
            ("self_attn.k_proj.weight", kv),
            ("self_attn.v_proj.weight", kv),
        ),
        "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", f), ("mlp.up_proj.weight", f)),
    }


ARCHITECTURES = {
    "Phi3ForCausalLM": Architecture(
        name="Phi3ForCausalLM",
        config=Phi3Config.from_hf,
        module=LlamaForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
        fused_weights=fused_weights,
    )
}

GGUF = {
    "phi3": GgufFamily(
        model_type="phi3",
        class_name="Phi3ForCausalLM",
        layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    )
}

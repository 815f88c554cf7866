"""Which module runs a checkpoint: its config's `model_type` (or `architectures`) -> the
config builder, the NNX module and the weight map.

A weight map names every checkpoint tensor the module takes (transformers' names within a
layer, or at the top level) and how its layout converts to ours; a tensor that no entry names
and that is not a known leftover is an error that names it, never silently dropped (a
checkpoint with biases the module lacks must not load without them).

Adding a family: one file under models/ with its config and its decoder layer (a subclass of
`decoder.CausalLM` naming `layer_cls`, and `layer_kinds` where its layers differ), and its
config builder and weight map here. Families that differ from one by flags (Qwen2, Qwen3 and
Mistral from Llama) are flags on its config, not files.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from jllm.models.llama import LlamaConfig, LlamaForCausalLM

# Tensors some checkpoints carry that hold no weights: buffers transformers once saved.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Architecture:
    name: str  # transformers' class name, as vLLM's registry names it
    config: Callable  # transformers config -> our config
    module: type
    layer_weights: Callable[[object], dict[str, str | None]]  # our config -> {name: layout}
    top_weights: dict[str, tuple[tuple[str, ...], str | None]]  # name -> (our path, layout)


def _llama_layer_weights(cfg: LlamaConfig) -> dict[str, str | None]:
    """Layouts: "qkv" [N*H, D] -> [D, N, H]; "o" [D, N*H] -> [N, H, D]; "bias" [N*H] ->
    [N, H]; "t" [out, in] -> [in, out]; None as is."""
    names = {
        "self_attn.q_proj.weight": "qkv",
        "self_attn.k_proj.weight": "qkv",
        "self_attn.v_proj.weight": "qkv",
        "self_attn.o_proj.weight": "o",
        "mlp.gate_proj.weight": "t",
        "mlp.up_proj.weight": "t",
        "mlp.down_proj.weight": "t",
        "input_layernorm.weight": None,
        "post_attention_layernorm.weight": None,
    }
    if cfg.qkv_bias:
        names |= {f"self_attn.{p}_proj.bias": "bias" for p in "qkv"}
    if cfg.o_bias:
        names["self_attn.o_proj.bias"] = None
    if cfg.mlp_bias:
        names |= {f"mlp.{p}_proj.bias": None for p in ("gate", "up", "down")}
    if cfg.qk_norm:
        names |= {"self_attn.q_norm.weight": None, "self_attn.k_norm.weight": None}
    return names


_LLAMA_TOP = {
    "model.embed_tokens.weight": (("embed_tokens",), None),
    "model.norm.weight": (("norm", "weight"), None),
    "lm_head.weight": (("lm_head", "weight"), "t"),
}


def _no_sliding_window(hf, family: str) -> None:
    window = getattr(hf, "sliding_window", None)
    uses = getattr(hf, "use_sliding_window", window is not None)
    if uses and window and window < hf.max_position_embeddings:
        raise ValueError(f"{family} with a sliding window is not supported by jllm yet.")


def _llama(hf) -> LlamaConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return LlamaConfig.from_hf(
        hf, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False))
    )


def _mistral(hf) -> LlamaConfig:
    _no_sliding_window(hf, "Mistral")
    return LlamaConfig.from_hf(hf)


def _qwen2(hf) -> LlamaConfig:
    _no_sliding_window(hf, "Qwen2")
    return LlamaConfig.from_hf(hf, qkv_bias=True)


def _qwen3(hf) -> LlamaConfig:
    _no_sliding_window(hf, "Qwen3")
    bias = bool(getattr(hf, "attention_bias", False))
    return LlamaConfig.from_hf(hf, qkv_bias=bias, o_bias=bias, qk_norm=True)


def _arch(name, config) -> Architecture:
    return Architecture(name, config, LlamaForCausalLM, _llama_layer_weights, _LLAMA_TOP)


REGISTRY: dict[str, Architecture] = {
    "llama": _arch("LlamaForCausalLM", _llama),
    "mistral": _arch("MistralForCausalLM", _mistral),
    "qwen2": _arch("Qwen2ForCausalLM", _qwen2),
    "qwen3": _arch("Qwen3ForCausalLM", _qwen3),
}
_BY_CLASS = {a.name: a for a in REGISTRY.values()}


def resolve(hf_config) -> Architecture:
    """The architecture of a transformers config, by `model_type`, else `architectures`."""
    arch = REGISTRY.get(getattr(hf_config, "model_type", None))
    if arch is None:
        for name in getattr(hf_config, "architectures", None) or []:
            arch = _BY_CLASS.get(name)
            if arch is not None:
                break
    if arch is None:
        kind = getattr(hf_config, "model_type", None) or getattr(hf_config, "architectures", None)
        raise ValueError(
            f"Model type {kind!r} is not supported by jllm yet (supported: "
            f"{', '.join(sorted(REGISTRY))})."
        )
    return arch

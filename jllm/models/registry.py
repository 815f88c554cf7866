"""Which module runs a checkpoint: its config's `model_type` (or `architectures`) -> the
config builder, the NNX module and the weight map.

A weight map names every checkpoint tensor the module takes (transformers' names within a
layer, or at the top level) and how its layout converts to ours; a tensor that no entry names
and that is not a known leftover is an error that names it, never silently dropped (a
checkpoint with biases the module lacks must not load without them).

A checkpoint that fuses projections (Phi-3's `qkv_proj` and `gate_up_proj`) names each
fused tensor's parts (`fused_weights`): the loader splits it by rows into the projections the
module has, so that tensor parallelism shards each part as it shards Llama's.

Adding a family: one file under models/ with its config and its decoder layer (a subclass of
`decoder.CausalLM` naming `layer_cls`, and `layer_kinds` where its layers differ), and its
config builder and weight map here. Families that differ from one by flags (Qwen2, Qwen3,
Mistral and Phi-3 from Llama, Gemma's blocks) are flags on its config, not files.

Sliding windows follow transformers: a layer whose `layer_types` entry is
"sliding_attention" attends over the config's `sliding_window` (Mistral's and Phi-3's every
layer when the config has a window; Qwen2's layers from `max_window_layers` when
`use_sliding_window`). `settle` fixes what depends on the engine: `max_model_len` (a window
that long never binds and is dropped; LongRoPE's factors) and `disable_sliding_window`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from jllm.models.gemma import GemmaForCausalLM, gemma_config
from jllm.models.llama import LlamaConfig, LlamaForCausalLM
from jllm.models.vision import (
    VisionConfig,
    gemma3_vision_config,
    llava_vision_config,
    vision_model,
)

# Tensors some checkpoints carry that hold no weights: buffers transformers once saved.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Architecture:
    name: str  # transformers' class name, as vLLM's registry names it
    config: Callable  # transformers config -> our config
    module: type
    layer_weights: Callable[[object], dict[str, str | None]]  # our config -> {name: layout}
    top_weights: dict[str, tuple[tuple[str, ...], str | None]]  # name -> (our path, layout)
    # A fused layer tensor -> its parts' names and row counts, in order (our config -> map).
    fused_weights: Callable[[object], dict[str, tuple[tuple[str, int], ...]]] = lambda cfg: {}
    # A checkpoint name -> the name the maps use, or None for a tensor the model does not
    # use (a vision-language model's: `_vision_rename`).
    rename: Callable[[str], str | None] = lambda name: name


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


def _windows(hf) -> dict:
    """The config's sliding window and per-layer types, as transformers reads them (Qwen2 and
    Qwen3 drop their window without `use_sliding_window`)."""
    window = getattr(hf, "sliding_window", None)
    if not getattr(hf, "use_sliding_window", True):
        window = None
    if window is None:
        return {}
    types = getattr(hf, "layer_types", None) or ("sliding_attention",) * hf.num_hidden_layers
    return dict(sliding_window=int(window), layer_types=tuple(types))


def _llama(hf) -> LlamaConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return LlamaConfig.from_hf(
        hf,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        **_windows(hf),
    )


def _mistral(hf) -> LlamaConfig:
    return LlamaConfig.from_hf(hf, **_windows(hf))


def _qwen2(hf) -> LlamaConfig:
    return LlamaConfig.from_hf(hf, qkv_bias=True, **_windows(hf))


def _qwen3(hf) -> LlamaConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return LlamaConfig.from_hf(hf, qkv_bias=bias, o_bias=bias, qk_norm=True, **_windows(hf))


def _moe_flags(hf, sparse: tuple[bool, ...], num_experts: int, width: int, norm: bool) -> dict:
    """The mixture-of-experts flags of a config (models/moe.py); routers other than a
    softmax over a linear gate are refused."""
    scoring = getattr(hf, "scoring_func", "softmax")
    if scoring != "softmax" or getattr(hf, "topk_method", None) not in (None, "greedy"):
        raise ValueError(
            f"MoE router {scoring!r} / {getattr(hf, 'topk_method', None)!r} is not supported by "
            "jllm yet (supported: softmax over a linear gate, then top-k)."
        )
    return dict(
        moe_layers=sparse,
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(width),
        norm_topk_prob=bool(norm),
    )


def _mixtral(hf) -> LlamaConfig:
    sparse = (True,) * hf.num_hidden_layers
    flags = _moe_flags(hf, sparse, hf.num_local_experts, hf.intermediate_size, True)
    return LlamaConfig.from_hf(hf, **flags, **_windows(hf))


def _qwen_sparse_layers(hf) -> tuple[bool, ...]:
    """Qwen-MoE's sparse layers: every `decoder_sparse_step`-th but `mlp_only_layers`."""
    only_dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = hf.decoder_sparse_step
    return tuple(
        i not in only_dense and hf.num_experts > 0 and (i + 1) % step == 0
        for i in range(hf.num_hidden_layers)
    )


def _qwen2_moe(hf) -> LlamaConfig:
    sparse = _qwen_sparse_layers(hf)
    flags = _moe_flags(hf, sparse, hf.num_experts, hf.moe_intermediate_size, hf.norm_topk_prob)
    shared = int(hf.shared_expert_intermediate_size or 0)
    return LlamaConfig.from_hf(
        hf,
        qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        shared_expert_intermediate_size=shared,
        **flags,
        **_windows(hf),
    )


def _qwen3_moe(hf) -> LlamaConfig:
    sparse = _qwen_sparse_layers(hf)
    flags = _moe_flags(hf, sparse, hf.num_experts, hf.moe_intermediate_size, hf.norm_topk_prob)
    bias = bool(getattr(hf, "attention_bias", False))
    return LlamaConfig.from_hf(
        hf, qkv_bias=bias, o_bias=bias, qk_norm=True, **flags, **_windows(hf)
    )


def _moe_layer_weights(cfg: LlamaConfig, checkpoint: dict[str, str]) -> dict:
    """Llama's names, plus the router and the experts' (`checkpoint`: our expert
    projection -> the checkpoint's name for it, `*` for the expert index) for a model with
    sparse layers; a model with dense layers too keeps the dense MLP's names."""
    names = _llama_layer_weights(cfg)
    if all(cfg.moe_layers):
        names = {k: v for k, v in names.items() if not k.startswith("mlp.")}
    router = checkpoint.pop("gate")
    names[router] = ("mlp.gate.weight", "t")
    for ours, theirs in checkpoint.items():
        names[theirs] = (f"mlp.experts.{ours}", "t")
    return names


def _mixtral_weights(cfg: LlamaConfig) -> dict:
    experts = {p: f"block_sparse_moe.experts.*.{w}.weight" for p, w in _MIXTRAL_EXPERTS.items()}
    return _moe_layer_weights(cfg, {"gate": "block_sparse_moe.gate.weight", **experts})


_MIXTRAL_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _qwen3_moe_weights(cfg: LlamaConfig) -> dict:
    experts = {p: f"mlp.experts.*.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    names = _moe_layer_weights(cfg, {"gate": "mlp.gate.weight", **experts})
    if cfg.shared_expert_intermediate_size:  # Qwen2-MoE
        names |= {f"mlp.shared_expert.{p}_proj.weight": "t" for p in ("gate", "up", "down")}
        names["mlp.shared_expert_gate.weight"] = "t"
    return names


def _phi3(hf) -> LlamaConfig:
    return LlamaConfig.from_hf(hf, **_windows(hf))


def _phi3_fused(cfg: LlamaConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.qkv_proj.weight": (
            ("self_attn.q_proj.weight", q),
            ("self_attn.k_proj.weight", kv),
            ("self_attn.v_proj.weight", kv),
        ),
        "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", f), ("mlp.up_proj.weight", f)),
    }


def _gemma_layer_weights(cfg: LlamaConfig) -> dict[str, str | None]:
    names = _llama_layer_weights(cfg)
    names |= {"pre_feedforward_layernorm.weight": None, "post_feedforward_layernorm.weight": None}
    return names


def _arch(name, config, weights=_llama_layer_weights, **kw) -> Architecture:
    return Architecture(name, config, LlamaForCausalLM, weights, _LLAMA_TOP, **kw)


def _gemma(name, gemma3: bool) -> Architecture:
    def config(hf):
        return gemma_config(hf, gemma3)

    return Architecture(name, config, GemmaForCausalLM, _gemma_layer_weights, _LLAMA_TOP)


REGISTRY: dict[str, Architecture] = {
    "llama": _arch("LlamaForCausalLM", _llama),
    "mistral": _arch("MistralForCausalLM", _mistral),
    "qwen2": _arch("Qwen2ForCausalLM", _qwen2),
    "qwen3": _arch("Qwen3ForCausalLM", _qwen3),
    "phi3": _arch("Phi3ForCausalLM", _phi3, fused_weights=_phi3_fused),
    "mixtral": _arch("MixtralForCausalLM", _mixtral, _mixtral_weights),
    "qwen2_moe": _arch("Qwen2MoeForCausalLM", _qwen2_moe, _qwen3_moe_weights),
    "qwen3_moe": _arch("Qwen3MoeForCausalLM", _qwen3_moe, _qwen3_moe_weights),
    "gemma2": _gemma("Gemma2ForCausalLM", gemma3=False),
    "gemma3_text": _gemma("Gemma3ForCausalLM", gemma3=True),
}
_BY_CLASS = {a.name: a for a in REGISTRY.values()}

# Vision-language models: a text family's architecture, its config's `vision` set, the
# encoder and projector beside its decoder (models/vision.py).
MULTIMODAL: dict[str, tuple[str, Callable[[object], VisionConfig]]] = {
    "llava": ("LlavaForConditionalGeneration", llava_vision_config),
    "gemma3": ("Gemma3ForConditionalGeneration", gemma3_vision_config),
}
_PREFIXES = (
    ("model.language_model.", "model."),  # transformers >= 4.52's layout
    ("language_model.model.", "model."),  # the hub's LLaVA-1.5 and Gemma 3 checkpoints
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _vision_rename(vision: VisionConfig):
    """A vision-language checkpoint's names -> the text family's and the vision modules'
    (`vision_tower.vision_model.X` -> `vision_tower.X`); None for what the model does not run:
    SigLIP's pooling head, CLIP's post_layernorm, and the layers past LLaVA's feature layer."""
    layer = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\..+")

    def rename(name: str) -> str | None:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name[len("vision_tower.vision_model.") :]
        if name.startswith("vision_tower.head."):
            return None
        if name.startswith("vision_tower.post_layernorm.") and not vision.post_norm:
            return None
        m = layer.fullmatch(name)
        if m and int(m.group(1)) >= vision.num_layers:
            return None
        return name

    return rename


def _multimodal(hf_config) -> Architecture:
    name, vision_config = MULTIMODAL[hf_config.model_type]
    text = resolve(hf_config.text_config)
    vision = vision_config(hf_config)

    def config(hf):
        cfg = text.config(hf.text_config)
        # transformers ties the LM head by the top-level config's flag, not the text's.
        tied = getattr(hf, "tie_word_embeddings", cfg.tie_word_embeddings)
        return dataclasses.replace(cfg, vision=vision_config(hf), tie_word_embeddings=bool(tied))

    return dataclasses.replace(
        text,
        name=name,
        config=config,
        module=vision_model(text.module),
        rename=_vision_rename(vision),
    )


def resolve(hf_config) -> Architecture:
    """The architecture of a transformers config, by `model_type`, else `architectures`."""
    if getattr(hf_config, "model_type", None) in MULTIMODAL:
        return _multimodal(hf_config)
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
            f"{', '.join(sorted([*REGISTRY, *MULTIMODAL]))})."
        )
    return arch


def sliding_window(cfg) -> int | None:
    """The model's largest sliding window, or None when no layer slides."""
    return getattr(cfg, "sliding_window", None) if getattr(cfg, "layer_types", None) else None


def settle(cfg, max_model_len: int, disable_sliding_window: bool = False):
    """`cfg` for an engine of `max_model_len`: LongRoPE's short or long factors; windows off
    with `disable_sliding_window` (the engine caps `max_model_len` at the window first) or
    when no request can outgrow them (they would mask nothing)."""
    changes = {}
    for name in ("rope", "local_rope"):
        rope = getattr(cfg, name, None)
        if rope is not None:
            changes[name] = rope.for_length(max_model_len)
    window = sliding_window(cfg)
    if window is not None and (disable_sliding_window or window >= max_model_len):
        changes["sliding_window"] = None
    return dataclasses.replace(cfg, **changes)

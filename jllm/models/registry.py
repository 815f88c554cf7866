"""Which family file runs a checkpoint: a table of transformers' names -> family modules.

A config's `model_type` (else one of its `architectures`) names a family module under
models/ and the transformers class it serves; the module's `ARCHITECTURES` holds that class's
`Architecture` (config builder, NNX module, weight map: models/architecture.py), or, for a
vision-language family, its `VisionFamily` (models/vision.py), composed here with the text
family its `text_config` names. Modules are imported when a checkpoint needs them.

llama.cpp's architecture names (a GGUF file's `general.architecture`) map to family modules
too; the module's `GGUF` holds how llama.cpp names that architecture's tensors.

Adding a family: one file under models/ (its config, its layer from the shared blocks, its
weight map, and its GGUF names if llama.cpp writes it) and its row here; docs/models.md
walks through one.
"""

from __future__ import annotations

import importlib
import re

from jllm.models.architecture import Architecture, GgufFamily

# model_type -> (family module, transformers class).
MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),
    "qwen2": ("qwen", "Qwen2ForCausalLM"),
    "qwen3": ("qwen", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    "llama4_text": ("llama4", "Llama4ForCausalLM"),
    "llama4": ("llama4", "Llama4ForConditionalGeneration"),
    "qwen2_moe": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "deepseek_v2": ("deepseek", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek", "DeepseekV3ForCausalLM"),
    "gemma2": ("gemma", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma", "Gemma3ForCausalLM"),
    "llava": ("llava", "LlavaForConditionalGeneration"),
    "gemma3": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen2_5_vl_text": ("qwen", "Qwen2ForCausalLM"),  # Qwen2.5-VL's language model
    "qwen3_vl": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_text": ("qwen", "Qwen3VLTextModel"),  # Qwen3-VL's language model
    "qwen3_vl_moe": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_vl_moe_text": ("qwen_moe", "Qwen3VLMoeTextModel"),
}
_BY_CLASS = {cls: (module, cls) for module, cls in MODEL_TYPES.values()}

# llama.cpp architecture -> family module (whose GGUF maps it).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "deepseek2": "deepseek",
    "qwen3next": "qwen3_next",
    "gpt-oss": "gpt_oss",
}

# Tensors some checkpoints carry that hold no weights: buffers transformers once saved.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


_OUT_OF_TREE: set[str] = set()  # modules `register` named, imported by their own path


def _family(module: str):
    return importlib.import_module(module if module in _OUT_OF_TREE else f"jllm.models.{module}")


def register(model_type: str, module: str, class_name: str) -> None:
    """Serve configs of `model_type` (or naming `class_name` in `architectures`) with the
    family module `module` (its import path), whose `ARCHITECTURES` has
    `class_name`: an out-of-tree family, as vLLM's `ModelRegistry.register_model`. A
    transformers config class for a new `model_type` is registered with transformers'
    `AutoConfig.register`."""
    _OUT_OF_TREE.add(module)
    MODEL_TYPES[model_type] = (module, class_name)
    _BY_CLASS[class_name] = (module, class_name)


def resolve(hf_config) -> Architecture:
    """The architecture of a transformers config, by `model_type`, else `architectures`."""
    entry = MODEL_TYPES.get(getattr(hf_config, "model_type", None))
    if entry is None:
        names = getattr(hf_config, "architectures", None) or []
        entry = next((_BY_CLASS[n] for n in names if n in _BY_CLASS), None)
    if entry is None:
        kind = getattr(hf_config, "model_type", None) or getattr(hf_config, "architectures", None)
        raise ValueError(
            f"Model type {kind!r} is not supported by jllm yet (supported: "
            f"{', '.join(sorted(MODEL_TYPES))})."
        )
    module, name = entry
    arch = _family(module).ARCHITECTURES[name]
    if isinstance(arch, Architecture):
        return arch
    return arch.architecture(hf_config, resolve(hf_config.text_config))


def gguf_family(architecture: str) -> GgufFamily | None:
    """How llama.cpp names the tensors of its `architecture`, or None for one jllm does not
    load."""
    module = GGUF_ARCHITECTURES.get(architecture)
    return None if module is None else _family(module).GGUF[architecture]

"""vLLM's `generation_config`: the model's generation_config.json as the default sampling
parameters of requests that leave them out, and its extra EOS ids.

Read once at start-up; host-side only (transformers' GenerationConfig, no JAX).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("jllm")

# The sampling fields a generation_config.json may set as defaults (vLLM's list).
GENERATION_DEFAULT_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def model_generation_config(source):
    """The model's own generation_config.json (transformers' GenerationConfig), or None: GGUF
    files and directories without one have none. Read once at start-up."""
    if source.kind not in ("hf", "orbax"):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source.path)
    except OSError:
        return None


def generation_defaults(setting: str, model_config) -> dict:
    """vLLM's `generation_config`: "auto" takes the model's own (`model_config`, from
    `model_generation_config`), "vllm" ignores it, anything else names a folder holding a
    generation_config.json. Returns the sampling defaults it sets (max_new_tokens as
    max_tokens), for requests that leave those fields out."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        config = model_config
    else:
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(setting)
        except OSError as e:
            raise ValueError(
                f"generation_config={setting!r} holds no readable generation_config.json: {e}"
            ) from e
    diff = config.to_diff_dict() if config is not None else {}
    defaults = {k: diff[k] for k in GENERATION_DEFAULT_FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        logger.warning(
            "Default sampling parameters have been overridden by the model's Hugging Face "
            "generation config recommended from the model creator: %s. If this is not "
            "intended, relaunch with `--generation-config vllm`.",
            defaults,
        )
    return defaults


def extra_eos_ids(model_config, primary: int | None) -> set[int]:
    """EOS ids from generation_config.json beyond the tokenizer's (vLLM stops on them too)."""
    ids = model_config.eos_token_id if model_config is not None else None
    ids = {ids} if isinstance(ids, int) else set(ids or [])
    return ids - {primary}


def eos_token_id(tokenizer, hf_config) -> int | None:
    """The tokenizer's EOS id, else the model config's (its first when a list)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) else eos
    return eos

"""The seeds' engine flags that vLLM has since renamed, folded into another argument, made
no-ops or removed: each is accepted (mapped onto what replaced it, or ignored with a warning,
as vLLM did) or refused with a message naming the replacement, offline (`LLM(...)` keyword
arguments) and on the command line (a group of its own in `jllm serve --help`).

`LEGACY_FLAGS` is the table: name -> (the command line's type, what happens). Host-side
only: no JAX import.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("jllm")

# The legacy speculative flags -> their field of today's `speculative_config` (vLLM 0.6's
# move to --speculative-config, with its deprecation message).
SPECULATIVE = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
}
RENAMED = {"max_context_len_to_capture": "max_seq_len_to_capture"}
IGNORED = {
    "use_v2_block_manager": "the V2 block manager is the only one (vLLM made the flag a "
    "no-op in 0.6.2 and removed it)",
    "disable_custom_all_reduce": "there is no custom all-reduce: XLA's collectives run the "
    "reductions",
    "max_parallel_loading_workers": "the loader streams one checkpoint file at a time onto "
    "the devices",
    "lora_extra_vocab_size": "vLLM deprecated it in 0.11 and removed it in 0.12 (adapters' "
    "extra vocabularies were phased out); jllm's adapters use the base model's vocabulary",
}
# Accepted when empty (what vLLM's default loader takes too), refused otherwise.
EMPTY_ONLY = {
    "model_loader_extra_config": "jllm's loaders (safetensors, GGUF, orbax, dummy) take no "
    "extra configuration",
}
REFUSED = {
    "engine_use_ray": "vLLM removed Ray engines; jllm runs several hosts on jax.distributed: "
    "use --nnodes, --node-rank and --master-addr",
    "worker_use_ray": "vLLM removed it; jllm runs several hosts on jax.distributed: use "
    "--nnodes, --node-rank and --master-addr",
    "ray_workers_use_nsight": "jllm has no Ray workers; profile with JAX's profiler",
    "tokenizer_pool_size": "vLLM removed the tokenizer pool (V1 tokenizes in the front end); "
    "the server's processor pool is sized by --renderer-num-workers",
    "tokenizer_pool_type": "vLLM removed the tokenizer pool; there is no replacement",
    "tokenizer_pool_extra_config": "vLLM removed the tokenizer pool; there is no replacement",
    "max_paddings": "vLLM removed it with the V1 scheduler; the token budget is "
    "--max-num-batched-tokens",
    "code_revision": "jllm runs no remote model code; --revision picks the checkpoint",
    "scheduler_delay_factor": "vLLM V1 removed the prompt scheduling delay; chunked prefill "
    "and --max-num-batched-tokens shape prefill instead",
    "speculative_max_model_len": "jllm's draft model runs at the engine's --max-model-len",
    "image_processor": "vLLM removed it: a vision model's images go through its own Hugging "
    "Face processor, read from the model's folder; set the processor's options with "
    "--mm-processor-kwargs",
    "image_processor_revision": "vLLM removed it: the processor is read from the model's "
    "folder, at the checkpoint's --revision",
    "disable_image_processor": "vLLM removed it: images always go through the model's "
    "processor (pass PIL images or image_url parts, not pixel values)",
    "long_lora_scaling_factors": "vLLM removed LongLoRA (adapters trained with their own RoPE "
    "scaling) with its V0 engine; there is no replacement",
    "qlora_adapter_name_or_path": "vLLM removed it: serve the adapter as any LoRA adapter, "
    "with --enable-lora and --lora-modules name=path (LoRARequest offline)",
}
# Flags accepted for some values only: name -> (accepted values, the refusal for others).
BY_VALUE = {
    "distributed_executor_backend": (
        ("mp", "uni", "external_launcher"),
        "jllm runs one process per host, joined by jax.distributed (--nnodes); Ray is not "
        "supported",
    ),
    "preemption_mode": (
        ("recompute",),
        "vLLM V1 recomputes preempted requests; swapping became the host KV tier "
        "(--kv-offloading-size)",
    ),
}
LEGACY_FLAGS: dict[str, type] = {
    "speculative_model": str,
    "num_speculative_tokens": int,
    "ngram_prompt_lookup_max": int,
    "ngram_prompt_lookup_min": int,
    "speculative_disable_by_batch_size": int,
    "speculative_draft_tensor_parallel_size": int,
    "speculative_max_model_len": int,
    "max_context_len_to_capture": int,
    "use_v2_block_manager": bool,
    "disable_custom_all_reduce": bool,
    "max_parallel_loading_workers": int,
    "engine_use_ray": bool,
    "worker_use_ray": bool,
    "ray_workers_use_nsight": bool,
    "tokenizer_pool_size": int,
    "tokenizer_pool_type": str,
    "tokenizer_pool_extra_config": str,
    "max_paddings": int,
    "code_revision": str,
    "scheduler_delay_factor": float,
    "distributed_executor_backend": str,
    "preemption_mode": str,
    "model_loader_extra_config": str,
    "image_processor": str,
    "image_processor_revision": str,
    "disable_image_processor": bool,
    "long_lora_scaling_factors": str,
    "lora_extra_vocab_size": int,
    "qlora_adapter_name_or_path": str,
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def apply_legacy(kwargs: dict) -> dict:
    """`kwargs` with the legacy flags set in it (not None) mapped, ignored with a warning,
    or refused (ValueError naming the replacement)."""
    out = {k: v for k, v in kwargs.items() if k not in LEGACY_FLAGS}
    given = {k: v for k, v in kwargs.items() if k in LEGACY_FLAGS and v not in (None, False)}
    for name, value in given.items():
        if name in EMPTY_ONLY:
            if value not in ("", "{}", {}):
                raise ValueError(f"{flag(name)} is not supported: {EMPTY_ONLY[name]}.")
            continue
        if name in REFUSED:
            raise ValueError(f"{flag(name)} is not supported: {REFUSED[name]}.")
        if name in BY_VALUE:
            accepted, why = BY_VALUE[name]
            if value not in accepted:
                raise ValueError(f"{flag(name)} {value!r} is not supported: {why}.")
            logger.warning("%s %s is what jllm does; the flag is ignored.", flag(name), value)
        elif name in IGNORED:
            logger.warning("%s is ignored: %s.", flag(name), IGNORED[name])
        elif name in RENAMED:
            new = RENAMED[name]
            logger.warning("%s is deprecated; use %s.", flag(name), flag(new))
            out[new] = value  # given explicitly: it wins over the default
    speculative = {SPECULATIVE[k]: v for k, v in given.items() if k in SPECULATIVE}
    if speculative:
        if out.get("speculative_config") is not None:
            raise ValueError(
                "Give either --speculative-config or the legacy speculative flags "
                f"({', '.join(flag(k) for k in given if k in SPECULATIVE)}), not both."
            )
        logger.warning(
            "The legacy speculative flags (%s) are deprecated; use --speculative-config "
            "'{...}' (speculative_config=) instead, as vLLM does.",
            ", ".join(flag(k) for k in given if k in SPECULATIVE),
        )
        out["speculative_config"] = speculative
    return out

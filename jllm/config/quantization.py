"""vLLM's `quantization=` method names, checked by name alone (the formats are in
jllm/quantization)."""

from __future__ import annotations

ONLINE_METHODS = ("fp8", "tpu_int8")
# Read from a checkpoint's quantization_config.
CHECKPOINT_METHODS = ("awq", "gptq", "mxfp4")
METHODS = (*ONLINE_METHODS, "gguf", *CHECKPOINT_METHODS)
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}  # vLLM's GPU kernels of the same formats


def check_method(method: str | None) -> None:
    """The method's name alone (EngineArgs): None, one of METHODS or an ALIASES key."""
    if method is None or method in METHODS or method in ALIASES:
        return
    raise ValueError(
        f"quantization must be one of {', '.join((*METHODS, *ALIASES))} or None, got {method!r}."
    )

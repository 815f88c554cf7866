"""Quantized weights: vLLM's `quantization=` methods on jllm's `Linear` seam.

- "fp8": every projection quantized on load to float8_e4m3fn with one scale per output
  channel (vLLM's dynamic fp8 on an unquantized checkpoint); the embedding stays float.
- "tpu_int8": the same with int8 codes, vLLM's name and rule for on-the-fly int8 weight-only
  (a channel's absmax maps to 127).
- "gguf": a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors kept in their quantized form
  (the embedding too, and a tied lm_head reads it); other tensor types are dequantized on
  load as without it.

`resolve_quantization` checks the method against the checkpoint before any weight is read;
`weights.QuantizedWeight` is the in-memory form and `formats` builds it from each format.
Host-side here: no JAX import.
"""

from __future__ import annotations

ONLINE_METHODS = ("fp8", "tpu_int8")
METHODS = (*ONLINE_METHODS, "gguf")
PLANNED = ("awq", "gptq")  # vLLM's names; refused by name until built


def check_method(method: str | None) -> None:
    """The method's name alone (EngineArgs): None or one of METHODS."""
    if method is None or method in METHODS:
        return
    if method in PLANNED:
        raise ValueError(
            f"quantization={method!r} is not supported by jllm yet; supported: "
            f"{', '.join(METHODS)}."
        )
    raise ValueError(f"quantization must be one of {', '.join(METHODS)} or None, got {method!r}.")


def resolve_quantization(method: str | None, source) -> str | None:
    """The method to load `source` (a model_loader.ModelSource) with, or a ValueError saying
    why the checkpoint contradicts it."""
    check_method(method)
    if method is None:
        return None
    if source.kind == "gguf":
        if method != "gguf":
            raise ValueError(
                f"{source.path} is a GGUF file, whose weights are already quantized; use "
                f"quantization='gguf' (keep them quantized) or leave it unset (dequantize on "
                f"load), not {method!r}."
            )
        return method
    if method == "gguf":
        raise ValueError(
            f"quantization='gguf' needs a .gguf model file; {source.path} is a Hugging Face "
            "checkpoint (use 'fp8' or 'tpu_int8' to quantize it on load)."
        )
    return method

"""Quantized weights: vLLM's `quantization=` methods on jllm's `Linear` seam.

- "fp8": every projection quantized on load to float8_e4m3fn with one scale per output
  channel (vLLM's dynamic fp8 on an unquantized checkpoint); the embedding stays float.
- "tpu_int8": the same with int8 codes, vLLM's name and rule for on-the-fly int8 weight-only
  (a channel's absmax maps to 127).
- "gguf": a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors kept in their quantized form
  (the embedding too, and a tied lm_head reads it); other tensor types are dequantized on
  load as without it.
- "awq", "gptq": 4-bit (GPTQ: and 8-bit) checkpoints with group-wise scales and zero points,
  detected from the checkpoint's `quantization_config` as vLLM does (checkpoints.py). vLLM's
  GPU kernel names for them, "awq_marlin" and "gptq_marlin", are accepted as aliases.
- "mxfp4": gpt-oss's released checkpoints, whose experts are OCP MXFP4 (`*_blocks` and
  `*_scales`, mxfp4.py), kept in 4 bits; the rest of the checkpoint is bf16.

`resolve_quantization` checks the method against the checkpoint before any weight is read;
`weights.QuantizedWeight` is the in-memory form and `formats` builds it from each format.
Host-side here: no JAX import.
"""

from __future__ import annotations

from jllm.config.quantization import (  # noqa: F401 (re-exported)
    ALIASES,
    CHECKPOINT_METHODS,
    METHODS,
    ONLINE_METHODS,
    check_method,
)


def resolve_quantization(method: str | None, source) -> str | None:
    """The method to load `source` (a model_loader.ModelSource) with, or a ValueError saying
    why the checkpoint contradicts it."""
    check_method(method)
    given, method = method, ALIASES.get(method, method)
    stored = getattr(source, "checkpoint_quantization", None)
    if stored is not None:  # vLLM: the checkpoint's method unless the user names another
        if method not in (None, stored.method):
            raise ValueError(
                f"Quantization method specified in the model config ({stored.method}) does "
                f"not match the quantization method specified in the `quantization` argument "
                f"({given})."
            )
        return stored.method
    if method in CHECKPOINT_METHODS:
        article = {"awq": "an AWQ", "gptq": "a GPTQ", "mxfp4": "an MXFP4"}[method]
        raise ValueError(
            f"quantization={method!r} needs {article} checkpoint (a config.json with "
            f"a quantization_config whose quant_method is {method!r}); {source.path} has none."
        )
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

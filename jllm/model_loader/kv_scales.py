"""Per-layer KV-cache scales for the float8 KV cache: where they come from, and their checks.

A float8_e4m3fn cache holds magnitudes up to 448; a layer whose keys or values reach past it
saturates. With a layer's scales the cache stores k / k_scale and v / v_scale and attention
reads them back times the scale (vLLM's convention: stored value x scale ~ true value).
`models/context.py` applies them around every attention backend; the model holds them as a
scalar pair per layer (`self_attn.k_scale`, `self_attn.v_scale`), stacked with the layer's
weights. They come from two places, as in vLLM:

- the checkpoint's tensors, `model.layers.N.self_attn.k_scale` / `v_scale` (llm-compressor's
  names), ModelOpt's `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`, or the
  deprecated `self_attn.kv_scale` (one factor for both), read with the weights
  (`model_loader/loader.py`) for any float8 cache and ignored with `kv_cache_dtype="auto"`;
- vLLM's `quantization_param_path`: a JSON file (vLLM's `QuantParamSchema`) holding one factor
  per tensor-parallel rank and layer, which vLLM applied to both k and v:
  `{"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor":
  {"0": {"0": 0.0213, "1": 0.0187}}}}`. It is checked as vLLM checked it (the model type,
  the tensor-parallel size, every layer, the dtype), refused with the reason where vLLM
  logged an error and fell back to 1.0, and read for an e4m3 cache only (`fp8`,
  `fp8_e4m3`; with another `kv_cache_dtype` it is ignored with vLLM's warning). It wins over
  the checkpoint's scales. vLLM kept one factor per rank; jllm's are per layer, so the ranks
  must agree.

A model given neither has no scale variables at all and compiles as it did without them.
Host-side: no JAX import.
"""

from __future__ import annotations

import json
import logging
import math
import re

import numpy as np

from jllm.model_loader.safetensors_io import read_header

logger = logging.getLogger("jllm")

_SCALE = re.compile(
    r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale)"
)
_PARTS = {
    "k_scale": ("k",),
    "v_scale": ("v",),
    "kv_scale": ("k", "v"),
    "k_proj.k_scale": ("k",),
    "v_proj.v_scale": ("v",),
}
# The kv_cache_dtype values whose cache is float8_e4m3fn, what vLLM's JSON scales are for.
E4M3_CACHES = ("fp8", "fp8_e4m3")


def scale_tensor(name: str) -> tuple[int, tuple[str, ...]] | None:
    """A checkpoint tensor's (layer, the scales it sets: "k", "v" or both) when it is a
    KV-cache scale (in transformers' text-model names), else None."""
    m = _SCALE.fullmatch(name)
    return None if m is None else (int(m.group(1)), _PARTS[m.group(2)])


def checkpoint_scale(name: str, w) -> float:
    """The factor a checkpoint's scale tensor holds: one positive number (a scalar or [1])."""
    w = np.asarray(w, np.float32)
    if w.size != 1:
        raise ValueError(
            f"Checkpoint tensor {name} holds {w.size} KV-cache scales (shape {w.shape}); jllm "
            "reads one scale per layer for k and one for v (per-head scales are not supported)."
        )
    return _factor(float(w.reshape(())), f"Checkpoint tensor {name}")


def checkpoint_has_kv_scales(source, rename=lambda name: name) -> bool:
    """Whether a safetensors checkpoint names KV-cache scales (read from the files' headers;
    `rename`: the architecture's checkpoint name -> text-model name, None for unused)."""
    if source.kind != "hf":  # GGUF files and jllm's converted checkpoints carry none
        return False
    for path in source.weight_files:
        for entry in read_header(path):
            name = rename(entry.name)
            if name is not None and scale_tensor(name) is not None:
                return True
    return False


def resolve_kv_scales(args, source, num_layers: int, rename=lambda name: name):
    """-> (whether the model carries per-layer scales, the file's {layer: factor} or None)
    for the engine arguments `args` (its `kv_cache_dtype` and `quantization_param_path`)."""
    path, cache = args.quantization_param_path, args.kv_cache_dtype
    from_file = None
    if path is not None and cache not in E4M3_CACHES:
        logger.warning(
            "KV cache scaling factors provided (quantization_param_path %s), but the KV cache "
            "data type is %r, not fp8 (float8_e4m3fn): the scaling factors will not be used.",
            path,
            cache,
        )
    elif path is not None:
        hf = source.hf_config
        text = getattr(hf, "text_config", None)
        types = (hf.model_type, getattr(text, "model_type", hf.model_type))
        from_file = read_kv_cache_scales(
            path, model_types=types, num_layers=num_layers, tp_size=args.tensor_parallel_size
        )
        logger.warning(
            "Loading KV cache scaling factors from a JSON file (%s) is deprecated in vLLM: "
            "checkpoints carry them as self_attn.k_scale / v_scale tensors, which jllm reads "
            "too.",
            path,
        )
    in_checkpoint = cache != "auto" and checkpoint_has_kv_scales(source, rename)
    return from_file is not None or in_checkpoint, from_file


def read_kv_cache_scales(
    path: str, *, model_types: tuple[str, ...], num_layers: int, tp_size: int
) -> dict[int, float]:
    """vLLM's quantization parameter JSON at `path` -> {layer: factor} for every layer of a
    model of `model_types` (its config's model_type, and its text model's) served on
    `tp_size` devices; ValueError naming what does not fit. Read as JSON only."""
    where = f"quantization_param_path {path!r}"
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"{where} cannot be read: {e.strerror or e}.") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}.") from e
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    if not isinstance(kv, dict) or not isinstance(kv.get("scaling_factor"), dict):
        raise ValueError(
            f"{where} is not vLLM's quantization parameter file: it needs a 'model_type' and "
            "a 'kv_cache' object with 'dtype' and 'scaling_factor' ({tp_rank: {layer: "
            "scale}})."
        )
    if kv.get("dtype") != "float8_e4m3fn":
        raise ValueError(
            f"{where} holds scaling factors for KV cache dtype {kv.get('dtype')!r} rather "
            "than float8_e4m3fn, the only one vLLM's format has."
        )
    if doc.get("model_type") not in model_types:
        raise ValueError(
            f"{where} holds scaling factors for model type {doc.get('model_type')!r}, but the "
            f"model is of type {model_types[0]!r}."
        )
    ranks = _int_keys(kv["scaling_factor"], f"{where}: scaling_factor")
    if sorted(ranks) != list(range(tp_size)):
        raise ValueError(
            f"{where} holds scaling factors for tensor-parallel ranks {sorted(ranks)} (TP size "
            f"{len(ranks)}), but the engine runs with tensor_parallel_size={tp_size} (ranks "
            f"0-{tp_size - 1})."
        )
    per_rank = {}
    for rank, layers in sorted(ranks.items()):
        layers = _int_keys(layers, f"{where}: TP rank {rank}")
        missing = sorted(set(range(num_layers)) - set(layers))
        if missing:
            raise ValueError(
                f"{where} lacks KV cache scaling factors for layers {missing} in TP rank "
                f"{rank}; the model has {num_layers} layers."
            )
        extra = sorted(set(layers) - set(range(num_layers)))
        if extra:
            raise ValueError(
                f"{where} has scaling factors for layers {extra} in TP rank {rank}, but the "
                f"model has {num_layers} layers (0-{num_layers - 1})."
            )
        per_rank[rank] = {
            i: _factor(v, f"{where}: layer {i} of TP rank {rank}") for i, v in layers.items()
        }
    scales = per_rank[0]
    for rank, layers in per_rank.items():
        differ = [i for i in range(num_layers) if layers[i] != scales[i]]
        if differ:
            raise ValueError(
                f"{where}: TP rank {rank}'s scaling factors differ from rank 0's for layers "
                f"{differ}. jllm keeps one scale per layer for the whole cache (every device "
                "holds some of its kv heads): give every rank the same factors."
            )
    return scales


def _int_keys(mapping, where: str) -> dict[int, object]:
    """A JSON object whose keys are integers (as strings) -> {int: value}."""
    if not isinstance(mapping, dict):
        raise ValueError(f"{where} must be an object, got {type(mapping).__name__}.")
    out = {}
    for key, value in mapping.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"{where} has the key {key!r}, not an integer.") from None
    return out


def _factor(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} is {value!r}, not a number.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where} is {value}; a KV-cache scale must be a positive number.")
    return float(value)

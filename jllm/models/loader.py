"""Build a model abstractly and put each checkpoint weight straight onto its sharding.

The model is created with `nnx.eval_shape` (no memory), then every Hugging Face tensor is
converted to our layout on the host and placed with `jax.device_put` on the sharding its
logical axes map to; nothing is materialised twice on a device.
"""

from __future__ import annotations

import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.models.llama import LlamaConfig, LlamaForCausalLM
from sharding import named_sharding

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

# Hugging Face name within a layer -> (path in our layer, conversion from the [out, in] layout)
_LAYER_MAP = {
    "self_attn.q_proj.weight": (("attn", "wq"), "qkv"),
    "self_attn.k_proj.weight": (("attn", "wk"), "qkv"),
    "self_attn.v_proj.weight": (("attn", "wv"), "qkv"),
    "self_attn.o_proj.weight": (("attn", "wo"), "o"),
    "self_attn.q_proj.bias": (("attn", "bq"), "bias"),
    "self_attn.k_proj.bias": (("attn", "bk"), "bias"),
    "self_attn.v_proj.bias": (("attn", "bv"), "bias"),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), "t"),
    "mlp.up_proj.weight": (("mlp", "w_up"), "t"),
    "mlp.down_proj.weight": (("mlp", "w_down"), "t"),
    "input_layernorm.weight": (("input_norm", "weight"), None),
    "post_attention_layernorm.weight": (("post_attn_norm", "weight"), None),
}
_KV_WEIGHTS = ("wk", "wv", "bk", "bv")
_TOP_MAP = {
    "model.embed_tokens.weight": (("embed",), None),
    "model.norm.weight": (("norm", "weight"), None),
    "lm_head.weight": (("lm_head",), "t"),
}


def _convert(w: np.ndarray, kind: str | None, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "qkv":  # [N*H, D] -> [D, N, H]
        return w.T.reshape(shape)
    if kind == "o":  # [D, N*H] -> [N, H, D]
        return w.T.reshape(shape)
    if kind == "bias":  # [N*H] -> [N, H]
        return w.reshape(shape)
    if kind == "t":
        return w.T
    return w


def _map_name(name: str):
    """-> (our parameter path, layer index or None, conversion kind), or None to skip."""
    m = _LAYER.fullmatch(name)
    if m:
        entry = _LAYER_MAP.get(m.group(2))
        if entry is None:
            return None
        return ("layers", *entry[0]), int(m.group(1)), entry[1]
    entry = _TOP_MAP.get(name)
    return None if entry is None else (entry[0], None, entry[1])


def _axes(var) -> tuple:
    """Logical axes of a parameter; stacked layer weights get a leading "layers" axis."""
    axes = tuple(var.get_metadata()["logical_axes"])
    return ("layers", *axes) if len(axes) < len(var.shape) else axes


def _place(host: np.ndarray, sharding) -> jax.Array:
    """Host array -> device array on `sharding`, each device receiving only its own shard
    (and, with several processes, each process filling only its own devices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def abstract_model(cfg: LlamaConfig, dtype) -> LlamaForCausalLM:
    return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype, nnx.Rngs(0)))


def load_model(
    cfg: LlamaConfig,
    source,
    dtype,
    mesh,
    load_format: str = "auto",
    seed: int = 0,
    kv_replicas: int = 1,
):
    """Returns (graphdef, state) with every parameter on its target sharding.

    `cfg.num_kv_heads` is the model's count times `kv_replicas`: with fewer kv heads than
    devices each checkpoint kv head is repeated (sharding.kv_head_replicas), so that query
    head h still reads kv head h // (num_heads // num_kv_heads)."""
    start = time.perf_counter()
    model = abstract_model(cfg, dtype)
    graphdef, abstract_state = nnx.split(model)
    flat = dict(nnx.to_flat_state(abstract_state))
    shardings = {path: named_sharding(mesh, _axes(var), var.shape) for path, var in flat.items()}
    values: dict[tuple, jax.Array] = {}
    if load_format == "dummy":
        rng = np.random.default_rng(seed)
        for path, var in flat.items():
            if path[-1] == "weight":  # norms
                host = np.ones(var.shape, np.float32)
            else:
                host = rng.normal(0.0, 0.02, var.shape).astype(np.float32)
            values[path] = _place(host.astype(dtype), shardings[path])
    else:
        layered: dict[tuple, dict[int, np.ndarray]] = {}
        for name, w in source.iter_weights():
            mapped = _map_name(name)
            if mapped is None:
                continue
            path, layer, kind = mapped
            if path not in flat:
                if path == ("lm_head",) and cfg.tie_word_embeddings:
                    continue
                raise ValueError(f"Checkpoint tensor {name} has no place in the model.")
            shape = flat[path].shape[1:] if layer is not None else flat[path].shape
            replicate = kv_replicas > 1 and path[-1] in _KV_WEIGHTS
            if replicate:  # kv-head axis is the one before head_dim
                shape = (*shape[:-2], shape[-2] // kv_replicas, shape[-1])
            host = _convert(np.asarray(w), kind, shape)
            if host.shape != shape:
                raise ValueError(
                    f"Checkpoint tensor {name} has shape {w.shape}, expected one that maps "
                    f"to {shape}."
                )
            if replicate:
                host = np.repeat(host, kv_replicas, axis=-2)
            if layer is None:
                values[path] = _place(host.astype(dtype), shardings[path])
            else:
                layered.setdefault(path, {})[layer] = host.astype(dtype)
                if len(layered[path]) == cfg.num_layers:
                    stacked = np.stack([layered[path][i] for i in range(cfg.num_layers)])
                    values[path] = _place(stacked, shardings[path])
                    del layered[path]
        missing = [".".join(map(str, p)) for p in flat if p not in values]
        if missing:
            raise ValueError(f"The checkpoint lacks weights for: {', '.join(missing[:8])}.")
    for path, var in flat.items():
        var.set_value(values[path])
    state = nnx.from_flat_state(flat)
    nbytes = sum(v.size * v.dtype.itemsize for v in values.values())
    logger.info(
        "Loading weights took %.2f seconds; %.3f GiB in %s.",
        time.perf_counter() - start,
        nbytes / 2**30,
        jnp.dtype(dtype).name,
    )
    return graphdef, state

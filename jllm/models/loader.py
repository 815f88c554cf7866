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

from jllm.models.registry import IGNORED, Architecture
from sharding import named_sharding

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Weights with a kv-head axis (repeated when there are fewer kv heads than devices).
_KV_PROJ = ("k_proj", "v_proj")


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


def _map_name(name: str, layer_weights: dict, top_weights: dict):
    """-> (our parameter path, layer index or None, conversion kind), or None when the
    architecture does not name the tensor."""
    m = _LAYER.fullmatch(name)
    if m:
        if m.group(2) not in layer_weights:
            return None
        return ("layers", *m.group(2).split(".")), int(m.group(1)), layer_weights[m.group(2)]
    if name not in top_weights:
        return None
    path, kind = top_weights[name]
    return path, None, kind


def _axes(var) -> tuple:
    """Logical axes of a parameter; stacked layer weights get a leading "layers" axis."""
    axes = tuple(var.get_metadata()["logical_axes"])
    return ("layers", *axes) if len(axes) < len(var.shape) else axes


def _place(host: np.ndarray, sharding) -> jax.Array:
    """Host array -> device array on `sharding`, each device receiving only its own shard
    (and, with several processes, each process filling only its own devices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _dummy(key, shape, dtype, norm: bool, sharding) -> jax.Array:
    """A random weight N(0, 0.02) (ones for a norm), drawn on its devices: an 8B model's
    weights take seconds there, minutes drawn on the host."""

    def draw(key):
        if norm:
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)(key)


def abstract_model(arch: Architecture, cfg, dtype):
    return nnx.eval_shape(lambda: arch.module(cfg, dtype, nnx.Rngs(0)))


def load_model(
    arch: Architecture,
    cfg,
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
    model = abstract_model(arch, cfg, dtype)
    graphdef, abstract_state = nnx.split(model)
    flat = dict(nnx.to_flat_state(abstract_state))
    shardings = {path: named_sharding(mesh, _axes(var), var.shape) for path, var in flat.items()}
    values: dict[tuple, jax.Array] = {}
    if load_format == "dummy":
        key = jax.random.key(seed)
        for i, (path, var) in enumerate(flat.items()):
            norm = len(path) > 1 and "norm" in path[-2]
            values[path] = _dummy(
                jax.random.fold_in(key, i), var.shape, dtype, norm, shardings[path]
            )
    else:
        layered: dict[tuple, dict[int, np.ndarray]] = {}
        layer_weights = arch.layer_weights(cfg)
        for name, w in source.iter_weights():
            if IGNORED.fullmatch(name):
                continue
            mapped = _map_name(name, layer_weights, arch.top_weights)
            if mapped is None:
                raise ValueError(
                    f"Checkpoint tensor {name} is not used by jllm's {arch.name} with this "
                    "config; refusing to load the model without it."
                )
            path, layer, kind = mapped
            if path not in flat:
                if path == ("lm_head", "weight") and cfg.tie_word_embeddings:
                    continue
                raise ValueError(f"Checkpoint tensor {name} has no place in the model.")
            shape = flat[path].shape[1:] if layer is not None else flat[path].shape
            replicate = kv_replicas > 1 and len(path) > 1 and path[-2] in _KV_PROJ
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

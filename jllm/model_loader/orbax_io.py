"""jllm's own checkpoints: the engine's parameter pytree saved with orbax (`jllm convert`),
restored straight into the mesh's shardings (each process reads only its shards).

A converted folder holds `params/` (orbax: every parameter as the engine stores it, stacked
layers and quantized weights included: a `QuantizedWeight` as its codes, scale and offset),
the model's `config.json`, its tokenizer (and processor) files, and `jllm_checkpoint.json`:
the format and its version, the jllm version, the architecture, dtype, quantization and the
kv-head replication it was converted at (`sharding.kv_head_replicas`, set by the tensor
parallel size when there are fewer kv heads than devices). A checkpoint of another format
version, architecture or replication is refused with both sides named.
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from jllm.quantization.weights import QuantizedWeight
from jllm.version import __version__ as JLLM_VERSION

META = "jllm_checkpoint.json"
FORMAT = "jllm-orbax"
VERSION = 1
_PARTS = ("codes", "scale", "offset")


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{path} is a {meta.get('format')!r} checkpoint of version {meta.get('version')!r} "
            f"(jllm {meta.get('jllm_version')}); this jllm ({JLLM_VERSION}) reads "
            f"{FORMAT!r} version {VERSION}. Convert the model again with this jllm."
        )
    return meta


def _key(path: tuple) -> str:
    return ".".join(map(str, path))


def _nested(flat: dict) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}} (orbax stores a tree of dicts)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        out.update(_flat(v, name) if isinstance(v, dict) else {name: v})
    return out


def save(out: str, state, meta: dict) -> None:
    """Save the engine's parameters (`state`, an nnx State) and `meta` under `out`."""
    import orbax.checkpoint as ocp

    arrays, quantized = {}, {}
    for path, var in nnx.to_flat_state(state):
        value, key = var.get_value(), _key(path)
        if isinstance(value, QuantizedWeight):
            quantized[key] = {"kind": value.kind, "pack": value.pack}
            for part in _PARTS:
                if getattr(value, part) is not None:
                    arrays[f"{key}.{part}"] = getattr(value, part)
        else:
            arrays[key] = value
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(out, "params")), _nested(arrays), force=True)
    checkpointer.wait_until_finished()
    meta = {"format": FORMAT, "version": VERSION, "jllm_version": JLLM_VERSION, **meta}
    meta["quantized"] = quantized
    with open(os.path.join(out, META), "w") as f:
        json.dump(meta, f, indent=1)


def check(meta: dict, path: str, **engine) -> None:
    """Refuse a checkpoint converted for another architecture or kv-head replication."""
    for name, value in engine.items():
        if meta.get(name) != value:
            raise ValueError(
                f"{path} was converted with {name}={meta.get(name)!r}; this engine needs "
                f"{name}={value!r}. Convert the model again with the engine's settings (for "
                "kv_replicas: the same --tensor-parallel-size relative to the kv heads)."
            )


def restore(path: str, meta: dict, flat: dict, shardings: dict, quantized_sharding) -> dict:
    """Every parameter restored onto its sharding: path -> array or QuantizedWeight.
    `flat`: the abstract model's parameters; `shardings`: path -> NamedSharding;
    `quantized_sharding(path, shape)`: the sharding of a quantized weight's array."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    directory = os.path.abspath(os.path.join(path, "params"))
    stored = _flat(checkpointer.metadata(directory).item_metadata.tree)
    quantized = meta.get("quantized", {})
    target = {}
    for p, var in flat.items():
        key = _key(p)
        if key in quantized:
            for part in _PARTS:
                m = stored.get(f"{key}.{part}")
                if m is not None:
                    sharding = quantized_sharding(p, tuple(m.shape))
                    target[f"{key}.{part}"] = jax.ShapeDtypeStruct(
                        m.shape, m.dtype, sharding=sharding
                    )
            continue
        m = stored.get(key)
        if m is None or tuple(m.shape) != tuple(var.shape):
            found = None if m is None else tuple(m.shape)
            raise ValueError(
                f"{path} has {key} of shape {found}; this model needs {tuple(var.shape)}."
            )
        target[key] = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[p])
    extra = sorted(set(stored) - set(target))
    if extra:
        raise ValueError(f"{path} holds parameters this model lacks: {', '.join(extra[:8])}.")
    arrays = _flat(checkpointer.restore(directory, _nested(target)))
    values = {}
    for p in flat:
        key = _key(p)
        if key in quantized:
            parts = [arrays.get(f"{key}.{part}") for part in _PARTS]
            values[p] = QuantizedWeight(*parts, quantized[key]["kind"], quantized[key]["pack"])
        else:
            values[p] = arrays[key]
    return values

"""Mesh axes and the logical-axis rules that place weights and KV cache on them.

The mesh has two named axes, `data` and `model`. Layers annotate every weight with logical
axis names where it is created (`logical_axes=` metadata on `nnx.Param`); `LOGICAL_RULES`
maps each logical name to a mesh axis (or None: replicated). Only this module knows the
mapping, so tensor parallelism changes here and nowhere else.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"

LOGICAL_RULES: dict[str, str | None] = {
    "layers": None,
    "vocab": MODEL_AXIS,
    "embed": None,
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
    "mlp": MODEL_AXIS,
    "norm": None,
    # KV cache [L, B, S, 2K, H]
    "cache_blocks": None,
    "cache_slots": None,
    "cache_kv_heads": MODEL_AXIS,
}


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} "
            "available devices."
        )
    grid = np.array(devices[:tensor_parallel_size]).reshape(1, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def partition_spec(logical_axes: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(LOGICAL_RULES.get(a) if a else None for a in logical_axes))


def named_sharding(mesh: Mesh, logical_axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes))

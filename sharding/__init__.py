"""Mesh axes and the logical-axis rules that place weights and KV cache on them.

The mesh has three named axes, `data`, `stage` and `model`. Layers annotate every weight with
logical axis names where it is created (`logical_axes=` metadata on `nnx.Param`);
`LOGICAL_RULES` maps each logical name to a mesh axis (or None: replicated). Only this
module knows the mapping, so tensor parallelism changes here and nowhere else.

Data parallelism splits the KV cache's blocks over `data` (`cache_blocks`): each data shard
holds its own slice of blocks and serves its own requests (`jllm/runner/data_parallel.py`);
weights are replicated over it. With one shard the axis has size 1 and places nothing.

Pipeline parallelism splits the stacked layer axis (`layers`: every layer stack's weights
and every KV-cache group's rows) over `stage`: stage s holds the s-th run of consecutive
layers on its own devices (`models/pipeline.py` runs them). With one stage the axis has size
1 and places nothing.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
STAGE_AXIS = "stage"
MODEL_AXIS = "model"

logger = logging.getLogger("jllm")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": STAGE_AXIS,
    "vocab": MODEL_AXIS,
    "embed": None,
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
    "mlp": MODEL_AXIS,
    "experts": None,  # tensor parallelism splits each expert's "mlp" axis
    # Expert parallelism: whole experts per device, over the data shards' devices too (a
    # data shard's tokens travel to the experts: models/moe.py). An axis of size 1 in a
    # tuple is left out, so without data parallelism this is "model" alone.
    "experts_split": (DATA_AXIS, MODEL_AXIS),
    "norm": None,
    # LoRA slot arrays [L, S, *in, R] and [L, S, R, *out] (jllm/lora/layers.py)
    "lora_slots": None,
    "lora_rank": None,
    # with fully_sharded_loras: A's rank of a column-parallel projection, B's output of a
    # row-parallel one
    "lora_rank_split": MODEL_AXIS,
    "lora_out_split": MODEL_AXIS,
    # KV cache [L, B, S, 2K, H]
    "cache_blocks": DATA_AXIS,  # each data shard's own blocks
    "cache_slots": None,
    "cache_kv_heads": MODEL_AXIS,
}


def make_mesh(
    tensor_parallel_size: int = 1,
    devices=None,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
) -> Mesh:
    """The first DP x PP x TP devices as (DP, PP, TP): data shard d gets devices
    [d PP TP, (d + 1) PP TP), and within it stage s devices [s TP, (s + 1) TP), so that with
    one process per host and TP devices each, a stage is a host."""
    devices = list(devices if devices is not None else jax.devices())
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    if dp * tp * pp > len(devices):
        raise ValueError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} x pipeline_parallel_size="
            f"{pp} exceeds the {len(devices)} available devices."
        )
    grid = np.array(devices[: dp * tp * pp]).reshape(dp, pp, tp)
    return Mesh(grid, (DATA_AXIS, STAGE_AXIS, MODEL_AXIS))


# Logical axes left whole where their mesh axis does not divide them: a vocabulary (49153
# over 2; the logits and the embedding are then replicated over `model`, where vLLM pads).
UNEVEN_REPLICATED = frozenset({"vocab"})

_warned: set = set()


def partition_spec(
    logical_axes: tuple[str | None, ...],
    shape: tuple[int, ...] | None = None,
    mesh=None,
    name: str | None = None,
    replicate_uneven: bool = False,
) -> PartitionSpec:
    """The mesh axes of `logical_axes`. Given the array's shape and mesh, a dimension its
    mesh axis does not divide is replicated when it is a vocabulary (`UNEVEN_REPLICATED`),
    has size 1 (a broadcast axis, e.g. a per-channel scale's input axis) or the caller
    allows it (`replicate_uneven`: a block-quantized weight's scales, whose group count need
    not divide the devices); any other is an error naming the array (`name`), never a
    silent copy of it on every device. An unnamed array's is replicated with a warning: the
    callers that do not name their arrays yet."""
    spec = []
    for i, logical in enumerate(logical_axes):
        axis = LOGICAL_RULES.get(logical) if logical else None
        if isinstance(axis, tuple):  # several mesh axes: those of size > 1 (else the last)
            kept = () if mesh is None else tuple(a for a in axis if mesh.shape.get(a, 1) > 1)
            kept = kept or axis[-1:]
            axis = kept[0] if len(kept) == 1 else kept
        if axis is not None and mesh is not None and not _in_mesh(axis, mesh):
            axis = None  # a mesh without that axis (e.g. a test's 1-D mesh)
        if axis is not None and shape is not None and shape[i] % _size(axis, mesh):
            _uneven(logical_axes, shape, i, _size(axis, mesh), axis, name, replicate_uneven)
            axis = None
        spec.append(axis)
    return PartitionSpec(*spec)


def _in_mesh(axis, mesh) -> bool:
    return all(a in mesh.shape for a in (axis if isinstance(axis, tuple) else (axis,)))


def _size(axis, mesh) -> int:
    """Devices along a mesh axis, or along several (their product)."""
    return int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))


def _uneven(logical_axes, shape, i, devices, axis, name, replicate_uneven) -> None:
    """Check that dimension `i` may be replicated over `axis`, which does not divide it."""
    if logical_axes[i] in UNEVEN_REPLICATED or shape[i] == 1 or replicate_uneven:
        return
    what = (
        f"its {logical_axes[i]!r} dimension (size {shape[i]}, of shape {tuple(shape)}) does "
        f"not split over the {devices} devices of the mesh's {axis!r} axis"
    )
    if name is None:
        key = (tuple(logical_axes), tuple(shape), axis)
        if key not in _warned:
            _warned.add(key)
            logger.warning("An array of logical axes %s: %s; it is replicated.", key[0], what)
        return
    raise ValueError(
        f"{name}: {what} (tensor_parallel_size / pipeline_parallel_size); choose a size "
        "that divides it."
    )


def param_axes(var) -> tuple[str | None, ...]:
    """A parameter's logical axes (its `logical_axes` metadata); a stacked layer weight has
    one more dimension than its layer's names, the leading `layers` axis."""
    axes = tuple(var.get_metadata()["logical_axes"])
    return ("layers", *axes) if len(axes) < len(var.shape) else axes


def named_sharding(
    mesh: Mesh,
    logical_axes: tuple[str | None, ...],
    shape: tuple[int, ...] | None = None,
    name: str | None = None,
    replicate_uneven: bool = False,
) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, shape, mesh, name, replicate_uneven))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def kv_head_replicas(num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> int:
    """vLLM's tensor-parallel rules for attention heads. Query heads must divide evenly over
    the devices. KV heads too when there are at least as many as devices; when there are
    fewer, each is replicated so that every device holds one (returns the factor)."""
    tp = tensor_parallel_size
    if num_heads % tp:
        raise ValueError(
            f"Total number of attention heads ({num_heads}) must be divisible by tensor "
            f"parallel size ({tp})."
        )
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(
                f"Total number of key/value heads ({num_kv_heads}) must be divisible by "
                f"tensor parallel size ({tp})."
            )
        return 1
    if tp % num_kv_heads:
        raise ValueError(
            f"Tensor parallel size ({tp}) must be a multiple of the number of key/value "
            f"heads ({num_kv_heads}) when it is larger."
        )
    return tp // num_kv_heads

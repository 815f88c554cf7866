"""Multi-LoRA on the model's side: installing the stacked slot arrays into a loaded model.

`with_lora_slots` gives every projection of the decoder layers its zeroed `lora_a` and
`lora_b` slot arrays (their layout and the delta they feed: jllm/lora/layers.py), placed on
the shardings their logical axes name, and returns the `LoraSpec` the engine keeps: the
projections an adapter may target and the model layers of each stacked layer module.

It lives in models, not in jllm/lora/, because it is about a model: it walks the decoder's
layer stacks and their `Linear` projections. The lora package (the slot arrays' types, the
delta `Linear` calls, PEFT adapters) needs no model and sits below: this module imports it,
never the reverse.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.lora.layers import LoraA, LoraB, LoraSpec
from jllm.lora.peft import LoraTarget
from jllm.models.layers import Linear
from sharding import LOGICAL_RULES, MODEL_AXIS, named_sharding, param_axes

logger = logging.getLogger(__name__)


def _stacks(model) -> list[tuple[tuple, object]]:
    """The decoder's stacked layer modules: (path, module), one per kind of layer."""
    if model.uniform:
        return [(("layers",), model.layers)]
    return [
        (("blocks", s, j), module)
        for s, block in enumerate(model.blocks)
        for j, module in enumerate(block)
    ]


def _linears(module):
    for path, node in nnx.iter_graph(module):
        if isinstance(node, Linear):
            yield tuple(str(p) for p in path), node


def _split(axes) -> bool:
    """Whether any of these logical axes is split over the devices (tensor parallelism)."""
    return any(LOGICAL_RULES.get(a) == MODEL_AXIS for a in axes)


def add_lora_slots(
    model, max_loras: int, max_rank: int, dtype, kv_replicas: int = 1, fully_sharded=False
):
    """Adds zeroed slot arrays to every projection of the decoder layers; returns the
    targets an adapter may name: {module name: LoraTarget}. Under tensor parallelism B of a
    column-parallel projection splits on its output and A of a row-parallel one on its
    input, as the weight does; `fully_sharded` (vLLM's `fully_sharded_loras`) also splits
    the other half: A of a column-parallel projection on its rank, B of a row-parallel one
    on its output (XLA gathers the rank-sized x @ A, or the output, as the layouts need)."""
    found: dict[str, set[LoraTarget]] = {}
    linears = [item for _, stack in _stacks(model) for item in _linears(stack)]
    for path, linear in linears:
        name = path[-1]
        replicas = kv_replicas if name in ("k_proj", "v_proj") else 1
        target = LoraTarget(path, tuple(linear.in_shape), tuple(linear.out_shape), replicas)
        found.setdefault(name, set()).add(target)
    # A name on projections of different shapes or places (Llama 4's dense MLP's and shared
    # expert's down_proj) is no target: an adapter naming it is refused by name on load.
    targets = {name: next(iter(t)) for name, t in found.items() if len(t) == 1}
    for name in sorted(set(found) - set(targets)):
        places = sorted(".".join(t.path) for t in found[name])
        logger.info("LoRA: %s is no adapter target (it names %s).", name, ", ".join(places))
    for path, linear in linears:
        if path[-1] not in targets:
            continue
        weight = linear.weight.get_value()
        count = weight.shape[0]
        in_shape, out_shape = linear.in_shape, linear.out_shape
        axes = tuple(linear.weight.get_metadata()["logical_axes"])
        in_axes, out_axes = axes[: linear.contract], axes[linear.contract :]
        rank_axis = "lora_rank"
        if fully_sharded and _split(out_axes):
            rank_axis = "lora_rank_split"
        elif fully_sharded and _split(in_axes):
            out_axes = (*out_axes[:-1], "lora_out_split")
        a_shape = (count, max_loras, *in_shape, max_rank)
        b_shape = (count, max_loras, max_rank, *out_shape)
        linear.lora_a = LoraA(
            jnp.zeros(a_shape, dtype), logical_axes=("lora_slots", *in_axes, rank_axis)
        )
        linear.lora_b = LoraB(
            jnp.zeros(b_shape, dtype), logical_axes=("lora_slots", "lora_rank", *out_axes)
        )
    return targets


def stack_layers(model) -> dict[tuple, list[int]]:
    """Per stacked layer module (its state path prefix), the model's layer indices in stack
    order: an adapter's [num_layers, ...] arrays are taken in that order for it (a row that
    pads unequal pipeline stages takes a real row's layer: it never runs)."""
    out: dict[tuple, dict[int, int]] = {}
    for i in range(model.cfg.num_layers):
        prefix, index = model.layer_slot(i)
        out.setdefault(tuple(prefix), {})[index] = i
    for prefix, rows in out.items():  # empty slots of pipeline stages copy a real one
        for row, source in model.stack_padding(prefix).items():
            rows[row] = rows[source]
    return {prefix: [rows[r] for r in range(len(rows))] for prefix, rows in out.items()}


def adapter_rows(arch, cfg):
    """How an adapter's tensors reach the model's layout, as the checkpoint's do: (layer,
    the adapter's module path, its B [out, r]) -> (our module path, B), or None where the
    family's regrouping does not keep the tensor whole. Through the family's `regroup`, so
    Llama 4's `feed_forward.*` lands on our `mlp.*` and its q/k rows take the rotate-half
    order the weights took (the delta's rows must line up with the weight's)."""

    def rows(layer: int, module: str, b):
        name = f"model.layers.{layer}.{module}.weight"
        out = list(arch.regroup(iter([(name, b)]), cfg))
        if len(out) != 1:
            return None
        (new_name, new_b), prefix = out[0], f"model.layers.{layer}."
        if not (new_name.startswith(prefix) and new_name.endswith(".weight")):
            return None
        return new_name[len(prefix) : -len(".weight")], np.asarray(new_b)

    return rows


def with_lora_slots(
    graphdef,
    state,
    max_loras: int,
    max_rank: int,
    dtype,
    mesh,
    kv_replicas=1,
    fully_sharded=False,
    rows=None,
):
    """The loaded model with zeroed slot arrays on every projection of its layers, each on
    its sharding: (graphdef, state, LoraSpec)."""
    model = nnx.merge(graphdef, state)
    targets = add_lora_slots(model, max_loras, max_rank, dtype, kv_replicas, fully_sharded)
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, (LoraA, LoraB)):
            shape = var.get_value().shape
            name = "LoRA slots " + ".".join(map(str, path))
            sharding = named_sharding(mesh, param_axes(var), shape, name)
            var.set_value(jax.jit(lambda s=shape: jnp.zeros(s, dtype), out_shardings=sharding)())
    return graphdef, state, LoraSpec(targets, stack_layers(model), max_loras, rows)

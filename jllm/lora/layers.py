"""The device side of multi-LoRA: slot arrays on every targeted projection and the delta.

Every projection of the decoder layers (q/k/v/o, gate/up/down for the Llama family) gets two
variables beside its weight, stacked over the layers like it: `lora_a` [L, S, *in, R] and
`lora_b` [L, S, R, *out], for S = `max_loras` slots and ranks padded to R = `max_lora_rank`,
in the projection's own axes, so that under tensor parallelism A and B split as the weight
does (column-parallel q/k/v/gate/up: B on its output heads or MLP axis; row-parallel o/down:
A on its input axis, and XLA all-reduces the rank-sized x @ A). Writing an adapter into a
slot replaces those arrays' slot row in place (`write_slot`, one executable compiled at
start-up), never the step's executables.

Each token of the flat batch carries its request's slot (`StepContext.lora_slots`: 0 for the
base model, s for the adapter in slot s - 1), and a targeted `Linear` adds
`(x @ A[slot]) @ B[slot]` (the scaling is folded into B when the adapter is written): x
times every slot's A ([T, S, R], rank-sized), the slots other than the token's zeroed, then
one product with B flattened to [S * R, out]. That is vLLM's punica product without a gather
of per-token weights: two dense products whose cost grows with `max_loras * max_lora_rank`,
whatever the mix of adapters in the batch, and that lower the same on every platform.
(On TPU and GPU `jax.lax.ragged_dot` over tokens sorted by slot would make the cost
independent of `max_loras`; on the CPU its lowering is this dense product anyway.)

Glossary: T tokens, L layers, S slots (`max_loras`), R rank (`max_lora_rank`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.lora.peft import LoraTarget
from sharding import LOGICAL_RULES, MODEL_AXIS


class LoraA(nnx.Variable):
    """A projection's LoRA A slots: [L, S, *in, R]."""


class LoraB(nnx.Variable):
    """A projection's LoRA B slots (the scaling folded in): [L, S, R, *out]."""


def lora_delta(x, a, b, slots):
    """x [T, *in], one layer's a [S, *in, R] and b [S, R, *out], slots [T] (0: none, s: slot
    s - 1) -> the delta [T, *out] in float32."""
    T, S, R = x.shape[0], a.shape[0], a.shape[-1]
    xa = jnp.einsum(
        "ti,sir->tsr",
        x.reshape(T, -1),
        a.reshape(S, -1, R).astype(x.dtype),
        preferred_element_type=jnp.float32,
    )
    hot = slots[:, None] == jnp.arange(1, S + 1, dtype=slots.dtype)[None, :]  # [T, S]
    xa = jnp.where(hot[:, :, None], xa, 0.0).astype(x.dtype).reshape(T, S * R)
    out = jnp.dot(xa, b.reshape(S * R, -1).astype(x.dtype), preferred_element_type=jnp.float32)
    return out.reshape(T, *b.shape[2:])


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
    from jllm.models.layers import Linear

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
    targets: dict[str, LoraTarget] = {}
    for _, stack in _stacks(model):
        for path, linear in _linears(stack):
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
            name = path[-1]
            replicas = kv_replicas if name in ("k_proj", "v_proj") else 1
            target = LoraTarget(path, tuple(in_shape), tuple(out_shape), replicas)
            if targets.setdefault(name, target) != target:
                raise ValueError(f"LoRA target {name} differs between layer kinds.")
    return targets


def lora_paths(state) -> list[tuple]:
    """The paths of the slot arrays in a model's state (nnx.State), in a fixed order."""
    return sorted(path for path, var in nnx.to_flat_state(state) if isinstance(var, (LoraA, LoraB)))


def module_of(path: tuple) -> tuple[str, str]:
    """(module name, "A" or "B") of a slot array's state path."""
    return str(path[-2]), "A" if path[-1] == "lora_a" else "B"


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


def _write(arrays, slot, values):
    return [a.at[:, slot].set(v.astype(a.dtype)) for a, v in zip(arrays, values, strict=True)]


# Writes one adapter (or zeros) into slot `slot` of every slot array, in place.
write_slot = jax.jit(_write, donate_argnums=0)


def with_lora_slots(
    graphdef, state, max_loras: int, max_rank: int, dtype, mesh, kv_replicas=1, fully_sharded=False
):
    """The loaded model with zeroed slot arrays on every projection of its layers, each on
    its sharding: (graphdef, state, LoraSpec)."""
    from jllm.model_loader.loader import _axes
    from sharding import named_sharding

    model = nnx.merge(graphdef, state)
    targets = add_lora_slots(model, max_loras, max_rank, dtype, kv_replicas, fully_sharded)
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, (LoraA, LoraB)):
            shape = var.get_value().shape
            name = "LoRA slots " + ".".join(map(str, path))
            sharding = named_sharding(mesh, _axes(var), shape, name)
            var.set_value(jax.jit(lambda s=shape: jnp.zeros(s, dtype), out_shardings=sharding)())
    return graphdef, state, LoraSpec(targets, stack_layers(model), max_loras)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the engine needs of a model's LoRA slots: the projections an adapter may target,
    the model layers of each stacked layer module (state path prefix -> layer indices), and
    the slot count."""

    targets: dict[str, LoraTarget]
    layers: dict[tuple, list[int]]
    max_loras: int

    def slot_values(self, paths: list[tuple], adapter, arrays) -> list[np.ndarray]:
        """One slot's content for each slot array at `paths` (`arrays`: those arrays, for
        their shapes): the adapter's A or B of that module, in the module's stack order;
        zeros where it does not target the module, or for `adapter` None (a cleared slot)."""
        values = []
        for path, array in zip(paths, arrays, strict=True):
            shape = (array.shape[0], *array.shape[2:])
            module, kind = module_of(path)
            ab = None if adapter is None else adapter.weights.get(module)
            if ab is None:
                values.append(np.zeros(shape, np.float32))
                continue
            prefix = next(p for p in self.layers if tuple(path[: len(p)]) == p)
            values.append(ab[0 if kind == "A" else 1][self.layers[prefix]])
        return values

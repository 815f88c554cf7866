"""The device side of multi-LoRA: the slot arrays' types, the delta and the slot writes.

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

Nothing here needs a model, so the lora package sits below models and imports nothing from
it: the model's `Linear` calls `lora_delta` (jllm/models/layers.py), and installing the slot
arrays into a model, which walks its layer stacks and projections, is the model's side
(jllm/models/lora.py).

Glossary: T tokens, L layers, S slots (`max_loras`), R rank (`max_lora_rank`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.lora.peft import LoraTarget


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


def lora_paths(state) -> list[tuple]:
    """The paths of the slot arrays in a model's state (nnx.State), in a fixed order."""
    return sorted(path for path, var in nnx.to_flat_state(state) if isinstance(var, (LoraA, LoraB)))


def module_of(path: tuple) -> tuple[str, str]:
    """(module name, "A" or "B") of a slot array's state path."""
    return str(path[-2]), "A" if path[-1] == "lora_a" else "B"


def _write(arrays, slot, values):
    return [a.at[:, slot].set(v.astype(a.dtype)) for a, v in zip(arrays, values, strict=True)]


# Writes one adapter (or zeros) into slot `slot` of every slot array, in place.
write_slot = jax.jit(_write, donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the engine needs of a model's LoRA slots: the projections an adapter may target,
    the model layers of each stacked layer module (state path prefix -> layer indices), and
    the slot count."""

    targets: dict[str, LoraTarget]
    layers: dict[tuple, list[int]]
    max_loras: int
    rows: object = None  # the family's path and row order for adapters (load_peft_adapter)

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

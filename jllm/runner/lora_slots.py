"""The LoRA slot arrays on the device, as a runner manager (`runner/manager.py`).

The slot arrays are part of the model's state (`jllm/lora/layers.py`: every projection's
[L, S, ...] A and B stacks); this manager owns what is written into them: which adapter
(by content digest) each slot holds, and the slot writes. A request admitted into a slot
whose content differs writes its adapter there first, in the same step (the scheduler's
`LoraSlots` decides the slot); on the wire a write is its slot and one float32 array per
slot array, and a follower checks their shapes against its own arrays before writing.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jllm.distributed.codec import MalformedMessage, expect_array, expect_indexed, expect_list
from jllm.lora.layers import lora_paths, write_slot
from jllm.runner.manager import RunnerManager


def _without_slot_axis(array) -> jax.sharding.NamedSharding:
    """The sharding of one slot of a LoRA slot array [L, S, ...]: the array's without axis 1."""
    spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
    return jax.sharding.NamedSharding(
        array.sharding.mesh, jax.sharding.PartitionSpec(spec[0], *spec[2:])
    )


class LoraSlotArrays(RunnerManager):
    name = "lora"

    def __init__(self, lora, state, replicated) -> None:
        """`lora`: the model's LoraSpec (jllm/lora/layers.py); `state`: the model state that
        holds the slot arrays."""
        self.lora = lora
        self.paths = lora_paths(state)
        self.owner: list[bytes | None] = [None] * lora.max_loras
        self.replicated = replicated

    def _variables(self, runner) -> list:
        flat = dict(nnx.to_flat_state(runner.state))
        return [flat[p] for p in self.paths]

    def admit(self, runner, slot: int, adapter) -> list:
        """The write that puts `adapter` into `slot` (1-based) unless it holds it already."""
        if self.owner[slot - 1] == adapter.digest:
            return []
        self.owner[slot - 1] = adapter.digest
        return [(slot, self.values(runner, adapter))]

    def values(self, runner, adapter) -> list[np.ndarray]:
        """One slot's content of every slot array for `adapter` (None: zeros), float32."""
        arrays = [v.get_value() for v in self._variables(runner)]
        values = self.lora.slot_values(self.paths, adapter, arrays)
        return [np.asarray(v, np.float32) for v in values]

    def _executable(self, runner, arrays, index, values):
        return runner.table.get(
            "LoRA slot write", None, lambda: write_slot.lower(arrays, index, values)
        )

    def compile_all(self, runner) -> None:
        self.apply(runner, [(1, self.values(runner, None))])

    def apply(self, runner, writes) -> None:
        for slot, values in writes:
            variables = self._variables(runner)
            arrays = [v.get_value() for v in variables]
            if not 1 <= slot <= len(self.owner) or [v.shape for v in values] != [
                (a.shape[0], *a.shape[2:]) for a in arrays
            ]:
                raise MalformedMessage(f"a LoRA slot write (slot {slot}) of the wrong shapes")
            values = [
                jax.device_put(v, _without_slot_axis(a))
                for v, a in zip(values, arrays, strict=True)
            ]
            index = jax.device_put(np.int32(slot - 1), self.replicated)
            exe = self._executable(runner, arrays, index, values)
            for var, new in zip(variables, exe(arrays, index, values), strict=True):
                var.set_value(new)

    def encode(self, writes) -> list:
        return [[int(slot), list(values)] for slot, values in writes]

    def decode(self, wire) -> list:
        writes = []
        for w in expect_list(wire, "the LoRA slot writes"):
            slot, values = expect_indexed(w, "a LoRA slot write", 1, len(self.owner) + 1)
            values = expect_list(values, "a LoRA write's values")
            for v in values:
                if not isinstance(v, np.ndarray) or v.ndim < 2:
                    raise MalformedMessage("step message: a LoRA slot value is not an array")
                expect_array(v, "float32", v.ndim, "a LoRA slot value")
            writes.append((slot, values))
        return writes

    def device_arrays(self, runner) -> list:
        return [v.get_value() for v in self._variables(runner)]

"""A runner manager: the one owner of a device concern beside the model's forward.

Each manager (penalty state, the logit-bias table, LoRA slots, the image encoder's cache,
the host KV tier's copies) owns its device arrays and declares three things:

- its executables, compiled at start-up into the runner's `ExecutableTable`
  (`compile_all`);
- its per-step device writes: the runner's host side plans them (each manager's own
  planning method, e.g. `PenaltyState.admit`) into a `StepPlan`'s `writes[name]`, and
  `apply(runner, writes)` runs them on the device before the step's forward, on every
  process of the engine, in the managers' order, then `apply_late(runner, writes)` for
  what must follow the others' writes (the host tier's state loads, after the state
  copies);
- their wire form: `encode(writes)` gives plain data for the step channel (lists, ints,
  numpy arrays: `jllm/distributed/codec.py`) and `decode(wire)` checks it against the
  schema and rebuilds the writes, raising `MalformedMessage` otherwise.

The step message (`runner/step_message.py`) carries `writes[name]` for every manager the
runner holds, so a follower process receives every write by construction: a manager cannot
be left off the wire.
"""

from __future__ import annotations

from typing import ClassVar


class RunnerManager:
    # The key of its writes in a StepPlan and on the wire.
    name: ClassVar[str]

    def compile_all(self, runner) -> None:
        """Compile its executables into `runner.table` (start-up; skipped when eager)."""

    def apply(self, runner, writes) -> None:
        """Run this step's writes on the device (every process, the same writes)."""
        raise NotImplementedError

    def apply_late(self, runner, writes) -> None:
        """The part of this step's writes that runs after every manager's `apply`."""

    def empty(self):
        """The writes of a step that writes nothing."""
        return []

    def encode(self, writes) -> list:
        """The writes as the step channel carries them."""
        raise NotImplementedError

    def decode(self, wire):
        """The writes back from `encode`'s form; MalformedMessage if it is not that."""
        raise NotImplementedError

    def device_arrays(self, runner) -> list:
        """The device arrays it owns (a follower's equal the leader's after every step)."""
        return []

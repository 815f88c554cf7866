"""A step's device work as one plan object, and that plan as the step channel carries it
(`jllm/distributed/`): plain data, no pytrees.

`StepPlan` is what `ModelRunner.run_step` takes: the step's forward key and sample-row
bucket, its two packed buffers (`runner/transfer.py`), the prompt-logprob targets and the
grammar bitmask, and every runner manager's writes by the manager's name
(`runner/manager.py`). Process 0 sends it; a follower rebuilds the buffers' layouts itself
(`ModelRunner.step_layouts`: the same code builds the same structure for a key), so no tree
structure crosses the wire. Each manager encodes and decodes its own writes, and the message
holds an entry for every manager the runner has, so none can be left off. `from_message`
checks every field's type, dtype and shape against the schema and raises `MalformedMessage`
otherwise.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllm.distributed.codec import MalformedMessage, expect_array, expect_ints
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS


@dataclasses.dataclass(kw_only=True)
class StepPlan:
    key: tuple  # the forward key (runner/buckets.py:BatchLayout)
    rs: int  # the sample-row bucket
    inputs: np.ndarray  # the packed StepInputs, int32
    sampling: np.ndarray  # the packed SamplingMetadata, int32
    prompt_targets: np.ndarray | None = None  # [PROMPT_LOGPROB_ROWS] int32, or None
    bitmask: np.ndarray | None = None  # the grammar bitmask [Rs, W] int32, or None
    writes: dict[str, object]  # each manager's writes, by its name


def to_message(plan: StepPlan, managers) -> dict:
    return {
        "kind": "step",
        "key": [int(k) for k in plan.key],
        "rs": int(plan.rs),
        "inputs": plan.inputs,
        "sampling": plan.sampling,
        "targets": plan.prompt_targets,
        "bitmask": plan.bitmask,
        "writes": {m.name: m.encode(plan.writes[m.name]) for m in managers},
    }


def from_message(message: dict, layouts, managers, shards: int = 1) -> StepPlan:
    """The StepPlan of a step message; `layouts(key, rs)` gives the packed layouts this
    process built for a key, and each of `managers` decodes its own writes. With data
    shards, the buffers are [shards, n] and the targets and bitmask `shards` times one's."""
    try:
        key = tuple(expect_ints(message["key"], "key"))
        rs = message["rs"]
        if not isinstance(rs, int):
            raise MalformedMessage("step message: rs is not an integer")
        bufs = []
        for name, lay in zip(("inputs", "sampling"), layouts(key, rs), strict=True):
            size = sum(int(np.prod(shape)) for shape, _ in lay.leaves)
            if shards == 1:
                buf = expect_array(message[name], "int32", 1, name, (size,))
            else:
                buf = expect_array(message[name], "int32", 2, name, (shards, size))
            bufs.append(buf)
        targets, bitmask = message["targets"], message["bitmask"]
        if targets is not None:
            expect_array(targets, "int32", 1, "targets", (shards * PROMPT_LOGPROB_ROWS,))
        if bitmask is not None:
            expect_array(bitmask, "int32", 2, "bitmask", (shards * rs, None))
        wire = message["writes"]
        if not isinstance(wire, dict) or set(wire) != {m.name for m in managers}:
            raise MalformedMessage(
                f"step message: writes for {sorted(wire) if isinstance(wire, dict) else wire!r}, "
                f"not for this engine's managers {sorted(m.name for m in managers)}"
            )
        writes = {m.name: m.decode(wire[m.name]) for m in managers}
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, MalformedMessage):
            raise
        raise MalformedMessage(f"step message: {e!r}") from e
    return StepPlan(
        key=key,
        rs=rs,
        inputs=bufs[0],
        sampling=bufs[1],
        prompt_targets=targets,
        bitmask=bitmask,
        writes=writes,
    )

"""A step as the step channel carries it (`jllm/distributed/`): plain data, no pytrees.

Process 0 sends the step's two packed buffers (`runner/transfer.py`) with its forward key and
sample-row bucket; a follower rebuilds their layouts itself (`ModelRunner.step_layouts`: the
same code builds the same structure for a key), so no tree structure crosses the wire. The
penalty, logit-bias and LoRA slot writes, prompt-logprob targets, grammar bitmask and images
travel as arrays. `from_message` checks every field's type, dtype and shape against the schema and
raises `MalformedMessage` otherwise.
"""

from __future__ import annotations

import numpy as np

from jllm.distributed.codec import MalformedMessage
from jllm.runner.penalty_state import PenaltyWrite


def to_message(
    key, rs, buf, md_buf, writes, bias_writes, targets, bitmask, images, lora_writes
) -> dict:
    return {
        "kind": "step",
        "key": [int(k) for k in key],
        "rs": int(rs),
        "inputs": buf,
        "sampling": md_buf,
        "writes": [[w.reset_rows, w.rows, w.tokens, w.is_output] for w in writes],
        "bias": [[int(row), vector] for row, vector in bias_writes],
        "targets": targets,
        "bitmask": bitmask,
        "images": [[int(slot), pixels] for slot, pixels in images],
        "lora": [[int(slot), list(values)] for slot, values in lora_writes],
    }


def _array(value, dtype: str, ndim: int, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.name != dtype or value.ndim != ndim:
        raise MalformedMessage(f"step message: {what} is not a {ndim}-d {dtype} array")
    return value


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise MalformedMessage(f"step message: {what} is not a list of integers")
    return tuple(value)


def from_message(message: dict, layouts) -> tuple:
    """(key, ((buf, layout), (md_buf, md_layout)), writes, bias writes, targets, bitmask,
    images, LoRA slot writes) of a step message; `layouts(key, rs)` gives the layouts this
    process built (the runner checks a LoRA write's shapes against its slot arrays)."""
    try:
        key = _ints(message["key"], "key")
        rs = message["rs"]
        if not isinstance(rs, int):
            raise MalformedMessage("step message: rs is not an integer")
        layout, md_layout = layouts(key, rs)
        packed = []
        for name, lay in (("inputs", layout), ("sampling", md_layout)):
            buf = _array(message[name], "int32", 1, name)
            if buf.size != sum(int(np.prod(shape)) for shape, _ in lay.leaves):
                raise MalformedMessage(f"step message: {name} has {buf.size} values")
            packed.append((buf, lay))
        writes = []
        for w in message["writes"]:
            fields = [_array(a, d, 1, "a penalty write") for a, d in zip(w, _WRITE, strict=True)]
            writes.append(PenaltyWrite(*fields))
        bias = [(int(row), _array(v, "float32", 1, "a logit bias")) for row, v in message["bias"]]
        targets, bitmask = message["targets"], message["bitmask"]
        if targets is not None:
            _array(targets, "int32", 1, "targets")
        if bitmask is not None:
            _array(bitmask, "int32", 2, "bitmask")
        images = [(int(s), _array(px, "float32", 3, "an image")) for s, px in message["images"]]
        lora = []
        for slot, values in message["lora"]:
            if not isinstance(slot, int) or not isinstance(values, list):
                raise MalformedMessage("step message: a LoRA write is not [slot, [arrays]]")
            lora.append((slot, [_lora_array(v) for v in values]))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, MalformedMessage):
            raise
        raise MalformedMessage(f"step message: {e!r}") from e
    return key, tuple(packed), writes, bias, targets, bitmask, images, lora


def _lora_array(value) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.name != "float32" or value.ndim < 2:
        raise MalformedMessage("step message: a LoRA slot value is not a float32 array")
    return value


_WRITE = ("int32", "int32", "int32", "bool")

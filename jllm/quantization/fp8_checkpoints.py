"""Checkpoints stored in float8 (`quantization_config.quant_method: "fp8"`, vLLM's `fp8`
method on a serialized checkpoint): DeepSeek-V3/R1, Kimi K2, Qwen3's and others' FP8
releases, read into `QuantizedWeight`s (numpy, host side) and kept in float8 on the device.

A quantized projection `P` is `P.weight` float8_e4m3fn [Out, In] with either
- `P.weight_scale_inv` float32 [ceil(Out / bo), ceil(In / bi)] for `weight_block_size`
  [bo, bi] (DeepSeek's [128, 128]): w[o, i] = code[o, i] * scale_inv[o // bo, i // bi]; or
- `P.weight_scale` (no block size): one scale for the tensor, or one per output channel.
`P.input_scale` (a static activation scale) is dropped: jllm's products are weight-only, the
activations stay in the model's dtype. Projections left unquantized (a router, the
embedding, lm_head) are stored in a float dtype and load as in any checkpoint.

`QuantizedWeight` holds scales per output channel and group of inputs: a block's scale is
repeated over its bo output channels ([Out, In / bi] float32, 1/32 of the codes' bytes at
bi = 128), and its `group` is bi, which must divide In (it does in every such checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from jllm.quantization.weights import QuantizedWeight

_SCALES = ("weight_scale_inv", "weight_scale")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def parse_block(qc: dict, path: str) -> tuple[int, int] | None:
    """The checked `weight_block_size` of an fp8 `quantization_config` (None: per tensor or
    channel), or a ValueError naming what jllm cannot read."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"{path}: fp8 checkpoints in {fmt!r} are not supported (e4m3 is).")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{path}: fp8 activation_scheme {scheme!r} is not supported.")
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"{path}: weight_block_size must be two positive ints, got {block!r}.")
    return int(block[0]), int(block[1])


def fp8_weight(codes: np.ndarray, scale: np.ndarray, block, name: str = "") -> QuantizedWeight:
    """One projection from its float8 codes [Out, In] and its stored scale."""
    if codes.ndim != 2:
        raise ValueError(f"{name}: a float8 weight must be [Out, In], got {codes.shape}.")
    out, width = codes.shape
    scale = np.asarray(scale, np.float32)
    if block is None:
        if scale.size not in (1, out):
            raise ValueError(
                f"{name}: weight_scale {scale.shape} is neither one scale nor one per output "
                f"channel of {out}."
            )
        per_channel = np.broadcast_to(scale.reshape(-1, 1), (out, 1))
    else:
        bo, bi = block
        if width % bi:
            raise ValueError(
                f"{name}: weight_block_size {bi} does not divide its {width} inputs; jllm reads "
                "groups of whole blocks of inputs."
            )
        expected = (-(-out // bo), width // bi)
        if scale.shape != expected:
            raise ValueError(
                f"{name}: weight_scale_inv {scale.shape} does not fit [{bo}, {bi}] blocks of a "
                f"[{out}, {width}] weight (expected {expected})."
            )
        per_channel = np.repeat(scale, bo, axis=0)[:out]  # [Out, In / bi]
    bits = np.ascontiguousarray(codes).view(np.uint8)
    return QuantizedWeight(bits, np.ascontiguousarray(per_channel), None, "fp8")


def iter_fp8(
    tensors: Iterable[tuple[str, np.ndarray]], block: tuple[int, int] | None
) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """The checkpoint's tensors with each float8 `P.weight` and its scale gathered into one
    `(P.weight, QuantizedWeight)` (in either order); other tensors pass through, activation
    scales are dropped."""
    weights: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    for name, array in tensors:
        prefix, _, part = name.rpartition(".")
        if part == "input_scale":
            continue
        if part == "weight" and array.dtype == E4M3:
            weights[prefix] = array
        elif part in _SCALES:
            scales[prefix] = array
        elif part == "weight" and array.dtype.name.startswith("float8"):
            raise ValueError(f"{name}: float8 weights in {array.dtype} are not supported.")
        else:
            yield name, array
            continue
        if prefix in weights and prefix in scales:
            w = fp8_weight(weights.pop(prefix), scales.pop(prefix), block, prefix)
            yield f"{prefix}.weight", w
    for prefix in weights:
        raise ValueError(f"{prefix}: the checkpoint has its float8 weight but no scale for it.")
    for prefix in scales:
        raise ValueError(f"{prefix}: the checkpoint has a weight scale but no float8 weight.")

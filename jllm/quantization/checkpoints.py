"""AWQ and GPTQ checkpoints: a safetensors folder whose config.json has a
`quantization_config`, read into `QuantizedWeight`s (numpy, host side). Float8 checkpoints
(quant_method "fp8") are read by fp8_checkpoints.py; `parse_config` and `iter_quantized`
take all three.

Both formats store each quantized projection `P` as int32 words of packed codes plus group
scales and zero points, and both dequantize as w = (q - z) * s per group of `group_size`
inputs; that is `QuantizedWeight`'s q * scale + offset with offset = -z * s.

- AWQ (AutoAWQ's "gemm" layout, vLLM's `awq`): `P.qweight` int32 [In, Out / 8],
  `P.qzeros` int32 [In / group, Out / 8], `P.scales` float16 [In / group, Out]. A word holds 8
  output channels' 4-bit codes, nibble i (bits 4i..4i+3) holding channel 8c + AWQ_ORDER[i].
- GPTQ (AutoGPTQ / GPTQModel, vLLM's `gptq`): `P.qweight` int32 [In * bits / 32, Out], a word
  holding 32 / bits consecutive inputs of one output channel, the first in the low bits;
  `P.qzeros` int32 [G, Out * bits / 32], consecutive output channels likewise; `P.scales`
  [G, Out]; `P.g_idx` int32 [In], each input's group. GPTQ's original ("gptq", v1) format
  stores z - 1 and vLLM adds the 1 back; `checkpoint_format: "gptq_v2"` stores z.
  `desc_act` (act-order) permutes which inputs share a group: a checkpoint whose g_idx is not
  i // group_size is refused, since its groups are not runs of consecutive inputs.

4-bit codes are repacked to `QuantizedWeight`'s uint4 order ([Out, In], pack 32) where In is a
multiple of 32, else held one to a byte; GPTQ's 8-bit codes are held as int8 (q - 128).
Scales and offsets are float32 (z * s needs more than float16's mantissa).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from jllm.quantization import CHECKPOINT_METHODS
from jllm.quantization.fp8_checkpoints import iter_fp8, parse_block
from jllm.quantization.mxfp4 import MXFP4_GROUP, iter_mxfp4
from jllm.quantization.weights import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word -> output channel 8c + AWQ_ORDER[i]
_GPTQ_BITS = (4, 8)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's `quantization_config`, checked: what jllm reads it with."""

    method: str  # "awq" | "gptq" | "fp8" | "mxfp4"
    bits: int
    group_size: int  # -1: one group per output channel
    v1_zeros: bool = False  # GPTQ's original format: stored zero points are z - 1
    block: tuple[int, int] | None = None  # fp8's weight_block_size [Out, In], or None


def _get(config: dict, *keys, default=None):
    return next((config[k] for k in keys if k in config), default)


def parse_config(quantization_config, path: str) -> CheckpointQuantization:
    """The checkpoint's quantization (a dict or a transformers config object), or a
    ValueError naming what jllm cannot read."""
    qc = quantization_config
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(_get(qc, "quant_method", default="unknown")).lower()
    if method == "fp8":
        block = parse_block(qc, path)
        return CheckpointQuantization("fp8", 8, -1 if block is None else block[1], block=block)
    if method == "mxfp4":  # the experts' blocks of 32 (mxfp4.py); the rest is not quantized
        return CheckpointQuantization("mxfp4", 4, MXFP4_GROUP)
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"{path} is a {method!r}-quantized checkpoint; jllm reads AWQ, GPTQ, FP8 and "
            "MXFP4 checkpoints (quant_method 'awq', 'gptq', 'fp8' or 'mxfp4'), unquantized "
            "safetensors and GGUF files."
        )
    bits = int(_get(qc, "bits", "w_bit", default=4))
    group_size = int(_get(qc, "group_size", "q_group_size", default=128))
    if group_size == 0 or group_size < -1:
        raise ValueError(f"{path}: group_size {group_size} is not a valid {method} group size.")
    if method == "awq":
        if bits != 4:
            raise ValueError(f"{path}: AWQ checkpoints have 4-bit weights, this one {bits}.")
        version = str(_get(qc, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"{path}: AWQ version {version!r} is not supported (jllm reads AutoAWQ's "
                "'gemm' layout, as vLLM does)."
            )
        if not _get(qc, "zero_point", default=True):
            raise ValueError(f"{path}: AWQ without zero points is not supported.")
        return CheckpointQuantization("awq", bits, group_size)
    if bits not in _GPTQ_BITS:
        raise ValueError(
            f"{path}: {bits}-bit GPTQ weights are not supported by jllm yet (4 and 8 are)."
        )
    if _get(qc, "dynamic"):
        raise ValueError(
            f"{path}: GPTQ 'dynamic' per-module overrides are not supported by jllm yet."
        )
    if _get(qc, "is_marlin_format"):
        raise ValueError(
            f"{path}: AutoGPTQ's marlin serialization (is_marlin_format) is not supported; "
            "use the checkpoint in GPTQ's own format."
        )
    fmt = str(_get(qc, "checkpoint_format", default="gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{path}: GPTQ checkpoint_format {fmt!r} is not supported.")
    return CheckpointQuantization("gptq", bits, group_size, v1_zeros=fmt == "gptq")


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32 / bits codes (uint8), the low bits first, spread along `axis`
    (each word becomes 32 / bits consecutive entries there)."""
    u = np.ascontiguousarray(words).view(np.uint32)
    per = 32 // bits
    parts = [(u >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    stacked = np.stack(parts, axis=axis + 1 if axis >= 0 else axis)
    shape = list(u.shape)
    shape[axis] *= per
    return stacked.reshape(shape).astype(np.uint8)


def _pack_uint4(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 [Out, In] (In a multiple of 32) in QuantizedWeight's uint4 order, pack 32."""
    out, width = q.shape
    runs = q.reshape(out, width // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(out, width // 2).astype(np.uint8)


def _weight(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int) -> QuantizedWeight:
    """Codes [Out, In] (0 .. 2^bits - 1), zero points and scales [Out, G]: w = (q - z) s."""
    scale = scales.astype(np.float32)
    if bits == 8:  # int8 codes q - 128: w = (q - 128) s + (128 - z) s
        codes = (q.astype(np.int16) - 128).astype(np.int8)
        return QuantizedWeight(codes, scale, (128 - zeros.astype(np.float32)) * scale, "int8")
    offset = -zeros.astype(np.float32) * scale
    if q.shape[1] % 32 == 0:
        return QuantizedWeight(_pack_uint4(q), scale, offset, "uint4", pack=32)
    return QuantizedWeight(q.astype(np.int8), scale, offset, "int8")


def _check_shapes(name: str, parts: dict, q: np.ndarray, zeros: np.ndarray, spec) -> None:
    width = q.shape[1]
    if spec.group_size != -1 and width % spec.group_size:
        # vLLM refuses this too: the last group would be a partial one
        raise ValueError(
            f"{name}: {width} inputs are not a multiple of {spec.method} group_size "
            f"{spec.group_size}; jllm reads groups of whole runs of inputs."
        )
    groups = parts["scales"].shape[0]
    expected = 1 if spec.group_size == -1 else width // spec.group_size
    if zeros.shape != parts["scales"].shape[::-1] or groups != expected:
        raise ValueError(
            f"{name}: qzeros {parts['qzeros'].shape} and scales {parts['scales'].shape} do not "
            f"fit {spec.method} group_size {spec.group_size} for {width} inputs."
        )


def awq_weight(parts: dict, spec: CheckpointQuantization, name: str = "") -> QuantizedWeight:
    """One AWQ projection from its qweight, qzeros and scales (numpy)."""
    inverse = np.argsort(AWQ_ORDER)  # output channel k of a word sits in nibble inverse[k]

    def unpack(words):  # [rows, Out / 8] -> [rows, Out], channels in order
        nibbles = _unpack(words, 4, -1).reshape(*words.shape, 8)
        return nibbles[..., inverse].reshape(words.shape[0], -1)

    q = unpack(parts["qweight"]).T  # [Out, In]
    zeros = unpack(parts["qzeros"]).T  # [Out, G]
    _check_shapes(name, parts, q, zeros, spec)
    return _weight(np.ascontiguousarray(q), zeros, np.asarray(parts["scales"]).T, 4)


def gptq_weight(parts: dict, spec: CheckpointQuantization, name: str = "") -> QuantizedWeight:
    """One GPTQ projection from its qweight, qzeros, scales and g_idx (numpy)."""
    q = _unpack(parts["qweight"], spec.bits, 0).T  # [Out, In]
    zeros = _unpack(parts["qzeros"], spec.bits, 1).T.astype(np.int16)  # [Out, G]
    if spec.v1_zeros:
        zeros = zeros + 1
    _check_shapes(name, parts, q, zeros, spec)
    width, groups = q.shape[1], zeros.shape[1]
    g_idx = parts.get("g_idx")
    if g_idx is not None and not np.array_equal(
        np.asarray(g_idx), np.arange(width) // (width // groups)
    ):
        raise ValueError(
            f"{name}: this GPTQ checkpoint was quantized with desc_act (act-order), whose "
            "g_idx groups inputs out of order; jllm does not support act-order yet. "
            "Use a checkpoint quantized with desc_act=False."
        )
    return _weight(np.ascontiguousarray(q), zeros, np.asarray(parts["scales"]).T, spec.bits)


def iter_quantized(
    tensors: Iterable[tuple[str, np.ndarray]], spec: CheckpointQuantization
) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized projection's parts (`P.qweight`,
    `P.qzeros`, `P.scales`, `P.g_idx`) gathered into one `(P.weight, QuantizedWeight)`; other
    tensors pass through. A projection is yielded once its parts are all read."""
    if spec.method == "fp8":  # float8 weights and their scales (fp8_checkpoints.py)
        yield from iter_fp8(tensors, spec.block)
        return
    if spec.method == "mxfp4":  # stacked experts' blocks and scales (mxfp4.py)
        yield from iter_mxfp4(tensors)
        return
    read = awq_weight if spec.method == "awq" else gptq_weight
    need = set(_PARTS[:3]) | ({"g_idx"} if spec.method == "gptq" else set())
    pending: dict[str, dict] = {}
    for name, array in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, array
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = array
        if need <= parts.keys():
            yield f"{prefix}.weight", read(pending.pop(prefix), spec, prefix)
    for prefix, parts in pending.items():  # GPTQ checkpoints without g_idx
        missing = set(_PARTS[:3]) - parts.keys()
        if missing:
            raise ValueError(f"{prefix}: the checkpoint lacks {', '.join(sorted(missing))}.")
        yield f"{prefix}.weight", read(parts, spec, prefix)

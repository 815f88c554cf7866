"""gpt-oss's MXFP4 checkpoints (`quantization_config.quant_method: "mxfp4"`, vLLM's `mxfp4`):
each layer's stacked experts stored as OCP microscaling FP4, the rest of the checkpoint bf16.

An expert tensor `P` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) is two tensors:
- `P_blocks` uint8 [E, Out, In / 32, 16]: 32 e2m1 codes per block of inputs, two to a byte,
  input 2j of the block in the low nibble and 2j + 1 in the high one;
- `P_scales` uint8 [E, Out, In / 32]: each block's scale 2^(s - 127) (e8m0).
Note the [Out, In] order (the bf16 release stores [E, In, Out]). `iter_mxfp4` gathers them
into one stacked `QuantizedWeight` of kind "mxfp4" (codes [E, Out, In / 2], the scales as
stored), which the family's loader cuts per expert (models/gpt_oss.py) and the model keeps in
4 bits, dequantizing one expert's matrix at a time in the grouped product (models/moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from jllm.quantization.weights import QuantizedWeight

MXFP4_GROUP = 32  # inputs per scale
_PARTS = ("_blocks", "_scales")


def mxfp4_weight(blocks: np.ndarray, scales: np.ndarray, name: str = "") -> QuantizedWeight:
    """One stacked tensor from its blocks [..., Out, G, 16] and scales [..., Out, G]."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype}/{scales.dtype}."
        )
    if blocks.ndim < 3 or blocks.shape[-1] != MXFP4_GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{name}: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not fit "
            f"[..., Out, G, {MXFP4_GROUP // 2}] and [..., Out, G]."
        )
    codes = np.ascontiguousarray(blocks).reshape(*blocks.shape[:-2], -1)  # [..., Out, In / 2]
    return QuantizedWeight(codes, np.ascontiguousarray(scales), None, "mxfp4")


GGML_BLOCK = 1 + MXFP4_GROUP // 2  # llama.cpp's block: the e8m0 scale, then 16 code bytes


def ggml_mxfp4_weight(data: np.ndarray, name: str = "") -> QuantizedWeight:
    """A GGUF MXFP4 tensor's bytes [..., Out, G * 17] (llama.cpp's blocks: the scale byte,
    then input j of the block in the low nibble of byte j and input j + 16 in its high one)
    as a QuantizedWeight of kind "mxfp4" in this module's order (inputs 2j and 2j + 1 share
    a byte). The codes and scales mean the same in both: e2m1 codes, 2^(s - 127) scales."""
    data = np.asarray(data, np.uint8)
    if data.shape[-1] % GGML_BLOCK:
        raise ValueError(f"{name}: {data.shape[-1]} bytes a row is not whole MXFP4 blocks.")
    blocks = data.reshape(*data.shape[:-1], -1, GGML_BLOCK)  # [..., Out, G, 17]
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [..., Out, G, 32] in input order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return mxfp4_weight(packed.astype(np.uint8), np.ascontiguousarray(scales), name)


def iter_mxfp4(
    tensors: Iterable[tuple[str, np.ndarray]],
) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """The checkpoint's tensors with each `P_blocks` and `P_scales` gathered into one
    `(P, QuantizedWeight)` (in either order); other tensors pass through."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        part = next((p for p in _PARTS if name.endswith(p)), None)
        if part is None:
            yield name, array
            continue
        prefix = name[: -len(part)]
        parts = pending.setdefault(prefix, {})
        parts[part] = array
        if len(parts) == len(_PARTS):
            del pending[prefix]
            yield prefix, mxfp4_weight(parts["_blocks"], parts["_scales"], prefix)
    for prefix, parts in pending.items():
        missing = next(p for p in _PARTS if p not in parts)
        raise ValueError(f"{prefix}: the MXFP4 checkpoint lacks {prefix}{missing}.")

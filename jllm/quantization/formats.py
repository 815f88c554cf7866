"""From a checkpoint's numbers to `QuantizedWeight` host arrays (numpy), per format.

- On the fly (`quantization="fp8"` / `"tpu_int8"`): a float weight [Out, In] quantized with
  one scale per output channel (`quantize_channels`: qwix's float8_e4m3fn rule, absmax / 448;
  vLLM's tpu_int8 rule, absmax / 127).
- GGUF blocks (`quantization="gguf"`), read from the file's bytes as llama.cpp lays them out
  (ggml-quants.c, and gguf-py's numpy dequantizers, which the tests use as the oracle):

  - Q8_0: f16 d, 32 int8 q; w = d q. Kept as int8 codes, scale d per 32.
  - Q4_0: f16 d, 16 bytes of nibbles; w = d (q - 8). uint4 codes as stored, scale d and
    offset -8 d per 32.
  - Q4_1: f16 d, f16 m, 16 bytes; w = d q + m. uint4 codes as stored, scale d, offset m.
  - Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
    w = d sc q - dmin mn. uint4 codes as stored, scale d sc and offset -dmin mn per 32.
  - Q6_K: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 sc, f16 d;
    w = d sc (q - 32). int8 codes q - 32, scale d sc per 16.

  Q4_0/Q4_1 keep each 32-value block's low nibbles for its first 16 values and high nibbles
  for its last 16; Q4_K does the same per 64 values: that is `QuantizedWeight`'s uint4 order
  (pack 32 or 64), so those bytes are used unchanged. Q6_K's 6-bit codes are held one to a
  byte (8.5 bits a weight here against its 6.56 in the file). Scales are float32 where a
  product of two stored numbers needs more than float16's mantissa (K-quants), else float16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jllm.quantization.weights import QuantizedWeight

GGUF_KEPT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
ONLINE_KINDS = {"tpu_int8": "int8", "fp8": "fp8"}  # method -> QuantizedWeight.kind


def quantize_channels(weight, method: str):
    """(codes, float32 scales [..., Out, 1]) of a float weight [..., Out, In] (jnp, traceable);
    fp8 codes come as their uint8 bit patterns.

    "tpu_int8": vLLM's rule, scale = max(absmax, 1e-5) / 127 and codes
    clip(round(w / scale), -128, 127). "fp8": qwix's float8_e4m3fn quantization, scale =
    absmax / 448 (1 for an all-zero channel), codes rounded to nearest."""
    import qwix

    weight = weight.astype(jnp.float32)
    if method == "tpu_int8":
        absmax = jnp.abs(weight).max(axis=-1, keepdims=True)
        scale = jnp.maximum(absmax, 1e-5) / 127.0
        codes = jnp.clip(jnp.round(weight * (1.0 / scale)), -128, 127).astype(jnp.int8)
        return codes, scale
    q = qwix.quantize(weight, jnp.float8_e4m3fn, channelwise_axes=list(range(weight.ndim - 1)))
    # Held as their bytes: XLA's CPU backend slices and copies float8 arrays element by
    # element (a scan's per-layer slice of the codes cost 25 ms a step for SmolLM2).
    return jax.lax.bitcast_convert_type(q.qvalue, jnp.uint8), q.scale.astype(jnp.float32)


def quantize_online(weight: np.ndarray, method: str) -> QuantizedWeight:
    """A float weight [Out, In] as per-output-channel int8 ("tpu_int8") or fp8 ("fp8"),
    quantized on the host's CPU device."""
    with jax.default_device(jax.devices("cpu")[0]):
        codes, scale = jax.jit(quantize_channels, static_argnums=1)(weight, method)
    return QuantizedWeight(np.asarray(codes), np.asarray(scale), None, ONLINE_KINDS[method])


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """A GGUF tensor's bytes [rows, row_bytes] as [rows, blocks, block_bytes]."""
    rows, row_bytes = data.shape
    return np.ascontiguousarray(data).reshape(rows, row_bytes // block_bytes, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    sc = np.empty((*q.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def gguf_weight(data: np.ndarray, type_name: str) -> QuantizedWeight:
    """One GGUF tensor's bytes [rows, row_bytes] (uint8, as `GGUFReader` gives them) kept in
    its quantized form; rows are output channels."""
    rows = data.shape[0]
    if type_name == "Q8_0":
        b = _blocks(data, 34)
        codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
        return QuantizedWeight(codes, _f16(b, 0), None, "int8")
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = _blocks(data, size)
        d = _f16(b, 0)
        codes = np.ascontiguousarray(b[..., size - 16 :]).reshape(rows, -1)
        offset = -8 * d if type_name == "Q4_0" else _f16(b, 2)
        return QuantizedWeight(codes, d, offset, "uint4", pack=32)
    if type_name == "Q4_K":
        b = _blocks(data, 144)
        d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
        sc, mn = _k4_scales(b[..., 4:16])
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = (-dmin[..., None] * mn).reshape(rows, -1)
        codes = np.ascontiguousarray(b[..., 16:]).reshape(rows, -1)
        return QuantizedWeight(codes, scale, offset, "uint4", pack=64)
    if type_name == "Q6_K":
        b = _blocks(data, 210)
        ql = b[..., 0:128].reshape(*b.shape[:2], 2, 64)  # per half of 128 values
        qh = b[..., 128:192].reshape(*b.shape[:2], 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        d = _f16(b, 208).astype(np.float32)
        low = np.concatenate(
            [ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1
        )
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
        codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
        scale = (d[..., None] * sc).reshape(rows, -1)
        return QuantizedWeight(codes.reshape(rows, -1), scale, None, "int8")
    raise ValueError(f"GGUF type {type_name} is not kept quantized (kept: {GGUF_KEPT}).")


def host_codes(w: QuantizedWeight) -> np.ndarray:
    """The integer codes [..., Out, In] of an int8 or uint4 QuantizedWeight (numpy)."""
    if w.kind == "int8":
        return np.asarray(w.codes)
    runs = np.asarray(w.codes).reshape(*w.codes.shape[:-1], -1, w.pack // 2)
    return np.concatenate([runs & 15, runs >> 4], axis=-1).reshape(w.shape).astype(np.int8)


def as_int8(w: QuantizedWeight, group: int) -> QuantizedWeight:
    """The same values as int8 codes with float32 scales and offsets per `group` inputs (a
    divisor of w's group): the one form that layers of different GGUF types (Q4_K and Q6_K
    in llama.cpp's Q4_K_M files) share once stacked."""
    repeat = w.group // group
    scale = np.repeat(np.asarray(w.scale, np.float32), repeat, axis=-1)
    if w.offset is None:
        offset = np.zeros_like(scale)
    else:
        offset = np.repeat(np.asarray(w.offset, np.float32), repeat, axis=-1)
    return QuantizedWeight(host_codes(w), scale, offset, "int8")


def stack_layers(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One parameter's layers stacked ([layers, Out, In] codes). Layers of one form stack as
    they are; layers of different forms become int8 at the smallest group (`as_int8`)."""
    forms = {(w.kind, w.pack, w.scale.shape, w.scale.dtype, w.offset is None) for w in weights}
    if len(forms) > 1:
        group = min(w.group for w in weights)
        weights = [as_int8(w, group) for w in weights]
    return jax.tree.map(lambda *arrays: np.stack(arrays), *weights)

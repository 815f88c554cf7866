"""A quantized weight and the products that read it inside the jitted step.

`QuantizedWeight` holds a projection as codes with one scale (and, for asymmetric formats, one
offset) per group of `group` consecutive input channels of each output channel:

    w[o, i] = code[o, i] * scale[o, i // group] + offset[o, i // group]

in the layout `[Out, In]` (transformers' and GGUF's row order), with a leading layer axis when
the model stacks its layers. Every format maps onto it (jllm/quantization/formats.py):

- kind "int8": int8 codes (tpu_int8, GGUF Q8_0, Q6_K's 6-bit codes held in a byte);
- kind "fp8": float8_e4m3fn codes held as their uint8 bit patterns (vLLM's dynamic fp8;
  XLA's CPU backend slices and copies float8 arrays element by element);
- kind "uint4": codes 0..15 packed two to a byte: within each run of `pack` consecutive inputs,
  the low nibbles hold the run's first half and the high nibbles its second half (GGUF's own
  Q4_0/Q4_1/Q4_K order, so their bytes are used as they are);
- kind "mxfp4": OCP microscaling FP4 (gpt-oss's experts): e2m1 codes (FP4_VALUES) two to a
  byte, input 2j in the low nibble and 2j + 1 in the high one, and per group of 32 inputs
  one power-of-two scale held as its uint8 exponent (e8m0, 2^(s - 127)): 4.25 bits a weight.

The weights are never dequantized in memory as a whole. On the CPU a step of at most 16 rows
(decode) goes to a C++ kernel that reads the codes in place (cpu_kernel.py,
pallas_kernels/cpu/quantized_matmul.cc).
Otherwise XLA multiplies: with per-channel scales it converts the codes to the activations'
dtype inside the product (XLA fuses an integer convert into the dot) and scales the output;
with group scales it dequantizes the one weight it multiplies, a transient the size of one
layer's matrix. Measured on the 2-core Zen 4 (bf16, 30 stacked [1536, 576] matrices, 2-8
rows): XLA runs int8 codes at the speed of bf16 weights (3.9-4.9 ms against 3.9-4.0 ms),
unpacks 4-bit codes about 3x slower (11-14 ms: nibble shuffles along the minor axis are not
vectorised) and converts fp8 with scalar code (72 ms). Multiplying per-group partial
products by their scales instead ([T, G, Out], a batched dot) was slower still (18-27 ms).

Glossary: T rows, In input channels, Out output channels, G groups per row, g = In // G.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jllm.quantization import cpu_kernel


@struct.dataclass
class QuantizedWeight:
    codes: jax.Array  # int8 | uint8 (fp8 bits) [..., Out, In], or uint8 [..., Out, In // 2]
    scale: jax.Array  # [..., Out, G]
    offset: jax.Array | None  # [..., Out, G] or None (symmetric formats)
    kind: str = struct.field(pytree_node=False)
    pack: int = struct.field(pytree_node=False, default=0)  # uint4 only

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape, [..., Out, In]."""
        *lead, out, width = self.codes.shape
        return (*lead, out, width * 2 if self.kind in ("uint4", "mxfp4") else width)

    @property
    def group(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        leaves = [self.codes, self.scale] + ([] if self.offset is None else [self.offset])
        return sum(int(a.size) * a.dtype.itemsize for a in leaves)


nnx.register_data_type(QuantizedWeight)


def fp8_values(codes: jax.Array, dtype) -> jax.Array:
    """float8_e4m3fn codes (their uint8 bits) as `dtype`, exactly. On CPU, XLA's own fp8
    convert is scalar code (about 17x slower than the product it feeds), so there the value
    is built with integer operations: |v| * 2^9 = (8 * [e > 0] + m) << max(e - 1, 0) for
    exponent e and mantissa m."""
    if not cpu_kernel.tracing_for_cpu():
        return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(dtype)
    bits = jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.int32)
    e, m = (bits >> 3) & 15, bits & 7
    magnitude = (m + jnp.minimum(e, 1) * 8) << jnp.maximum(e - 1, 0)
    sign = 1 - ((bits >> 6) & 2)  # bits is sign-extended: -1 when the sign bit is set
    # |magnitude| reaches 14 << 14, past float16's range: scale in float32 first.
    return ((magnitude * sign).astype(jnp.float32) * 2.0**-9).astype(dtype)


# The e2m1 values of the 16 FP4 codes (sign in bit 3).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def code_values(w: QuantizedWeight, dtype) -> jax.Array:
    """The codes as `dtype` values, [..., Out, In] (small integers or FP4's, exact in bf16)."""
    if w.kind == "fp8":
        return fp8_values(w.codes, dtype)
    if w.kind == "mxfp4":
        *lead, out, width = w.codes.shape
        nibbles = jnp.stack([w.codes & 15, w.codes >> 4], axis=-1).reshape(*lead, out, 2 * width)
        return jnp.asarray(FP4_VALUES, dtype)[nibbles.astype(jnp.int32)]
    codes = w.codes
    if w.kind == "uint4":
        *lead, out, width = codes.shape
        runs = codes.reshape(*lead, out, -1, w.pack // 2)
        codes = jnp.concatenate([runs & 15, runs >> 4], axis=-1).reshape(*lead, out, 2 * width)
        codes = codes.astype(jnp.int8)  # the int8 -> float convert is the one XLA fuses
    return codes.astype(dtype)


def scale_values(w: QuantizedWeight) -> jax.Array:
    """The scales as float32: MXFP4's e8m0 exponents as 2^(s - 127) (exactly: the bits of a
    float32 whose exponent field is s; s = 0, 2^-127, reads as 0)."""
    if w.kind == "mxfp4":
        bits = w.scale.astype(jnp.uint32) << 23
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return w.scale.astype(jnp.float32)


def dequantize(w: QuantizedWeight, dtype) -> jax.Array:
    """The float weight [..., Out, In] (one layer's transient, or a test's reference)."""
    *lead, out, width = w.shape
    groups = w.scale.shape[-1]
    codes = code_values(w, jnp.float32).reshape(*lead, out, groups, width // groups)
    values = codes * scale_values(w)[..., None]
    if w.offset is not None:
        values = values + w.offset.astype(jnp.float32)[..., None]
    return values.reshape(w.shape).astype(dtype)


def matmul(x: jax.Array, w: QuantizedWeight, out_dtype=None) -> jax.Array:
    """x [T, In] @ w.T -> [T, Out] in `out_dtype` (default x's dtype)."""
    out_dtype = out_dtype or x.dtype
    if cpu_kernel.applies(x, w):
        return cpu_kernel.cpu_matmul(x, w, out_dtype)
    if w.scale.shape[-1] == 1 and w.offset is None:  # per channel: scale the output
        # Accumulated in float32: before its scale the product is 1 / scale times too large,
        # past float16's range for a weight of absmax 1e-3 and an output of 1.
        f32 = jnp.float32
        y = jnp.einsum("TI,OI->TO", x, code_values(w, x.dtype), preferred_element_type=f32)
        return (y * scale_values(w)[:, 0]).astype(out_dtype)
    # The barrier keeps XLA from fusing the dequantization into the dot's operand, which it
    # then recomputes per output tile (5x slower on the CPU).
    weight = jax.lax.optimization_barrier(dequantize(w, x.dtype))
    return jnp.einsum("TI,OI->TO", x, weight, preferred_element_type=out_dtype)


def take_rows(w: QuantizedWeight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the float weight (an embedding lookup), [len(ids), In]."""
    rows = jax.tree.map(lambda a: a[ids], w)
    return dequantize(rows, dtype)

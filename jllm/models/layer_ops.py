"""The elementwise work of a bf16 layer on the CPU, one pass each: RMSNorm, the residual add
before it, and the rotary embedding of q and k.

`pallas_kernels/cpu/layer_ops.cc` as XLA FFI calls, built once per machine by the CPU
kernels' machinery (pallas_kernels/cpu/build.py). XLA's CPU backend runs a bf16 RMSNorm as
three passes over the rows (a float32 copy, the sum of squares, the scaling), the residual
add before it as a fourth, and the rotary embedding as five; each kernel reads a row once.

Where they run (`applies`): where the bf16 layer products are the C++ kernels'
(`bf16_matmul.applies`: the CPU backend, AVX512-BF16, one device), outside the
batch-invariant mode (whose norm sums in `invariant.row_mean`'s order). Elsewhere, and on
every other platform, the jnp forms in layers.py's RMSNorm and rope.py's `apply_rope` run
(`reference` is the norm kernel's rounding written in jnp).

The add's sum is rounded to bfloat16 before it is normalised (the residual stream as the
layer carries it, and as transformers computes it); XLA may normalise the float32 sum it
has not rounded yet (its excess precision within a fusion), so the two paths can differ in
the last bit of a few outputs.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jllm.config import batch_invariant
from jllm.models import bf16_matmul
from pallas_kernels.cpu.build import EXACT_ORDER, INCLUDE, CpuKernelUnavailable, FfiKernel

SOURCE = os.path.join(INCLUDE, "layer_ops.cc")


def _kernel(what: str, symbol: str, target: str, extra_flags=EXACT_ORDER) -> FfiKernel:
    return FfiKernel(SOURCE, "layer_ops", what, symbol, target, extra_flags=extra_flags)


# No multiply-add fused where the source does not write one: the rotary embedding fuses
# exactly those XLA's CPU backend fuses in the jnp form (the same bits).
NORM = _kernel("CPU RMSNorm kernel", "JllmRmsNorm", "jllm_rms_norm_cpu")
ADD_NORM = _kernel("CPU add + RMSNorm kernel", "JllmAddRmsNorm", "jllm_add_rms_norm_cpu")
ROPE = _kernel("CPU rotary embedding kernel", "JllmRope", "jllm_rope_cpu")


def applies(dtype) -> bool:
    """Whether the norms and rotary embeddings of `dtype` rows (with weights of that dtype)
    run on the kernels here (checked at trace time)."""
    if jnp.dtype(dtype) != jnp.bfloat16 or batch_invariant.enabled():
        return False
    if not bf16_matmul.applies(dtype):
        return False
    try:
        for kernel in (NORM, ADD_NORM, ROPE):
            kernel.load()
    except CpuKernelUnavailable:
        return False
    return True


def _rows(x, w):
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or w.shape != x.shape[-1:]:
        raise ValueError(
            f"the CPU RMSNorm takes bfloat16 x [..., D] and w [D], got {x.dtype} {x.shape} "
            f"and {w.dtype} {w.shape}"
        )
    return x.reshape(-1, x.shape[-1])


def rms_norm(x, w, eps: float, unit_offset: bool = False) -> jax.Array:
    """x [..., D] normalised over its last axis and scaled by w [D] (by 1 + w with
    `unit_offset`), as layers.py's RMSNorm computes it."""
    rows = _rows(x, w)
    out = jax.ShapeDtypeStruct(rows.shape, rows.dtype)
    y = jax.ffi.ffi_call(NORM.load(), out)(
        rows, w, eps=np.float32(eps), unit_offset=bool(unit_offset)
    )
    return y.reshape(x.shape)


def add_rms_norm(x, h, w, eps: float, unit_offset: bool = False) -> tuple[jax.Array, jax.Array]:
    """(x + h, rms_norm(x + h)): the sum rounded to bfloat16, then normalised."""
    if h.shape != x.shape or h.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: h {h.dtype} {h.shape} is not like x {x.shape}")
    rows = _rows(x, w)
    out = jax.ShapeDtypeStruct(rows.shape, rows.dtype)
    total, y = jax.ffi.ffi_call(ADD_NORM.load(), (out, out))(
        rows, h.reshape(rows.shape), w, eps=np.float32(eps), unit_offset=bool(unit_offset)
    )
    return total.reshape(x.shape), y.reshape(x.shape)


def rope(x, cos, sin) -> jax.Array:
    """x [T, N, H] (bfloat16) rotated in the rotate-half layout by cos, sin [T, R] (float32,
    2 R <= H): [x1 c - x2 s, x2 c + x1 s] over the first 2 R dims, the rest as they are."""
    if x.dtype != jnp.bfloat16 or x.ndim != 3:
        raise ValueError(
            f"the CPU rotary embedding takes bfloat16 x [T, N, H], got {x.dtype} {x.shape}"
        )
    t, _, h = x.shape
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] != t or 2 * cos.shape[1] > h:
        raise ValueError(f"cos and sin must be [{t}, R] with 2 R <= {h}, got {cos.shape}")
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call(ROPE.load(), out)(x, cos.astype(jnp.float32), sin.astype(jnp.float32))


def reference(x, w, eps: float, unit_offset: bool = False) -> jax.Array:
    """The kernel's result through jnp (float32 throughout, each rounding where the kernel
    rounds)."""
    x32 = x.astype(jnp.float32)
    scale = 1.0 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = x32 * scale
    if unit_offset:
        return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return (normed.astype(x.dtype).astype(jnp.float32) * w.astype(jnp.float32)).astype(x.dtype)

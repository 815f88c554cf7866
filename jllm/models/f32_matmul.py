"""The CPU product in float32 arithmetic of rows and one layer of a stacked weight, read in
place: float32 operands, or bfloat16 ones widened to float32.

`pallas_kernels/cpu/f32_matmul.cc` as an XLA FFI call, built once per machine by the CPU
kernels' machinery (pallas_kernels/cpu/build.py: GCC, cached under ~/.cache/jllm/kernels).
The float32 counterpart of bf16_matmul.py: the model's layer scan hands each `Linear` a
`StackedWeight` (layers.py), the whole [L, ...] weight and the layer index, so that no
layer's weights are copied out of the stack before the product, as XLA's dynamic slice does
on every step.

Where it runs (`enabled`, decided once per process and logged): XLA's CPU backend on an x86
CPU with FMA and AVX2 or AVX-512, on one device (`applies`), at every step size: the layer
products and the LM head (`transposed`, for a tied embedding table), each skipping the
step's padding rows. For float32 models; and for bfloat16 models on CPUs with neither
AVX512-BF16 (bf16_matmul.py's kernel) nor AMX (XLA's tile products): `widens_bf16`. Per
product on a Zen 3 (`benchmarks/matmul.py`, one layer of a 30-layer stack), float32 measured
0.94-1.6x XLA's from 1 to 4096 rows (level at 2048-4096 rows, ahead below, and ahead wherever
a step has padding rows, which XLA's products compute); bfloat16 widened 1.3-1.8x XLA's bf16
products from 64 to 2048 rows and 3-5.6x at one row.

Glossary: M rows, K inputs, N outputs, L layers.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

from jllm.config import batch_invariant
from jllm.models.bf16_matmul import check_live, one_device
from pallas_kernels.cpu.build import (
    EXACT_ORDER,
    INCLUDE,
    CpuKernelUnavailable,
    FfiKernel,
    cpu_flags,
    tracing_for_cpu,
)

logger = logging.getLogger("jllm")

SOURCE = os.path.join(INCLUDE, "f32_matmul.cc")
KERNEL = FfiKernel(
    SOURCE,
    "f32_matmul",
    "CPU float32 matmul kernel",
    "JllmF32Matmul",
    "jllm_f32_matmul_cpu",
    extra_flags=EXACT_ORDER,
)
GATED = FfiKernel(
    SOURCE,
    "f32_matmul",
    "CPU float32 gated matmul kernel",
    "JllmF32GatedMatmul",
    "jllm_f32_gated_matmul_cpu",
    extra_flags=EXACT_ORDER,
)


def supported() -> bool:
    """Whether this CPU can run the kernel at all (x86 with FMA and AVX2 or AVX-512F)."""
    flags = cpu_flags()
    return "fma" in flags and ("avx2" in flags or "avx512f" in flags)


@functools.cache
def enabled() -> bool:
    """Whether float32 models' layer products go to the kernel in this process: the CPU
    backend, FMA, and a kernel that builds. Logged once."""
    if jax.default_backend() != "cpu":
        return False
    if not supported():
        logger.info("float32 layer products: XLA's (this CPU has no FMA with AVX2).")
        return False
    try:
        KERNEL.load()
        GATED.load()
    except CpuKernelUnavailable as e:
        logger.warning("float32 layer products: XLA's (the kernel is unavailable: %s).", e)
        return False
    logger.info(
        "float32 layer products and LM head: the C++ kernel%s.",
        " (bf16 ones too, widened to float32)" if widens_bf16() else "",
    )
    return True


def applies(dtype) -> bool:
    """Whether a model of activation dtype `dtype` runs its layer products and LM head on the
    kernel here: `enabled`, no mesh of several devices (checked at trace time), and float32,
    or bfloat16 on a CPU whose bf16 products have nothing better (`widens_bf16`)."""
    dtype = jnp.dtype(dtype)
    if not (one_device() and tracing_for_cpu()):  # a mesh, or a lowering for TPU or CUDA
        return False
    if dtype == jnp.bfloat16:
        return widens_bf16() and enabled()
    return dtype == jnp.float32 and enabled()


def widens_bf16() -> bool:
    """Whether bfloat16 models' products come here, widened to float32: on a CPU without
    AVX512-BF16 (whose bf16 kernel, bf16_matmul.py, takes them) and without AMX (whose tile
    instructions XLA's products use). Without either, XLA's bf16 products convert their
    operands to float32 too, after copying each layer's weights out of the stack."""
    flags = cpu_flags()
    return "avx512_bf16" not in flags and "amx_bf16" not in flags


DTYPES = (jnp.float32, jnp.bfloat16)


def _check(x, w, out_dtype, transposed: bool):
    """The result's dtype (default x's), once the operands are ones the kernel takes."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    for name, dtype in (("x", x.dtype), ("w", w.dtype), ("the result", out_dtype)):
        if dtype not in DTYPES:
            raise ValueError(f"f32_matmul takes float32 or bfloat16 {name}, got {dtype}")
    k_axis = -1 if transposed else -2
    if x.ndim != 2 or w.ndim not in (2, 3) or w.shape[k_axis] != x.shape[1]:
        want = "[L, N, K]" if transposed else "[L, K, N]"
        raise ValueError(f"f32_matmul takes x [M, K] and w {want}, got {x.shape} {w.shape}")
    return out_dtype


def f32_matmul(
    x: jax.Array, w: jax.Array, layer=0, live=None, transposed: bool = False, out_dtype=None
) -> jax.Array:
    """x [M, K] @ w[layer] -> [M, N] in out_dtype (default x's dtype), summed in float32;
    x, w and the result each float32 or bfloat16 (bf16 operands widened exactly, a bf16
    result rounded once to nearest even). w is [L, K, N] (read in place) or [K, N]; layer
    an int or an int32 scalar, traced or not, within [0, L). live: [M] bool or int, the rows
    to compute (a step's padding rows are not); the others come out zero. None: every row.
    transposed: w is [L, N, K] or [N, K] instead (the [Out, In] layout of a tied embedding
    table), and the product is x @ w[layer].T."""
    out_dtype = _check(x, w, out_dtype, transposed)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[-2 if transposed else -1]), out_dtype)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    call = jax.ffi.ffi_call(KERNEL.load(), out)
    invariant = batch_invariant.enabled()  # one summation order for any number of rows
    return call(
        x, w, layer, check_live(x, live), w_transposed=bool(transposed), batch_invariant=invariant
    )


def f32_gated_matmul(
    x: jax.Array, gate: jax.Array, up: jax.Array, layer=0, live=None, out_dtype=None
) -> jax.Array:
    """silu(x @ gate[layer]) * (x @ up[layer]): a gated MLP's first half in one pass, the SiLU
    and product taken on the float32 sums (XLA's path writes both products out, rounded to
    the model's dtype, then runs a separate pass over them). gate and up of one shape and
    dtype, [L, K, N] or [K, N]; otherwise as `f32_matmul`."""
    out_dtype = _check(x, gate, out_dtype, transposed=False)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"f32_gated_matmul: up {up.shape} {up.dtype} is not like gate")
    out = jax.ShapeDtypeStruct((x.shape[0], gate.shape[-1]), out_dtype)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return jax.ffi.ffi_call(GATED.load(), out)(x, gate, up, layer, check_live(x, live))


def gated_reference(x, gate, up, layer=0, out_dtype=None) -> jax.Array:
    """f32_gated_matmul's result through XLA, in float32 until the end."""
    g = reference(x, gate, layer, out_dtype=jnp.float32)
    u = reference(x, up, layer, out_dtype=jnp.float32)
    return (jax.nn.silu(g) * u).astype(out_dtype or x.dtype)


def reference(
    x: jax.Array, w: jax.Array, layer=0, transposed: bool = False, out_dtype=None
) -> jax.Array:
    """f32_matmul's result through XLA: the operands in float32, the result in out_dtype."""
    w = (w[layer] if w.ndim == 3 else w).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), w.T if transposed else w, precision="highest")
    return y.astype(out_dtype or x.dtype)

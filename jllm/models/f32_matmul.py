"""The CPU product of float32 rows and one layer of a stacked float32 weight, read in place.

`f32_matmul.cc` as an XLA FFI call, built once per machine with the CPU attention kernel's
machinery (GCC, cached under ~/.cache/jllm/kernels). The float32 counterpart of
bf16_matmul.py: the model's layer scan hands each `Linear` a `StackedWeight` (layers.py), the
whole [L, ...] weight and the layer index, so that no layer's weights are copied out of the
stack before the product, as XLA's dynamic slice does on every step.

Where it runs (`enabled`, decided once per process and logged): XLA's CPU backend on an x86
CPU with FMA and AVX2 or AVX-512, for float32 models on one device (`applies`), at every
step size: the layer products and the LM head (`transposed`, for a tied embedding table),
each skipping the step's padding rows. Per product it measured 0.94-1.6x XLA's from 1 to
4096 rows on a Zen 3 (`benchmarks/matmul.py --dtype float32`; level at 2048-4096 rows, ahead
below, and ahead wherever a step has padding rows, which XLA's products compute).

Glossary: M rows, K inputs, N outputs, L layers.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

from jllm.models.bf16_matmul import check_live, one_device
from pallas_kernels.ragged_paged_attention.cpu import CpuKernelUnavailable, FfiKernel, cpu_flags

logger = logging.getLogger("jllm")

SOURCE = os.path.join(os.path.dirname(__file__), "f32_matmul.cc")
KERNEL = FfiKernel(
    SOURCE, "f32_matmul", "CPU float32 matmul kernel", "JllmF32Matmul", "jllm_f32_matmul_cpu"
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
    except CpuKernelUnavailable as e:
        logger.warning("float32 layer products: XLA's (the kernel is unavailable: %s).", e)
        return False
    logger.info("float32 layer products and LM head: the C++ kernel.")
    return True


def applies(dtype) -> bool:
    """Whether a model of activation dtype `dtype` runs its layer products and LM head on the
    kernel here: float32, `enabled`, and no mesh of several devices (checked at trace
    time)."""
    return jnp.dtype(dtype) == jnp.float32 and enabled() and one_device()


def f32_matmul(
    x: jax.Array, w: jax.Array, layer=0, live=None, transposed: bool = False
) -> jax.Array:
    """x [M, K] @ w[layer] -> [M, N] float32; w is [L, K, N] (read in place) or [K, N];
    layer an int or an int32 scalar, traced or not, within [0, L). live: [M] bool or int, the
    rows to compute (a step's padding rows are not); the others come out zero. None: every
    row. transposed: w is [L, N, K] or [N, K] instead (the [Out, In] layout of a tied
    embedding table), and the product is x @ w[layer].T."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"f32_matmul takes float32 x and w, got {x.dtype} and {w.dtype}")
    k_axis = -1 if transposed else -2
    if x.ndim != 2 or w.ndim not in (2, 3) or w.shape[k_axis] != x.shape[1]:
        want = "[L, N, K]" if transposed else "[L, K, N]"
        raise ValueError(f"f32_matmul takes x [M, K] and w {want}, got {x.shape} {w.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[-2 if transposed else -1]), jnp.float32)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    call = jax.ffi.ffi_call(KERNEL.load(), out)
    return call(x, w, layer, check_live(x, live), w_transposed=bool(transposed))


def reference(x: jax.Array, w: jax.Array, layer=0, transposed: bool = False) -> jax.Array:
    """f32_matmul's result through XLA."""
    w = w[layer] if w.ndim == 3 else w
    return jnp.dot(x, w.T if transposed else w, precision=jax.lax.Precision.HIGHEST)

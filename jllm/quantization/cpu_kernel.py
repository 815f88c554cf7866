"""The CPU product of a few rows and a QuantizedWeight: `pallas_kernels/cpu/quantized_matmul.cc`
as an FFI call.

XLA's CPU backend unpacks 4-bit codes and converts fp8 with scalar code (weights.py), so a
decode step, which multiplies a few rows by every weight, is slower from quantized weights
than from bf16 ones. The kernel reads the codes in place and dequantizes them in registers.
It is built by the CPU kernels' machinery (pallas_kernels/cpu/build.py: GCC, once per
machine, cached), used for steps of at most `MAX_ROWS` rows on one device; larger steps are
bound by arithmetic and keep XLA's product.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import INCLUDE, CpuKernelUnavailable, FfiKernel, tracing_for_cpu

TARGET = "jllm_quantized_matmul_cpu"
SOURCE = os.path.join(INCLUDE, "quantized_matmul.cc")
MAX_ROWS = 16
KINDS = {"int8": 0, "uint4": 1, "fp8": 2}

KERNEL = FfiKernel(
    SOURCE,
    "quantized_matmul",
    "CPU quantized matmul kernel",
    "JllmQuantizedMatmul",
    TARGET,
    warn=True,
)


def applies(x: jax.Array, w) -> bool:
    """Whether `matmul` takes the kernel: CPU, one device, at most MAX_ROWS float32/bf16
    rows, groups of whole 16-input chunks, and a kernel that could be built."""
    if not tracing_for_cpu() or x.ndim != 2 or x.shape[0] > MAX_ROWS:
        return False
    if x.dtype not in (jnp.float32, jnp.bfloat16) or w.codes.ndim != 2 or w.kind not in KINDS:
        return False
    if w.group % 16 or w.shape[-2] % 4 or (w.kind == "uint4" and w.pack not in (32, 64)):
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return False
    try:
        KERNEL.load()
    except CpuKernelUnavailable:
        return False
    return True


def cpu_matmul(x: jax.Array, w, out_dtype) -> jax.Array:
    """x [T, In] @ w.T -> [T, Out]: weights.matmul's contract, through the kernel."""
    t, out = x.shape[0], w.shape[-2]
    codes = w.codes  # read as bytes whatever their dtype (a bitcast here is an XLA loop)
    scale = w.scale.astype(jnp.float32)
    offset = jnp.zeros((1, 1), jnp.float32) if w.offset is None else w.offset.astype(jnp.float32)
    call = jax.ffi.ffi_call(KERNEL.load(), jax.ShapeDtypeStruct((t, out), jnp.float32))
    y = call(
        x,
        codes,
        scale,
        offset,
        kind=np.int64(KINDS[w.kind]),
        pack=np.int64(w.pack),
        has_offset=np.int64(w.offset is not None),
    )
    return y.astype(out_dtype)

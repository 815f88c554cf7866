"""The CPU product of bfloat16 rows and one layer of a stacked bfloat16 weight, read in place.

`pallas_kernels/cpu/bf16_matmul.cc` as an XLA FFI call, built once per machine by the CPU
kernels' machinery (pallas_kernels/cpu/build.py: GCC, cached under ~/.cache/jllm/kernels).
The model's layer scan hands each `Linear` of a layer a `StackedWeight` (layers.py): the
whole [L, ...] weight and the layer index, so no layer's weights are copied out of the stack
before the product, as XLA's dynamic slice does on every step.

Where it runs (`enabled`, decided once per process and logged): XLA's CPU backend on an x86
CPU with AVX512-BF16 and without AMX, for bfloat16 models on one device. Measured on the
2-core Zen 4 (AVX512-BF16, no AMX), SmolLM2's layer products, one call each
(`benchmarks/matmul.py`, one layer of a 30-layer stack): 219-364 GFLOP/s at 64 rows against
XLA's 96-159 (its dynamic slice of the layer, then the product), 329-406 at 2048 rows against
298-346. With AMX, XLA's products use the tile instructions (bf16 ran 4x
float32 at 2048 rows on a 2-core Xeon), which this loop does not: XLA keeps them there.
Under a mesh of several devices the products stay XLA's, which shards them.

An engine of one device packs its stacked projections once (models/packing.py) into the
panels the kernel reads (`pack`); `bf16_matmul_packed` and `bf16_gated_matmul_packed` take
them, and nothing is packed per call.

Glossary: M rows, K inputs, N outputs, L layers.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

from jllm.config import batch_invariant
from pallas_kernels.cpu.build import (
    EXACT_ORDER,
    INCLUDE,
    CpuKernelUnavailable,
    FfiKernel,
    cpu_flags,
    tracing_for_cpu,
)

logger = logging.getLogger("jllm")

SOURCE = os.path.join(INCLUDE, "bf16_matmul.cc")
# Without the tile instructions (`-mno-amx-tile`): the batch-invariant mode's build on an AMX
# CPU, whose rows take one summation order at any row count.
NO_AMX = ("-mno-amx-tile",)
KERNEL = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 matmul kernel",
    "JllmBf16Matmul",
    "jllm_bf16_matmul_cpu",
    extra_flags=EXACT_ORDER,
)
GATED = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 gated matmul kernel",
    "JllmBf16GatedMatmul",
    "jllm_bf16_gated_matmul_cpu",
    extra_flags=EXACT_ORDER,
)
KERNEL_NO_AMX = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 matmul kernel without AMX",
    "JllmBf16Matmul",
    "jllm_bf16_matmul_no_amx_cpu",
    extra_flags=EXACT_ORDER + NO_AMX,
)
GATED_NO_AMX = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 gated matmul kernel without AMX",
    "JllmBf16GatedMatmul",
    "jllm_bf16_gated_matmul_no_amx_cpu",
    extra_flags=EXACT_ORDER + NO_AMX,
)
# Weights packed once (`pack`) into the panels the products read: nothing packed per call.
PACKED = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 matmul kernel",
    "JllmBf16MatmulPacked",
    "jllm_bf16_matmul_packed_cpu",
    extra_flags=EXACT_ORDER,
)
GATED_PACKED = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 gated matmul kernel",
    "JllmBf16GatedMatmulPacked",
    "jllm_bf16_gated_matmul_packed_cpu",
    extra_flags=EXACT_ORDER,
)
PACKED_NO_AMX = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 matmul kernel without AMX",
    "JllmBf16MatmulPacked",
    "jllm_bf16_matmul_packed_no_amx_cpu",
    extra_flags=EXACT_ORDER + NO_AMX,
)
GATED_PACKED_NO_AMX = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 gated matmul kernel without AMX",
    "JllmBf16GatedMatmulPacked",
    "jllm_bf16_gated_matmul_packed_no_amx_cpu",
    extra_flags=EXACT_ORDER + NO_AMX,
)
# w transposed (a tied embedding table as the LM head): the AMX tiles, or the vector loop.
TRANSPOSED = FfiKernel(
    SOURCE,
    "bf16_matmul",
    "CPU bf16 transposed matmul kernel",
    "JllmBf16MatmulTransposed",
    "jllm_bf16_matmul_transposed_cpu",
    extra_flags=EXACT_ORDER,
)


def kernels(invariant: bool, packed: bool = False) -> tuple[FfiKernel, FfiKernel]:
    """The plain and gated kernels of a mode: with AMX where the CPU has it, except in the
    batch-invariant mode (the tiles' sums differ from the vector loop's, and which one a row
    takes depends on how many rows its step has); `packed`: those of `pack`ed weights."""
    no_amx = invariant and "amx_bf16" in cpu_flags()
    if packed:
        return (PACKED_NO_AMX, GATED_PACKED_NO_AMX) if no_amx else (PACKED, GATED_PACKED)
    return (KERNEL_NO_AMX, GATED_NO_AMX) if no_amx else (KERNEL, GATED)


def supported() -> bool:
    """Whether this CPU can run the kernel at all (AVX512-BF16)."""
    return "avx512_bf16" in cpu_flags()


@functools.cache
def enabled(invariant: bool = False) -> bool:
    """Whether bfloat16 models' layer products go to the kernel in this process: the CPU
    backend, AVX512-BF16 (its products of 5 rows and more on the AMX tiles where the CPU
    has them, outside the batch-invariant mode, `invariant`), and a kernel that builds.
    Logged once."""
    if jax.default_backend() != "cpu":
        return False
    flags = cpu_flags()
    if "avx512_bf16" not in flags:
        logger.info("bf16 layer products: XLA's (this CPU has no AVX512-BF16).")
        return False
    try:
        for kernel in kernels(invariant):
            kernel.load()
    except CpuKernelUnavailable as e:
        logger.warning("bf16 layer products: XLA's (the kernel is unavailable: %s).", e)
        return False
    if "amx_bf16" not in flags:
        how = "AVX512-BF16"
    elif invariant:
        how = "AVX512-BF16 without AMX, batch-invariant mode"
    else:
        how = "AMX tiles from 5 rows, AVX512-BF16 below"
    logger.info("bf16 layer products: the C++ kernel (%s).", how)
    return True


# Rows up to which a tied head is the transposed kernel's. Measured on the 2-core AMX Xeon,
# SmolLM2's table [49152, 576] (benchmarks/matmul.py --head): 1 row 1.3 ms against XLA's 31.7
# (its one-row product), 32 rows 2.4-2.6 against 3.8-4.4, 64 rows 4.6-6.9 against 6.0-6.7, 128
# rows 10.6 against 9.9; with the B tiles and accumulators in whole cache lines, in
# one run on a slower state of the machine, 64 rows 10.4-14.4 against 14.7-17.1, 128 rows 24.2
# against 19.3: a decode batch of 64 (W1's) gains, 128 loses.
HEAD_ROWS = 64
# Without AMX the kernel's vector loop takes the head (x's rows as the lanes, the table read in
# place) and computes only a step's live sample rows. On the 2-core Zen 5, SmolLM2's table
# (benchmarks/matmul.py --head), against XLA's: 16 rows 1.9 ms against 2.8, 64 rows 4.2
# against 5.8, 128 rows 8.7 against 9.4, 256 rows 16.3 against 16.1; with 55% of the rows
# live (a step's sample rows padded to a bucket) 256 rows 10.6 against 16.1.
HEAD_ROWS_VECTOR = 256


def head_applies(dtype, rows: int) -> bool:
    """Whether a tied bfloat16 LM head of `rows` rows runs on the transposed kernel here:
    `applies`, outside the batch-invariant mode, at most HEAD_ROWS rows on the AMX tiles or
    HEAD_ROWS_VECTOR on the vector loop (AVX512-BF16 without AMX); elsewhere the head stays
    XLA's."""
    if not applies(dtype) or batch_invariant.enabled():
        return False
    if rows > (HEAD_ROWS if "amx_bf16" in cpu_flags() else HEAD_ROWS_VECTOR):
        return False
    try:
        TRANSPOSED.load()
    except CpuKernelUnavailable:
        return False
    return True


def applies(dtype) -> bool:
    """Whether a model of activation dtype `dtype` runs its layer products on the kernel
    here: bfloat16, `enabled`, and no mesh of several devices nor a lowering for another
    platform (checked at trace time)."""
    if jnp.dtype(dtype) != jnp.bfloat16 or not (one_device() and tracing_for_cpu()):
        return False
    return enabled(batch_invariant.enabled())


def one_device() -> bool:
    """Whether the computation being traced runs on one device (no mesh, or a mesh of one,
    counting only the axes not already split by hand: a data shard's step inside its
    `shard_map`, runner/data_parallel.py, sees its whole operands): the layer-product
    kernels see whole operands only there."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    manual = set(getattr(mesh, "manual_axes", ()))
    return all(n == 1 for axis, n in mesh.shape.items() if axis not in manual)


def _check(x, w, out_dtype):
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"bf16_matmul takes bfloat16 x and w, got {x.dtype} and {w.dtype}")
    if x.ndim != 2 or w.ndim not in (2, 3) or w.shape[-2] != x.shape[1]:
        raise ValueError(f"bf16_matmul takes x [M, K] and w [L, K, N], got {x.shape} {w.shape}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"bf16_matmul writes bfloat16 or float32, not {out_dtype}")
    return jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), out_dtype)


def check_live(x, live) -> jax.Array:
    """live as the kernels take it: [M] int8, or [0] for every row."""
    if live is None:
        return jnp.zeros((0,), jnp.int8)
    if live.shape != (x.shape[0],):
        raise ValueError(f"live must be [M] = [{x.shape[0]}], got {live.shape}")
    return live.astype(jnp.int8)


def bf16_matmul(
    x: jax.Array, w: jax.Array, layer=0, out_dtype=jnp.bfloat16, live=None, transposed=False
) -> jax.Array:
    """x [M, K] @ w[layer] -> [M, N] in out_dtype (bfloat16 or float32), accumulated in
    float32; w is [L, K, N] (read in place) or [K, N]; layer an int or an int32 scalar,
    traced or not, within [0, L). live: [M] bool or int, the rows to compute (a step's
    padding rows are not); the others come out zero. None: every row. transposed: w is
    [L, N, K] or [N, K] (a tied embedding table), on the AMX tiles only (`head_applies`)."""
    if transposed:
        flipped = jax.ShapeDtypeStruct((*w.shape[:-2], w.shape[-1], w.shape[-2]), w.dtype)
        out = _check(x, flipped, out_dtype)
        target = TRANSPOSED.load()
    else:
        out = _check(x, w, out_dtype)
        target = kernels(batch_invariant.enabled())[0].load()
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return jax.ffi.ffi_call(target, out)(x, w, layer, check_live(x, live))


def bf16_gated_matmul(
    x: jax.Array, gate: jax.Array, up: jax.Array, layer=0, out_dtype=jnp.bfloat16, live=None
) -> jax.Array:
    """silu(x @ gate[layer]) * (x @ up[layer]): a gated MLP's first half in one pass, the
    SiLU and product taken on the float32 accumulators (XLA's path rounds both products to
    bf16 first, then runs a separate pass over them). gate and up of one shape."""
    out = _check(x, gate, out_dtype)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"bf16_gated_matmul: up {up.shape} {up.dtype} is not like gate")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    target = kernels(batch_invariant.enabled())[1].load()
    return jax.ffi.ffi_call(target, out)(x, gate, up, layer, check_live(x, live))


# Packed weights: each 32-column panel of a [K, N] weight as the AMX tiles' B operand and the
# vector loop's pairs take it: two halves of 16 columns, each Kp / 2 rows of the 16 pairs
# (w[2 k2][n], w[2 k2 + 1][n]), Kp = K padded to 32, zeros past K and N. [L, K, N] packs to
# [L, ceil(N / 32), 2, Kp / 2, 32]. The products read it as it lies, where a [K, N] weight is
# packed by every call (on the AMX tiles) or interleaved pair by pair (the vector loop).
PANEL = 32


def pack(w: jax.Array) -> jax.Array:
    """w [..., K, N] (bfloat16) in the packed panels: [..., ceil(N / 32), 2, Kp / 2, 32]."""
    *lead, K, N = w.shape
    Kp, P = -(-K // PANEL) * PANEL, -(-N // PANEL)
    n = len(lead)
    w = jnp.pad(w, [(0, 0)] * n + [(0, Kp - K), (0, P * PANEL - N)])
    w = w.reshape(*lead, Kp // 2, 2, P, 2, PANEL // 2)  # k2, pair, panel, half, column
    w = jnp.transpose(w, (*range(n), n + 2, n + 3, n, n + 4, n + 1))
    return w.reshape(*lead, P, 2, Kp // 2, PANEL)


def unpack(packed: jax.Array, k: int, n: int) -> jax.Array:
    """`pack`'s inverse: [..., P, 2, Kp / 2, 32] -> [..., k, n]."""
    *lead, P, _, half_k, _ = packed.shape
    m = len(lead)
    w = packed.reshape(*lead, P, 2, half_k, PANEL // 2, 2)
    w = jnp.transpose(w, (*range(m), m + 2, m + 4, m, m + 1, m + 3))
    return w.reshape(*lead, 2 * half_k, P * PANEL)[..., :k, :n]


def _check_packed(x, w, n: int, out_dtype):
    k = x.shape[1] if x.ndim == 2 else -1
    want = (-(-n // PANEL), 2, -(-k // PANEL) * PANEL // 2, PANEL)
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"bf16_matmul takes bfloat16 x and w, got {x.dtype} and {w.dtype}")
    if x.ndim != 2 or w.ndim not in (4, 5) or tuple(w.shape[-4:]) != want:
        raise ValueError(
            f"a packed bf16_matmul takes x [M, K] and w [L, {', '.join(map(str, want))}] "
            f"(`pack` of [L, K, {n}]), got {x.shape} {w.shape}"
        )
    return _check(x, jax.ShapeDtypeStruct((k, n), w.dtype), out_dtype)


def bf16_matmul_packed(x, w, n: int, layer=0, out_dtype=jnp.bfloat16, live=None) -> jax.Array:
    """`bf16_matmul` of a `pack`ed weight w ([L, ...] or one layer's) of n output columns.
    x's K is the weight's: the packed shape holds K only padded to 32."""
    out = _check_packed(x, w, n, out_dtype)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    target = kernels(batch_invariant.enabled(), packed=True)[0].load()
    return jax.ffi.ffi_call(target, out)(x, w, layer, check_live(x, live))


def bf16_gated_matmul_packed(
    x, gate, up, n: int, layer=0, out_dtype=jnp.bfloat16, live=None
) -> jax.Array:
    """`bf16_gated_matmul` of `pack`ed gate and up weights of n output columns."""
    out = _check_packed(x, gate, n, out_dtype)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"bf16_gated_matmul: up {up.shape} {up.dtype} is not like gate")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    target = kernels(batch_invariant.enabled(), packed=True)[1].load()
    return jax.ffi.ffi_call(target, out)(x, gate, up, layer, check_live(x, live))


def reference(x: jax.Array, w: jax.Array, layer=0, out_dtype=jnp.bfloat16) -> jax.Array:
    """bf16_matmul's result through XLA: the same float32 accumulation of bf16 products."""
    w = w[layer] if w.ndim == 3 else w
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def gated_reference(x, gate, up, layer=0, out_dtype=jnp.bfloat16) -> jax.Array:
    """bf16_gated_matmul's result through XLA, in float32 until the end."""
    g, u = reference(x, gate, layer, jnp.float32), reference(x, up, layer, jnp.float32)
    return (jax.nn.silu(g) * u).astype(out_dtype)

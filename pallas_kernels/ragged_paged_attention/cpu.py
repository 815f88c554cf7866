"""The CPU flavour of the kit: ragged paged attention as a C++ XLA FFI custom call.

Pallas has no CPU backend (only interpret mode), and XLA's own CPU attention spends most of
its time gathering pages and transposing them for small batched matmuls. This kernel
(``cpu_kernel.cc``) reads each request's pages in place and keeps the online softmax in
float32 registers. It is built once per machine and cached by the CPU kernels' machinery
(``pallas_kernels/cpu/build.py``).

It takes the whole stacked cache ``[L, B, S, 2K, H]`` and a layer index rather than one
layer's slice, so that a model's scan over layers never copies a layer out of the cache.
Same arguments and results as ``ragged_paged_attention_reference`` otherwise, ``q_horizon``
included: without one the kernel gets an empty buffer in its place and attends causally.
Attention sinks (gpt-oss's ``sinks`` [N], one logit per query head) go in as float32, or as
an empty buffer when there are none; each query head's online softmax then starts from its
sink (running max sinks[n], denominator 1) in every one of the kernel's routines.
MLA's latent cache (``latent=True``: ``[L, B, S, H]``, one vector per token whose first
``v_head_dim`` lanes are its value) goes through the kernel's prefill routine for every row,
its query heads the lanes of one key stream.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..cpu.build import CpuKernelUnavailable, FfiKernel
from .cache import is_fp8_cache
from .validation import stacked_and_checked, validate_options, validate_sinks

__all__ = [
    "CpuKernelUnavailable",
    "load_cpu_kernel",
    "ragged_paged_attention_cpu",
    "ragged_paged_attention_cpu_sharded",
]

TARGET = "jllm_ragged_paged_attention_cpu"
SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernel.cc")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
ATTENTION = FfiKernel(
    SOURCE, "ragged_paged_attention", "CPU attention kernel", "JllmRaggedPagedAttention", TARGET
)


def load_cpu_kernel() -> str:
    """Builds (once per machine) and registers the kernel; returns the FFI target name.

    Raises CpuKernelUnavailable when there is no C++ compiler or the build fails.
    """
    return ATTENTION.load()


def _checked_args(q, kv_cache, layer, metadata, fp8_dtype, latent=False, v_head_dim=None):
    """Validates the arguments and returns them as the FFI call takes them: q, the stacked
    cache, the layer as int32 [1], then `metadata` (kv_lens, block_tables, query_start,
    query_lens, num_seqs) with num_seqs as int32 [1]."""
    kv_cache, layer = stacked_and_checked(
        q, kv_cache, layer, metadata, fp8_dtype, latent, v_head_dim
    )
    fp8 = is_fp8_cache(kv_cache.dtype, fp8_dtype)
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES or not (fp8 or q.dtype == kv_cache.dtype):
        raise ValueError(
            f"the CPU kernel takes float32 or bfloat16 q and a kv_cache of q's dtype or a "
            f"float8 one, got q {q.dtype} and kv_cache {kv_cache.dtype}"
        )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    *metadata, num_seqs = metadata
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(1)
    return q, kv_cache, layer, *metadata, num_seqs


def _horizon(q, q_horizon) -> jax.Array:
    """q_horizon checked, as the FFI call's last argument: int32 [T], or [0] for None."""
    if q_horizon is None:
        return jnp.zeros((0,), jnp.int32)
    shape, dtype = getattr(q_horizon, "shape", None), getattr(q_horizon, "dtype", None)
    if shape != (q.shape[0],) or dtype != jnp.int32:
        raise ValueError(
            f"q_horizon must be int32 [T={q.shape[0]}] (one per row of q), got "
            f"{dtype}{list(shape) if shape is not None else type(q_horizon).__name__}"
        )
    return q_horizon


def _sinks(q, sinks, latent) -> jax.Array:
    """sinks checked, as the FFI call's argument after q_horizon: float32 [N], or [0] for
    None."""
    if sinks is None:
        return jnp.zeros((0,), jnp.float32)
    validate_sinks(sinks, q.shape[1], latent)
    return sinks.astype(jnp.float32)


def _options(
    q, sm_scale, sliding_window, soft_cap, batch_invariant=False, v_head_dim=None, chunk_size=None
) -> dict:
    """The checked options as the kernel's attributes (0 for an option that is off)."""
    validate_options(sm_scale, sliding_window, soft_cap, chunk_size=chunk_size)
    return dict(
        sm_scale=np.float32(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        batch_invariant=bool(batch_invariant),
        v_head_dim=np.int64(v_head_dim or 0),
        chunk_size=np.int64(chunk_size or 0),
    )


# The float8 format of a uint8 cache, as the kernel's `fp8` attribute (0: not float8 bytes).
FP8_FORMATS = {jnp.dtype(jnp.float8_e4m3fn): 1, jnp.dtype(jnp.float8_e5m2): 2}


def _call(*args, fp8_dtype=None, **options):
    """The FFI call on checked arguments (q first) with `_options`' attributes: [T, N, Hv]."""
    q = args[0]
    fp8 = np.int64(0 if fp8_dtype is None else FP8_FORMATS[jnp.dtype(fp8_dtype)])
    shape = (*q.shape[:2], int(options["v_head_dim"]) or q.shape[2])
    return jax.ffi.ffi_call(load_cpu_kernel(), jax.ShapeDtypeStruct(shape, q.dtype))(
        *args, fp8=fp8, **options
    )


def ragged_paged_attention_cpu(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start: jax.Array,
    query_lens: jax.Array,
    num_seqs,
    *,
    layer=None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    fp8_dtype=None,
    q_horizon: jax.Array | None = None,
    batch_invariant: bool = False,
    latent: bool = False,
    v_head_dim: int | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Ragged paged attention on the CPU; the reference's arguments and result.

    kv_cache is one layer [B, S, 2K, H], or the stacked cache [L, B, S, 2K, H] with `layer`
    (an int or an int32 scalar array, traced or not) picking the layer to read; of q's
    dtype, or float8 (an array of that dtype, or uint8 bytes with `fp8_dtype`). With a
    sliding window only the pages inside it are read. q_horizon [T] int32: the last key
    each query sees where later than its own position (None: causal), as in the reference.
    batch_invariant: every query through one routine (a decode row's too), so that a query's
    result does not depend on the rows beside it or on whether it decodes.
    latent (MLA): kv_cache is the latent cache [L, B, S, H] (or [B, S, H]) whose first
    ``v_head_dim`` lanes are the values; the result is [T, N, v_head_dim].
    sinks [N] (gpt-oss): each query head's sink logit, as in the reference; none with a latent.
    chunk_size C (Llama 4): a query at position p sees keys from floor(p / C) * C.
    """
    metadata = (kv_lens, block_tables, query_start, query_lens, num_seqs)
    args = _checked_args(q, kv_cache, layer, metadata, fp8_dtype, latent, v_head_dim)
    options = _options(
        q, sm_scale, sliding_window, soft_cap, batch_invariant, v_head_dim, chunk_size
    )
    extra = (_horizon(q, q_horizon), _sinks(q, sinks, latent))
    return _call(*args, *extra, fp8_dtype=fp8_dtype, **options)


def ragged_paged_attention_cpu_sharded(
    mesh,
    axis: str,
    q,
    kv_cache,
    layer,
    kv_lens,
    block_tables,
    query_start,
    query_lens,
    num_seqs,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    fp8_dtype=None,
    q_horizon=None,
    batch_invariant: bool = False,
    latent: bool = False,
    v_head_dim: int | None = None,
    sinks=None,
    chunk_size: int | None = None,
):
    """The CPU kernel with heads split over `mesh` axis `axis` (as in sharded.py): each device
    runs it on its own query heads and kv heads; kv_cache is the stacked cache (a latent
    cache replicated: every device reads all of it for its own heads). The metadata,
    q_horizon included, is replicated; sinks are split with q's heads."""
    metadata = (kv_lens, block_tables, query_start, query_lens, num_seqs)
    args = _checked_args(q, kv_cache, layer, metadata, fp8_dtype, latent, v_head_dim)
    options = _options(
        q, sm_scale, sliding_window, soft_cap, batch_invariant, v_head_dim, chunk_size
    )
    heads = P(None, axis, None)
    replicated = (P(),) * 7
    cache = P() if latent else P(None, None, None, axis, None)
    sink_spec = P() if sinks is None else P(axis)  # the empty buffer goes whole to each device
    return jax.shard_map(
        functools.partial(_call, fp8_dtype=fp8_dtype, **options),
        mesh=mesh,
        in_specs=(heads, cache, *replicated, sink_spec),
        out_specs=heads,
        check_vma=False,
    )(*args, _horizon(q, q_horizon), _sinks(q, sinks, latent))

"""Ragged paged attention kit: one kernel for mixed prefill + decode over a flat batch.

``ragged_paged_attention`` is the Pallas TPU kernel (``interpret=True`` runs it on CPU),
``ragged_paged_attention_gpu`` the same contract in Pallas on Triton for GPUs (likewise),
``ragged_paged_attention_reference`` the pure-jnp oracle it is tested against. Every
flavour takes attention sinks (``sinks`` [N], gpt-oss's); the reference alone also takes
chunked local attention and values narrower than the keys (the oracle of jllm's XLA
attention, until the kernels have them). MLA's latent cache
``[B, S, H]`` (``latent_cache_shape``; ``latent=True, v_head_dim=``) is taken by the
reference and the two Pallas kernels,
``validate_inputs`` the shared static checks, ``kv_cache_shape`` the cache layout
``[B, S, 2K, H]`` (K and V interleaved on the head axis; the queries' float dtype or a
float8 format, ``FP8_DTYPES``, as that dtype or as its bytes with ``fp8_dtype=``; written
with ``to_cache``, read with ``from_cache``) and
``ragged_paged_attention_sharded`` the kernel under ``shard_map`` over the head axes.
``ragged_paged_attention_cpu`` is the same contract as a C++ XLA FFI kernel for the CPU
(built on first use; ``load_cpu_kernel``), with its own ``..._cpu_sharded``.
"""

from .cache import (
    FP8_DTYPES,
    check_fp8_dtype,
    from_cache,
    is_fp8_cache,
    kv_cache_bytes,
    kv_cache_shape,
    latent_cache_shape,
    to_cache,
)
from .cpu import (
    SUPPORTED_DTYPES,
    CpuKernelUnavailable,
    load_cpu_kernel,
    ragged_paged_attention_cpu,
    ragged_paged_attention_cpu_sharded,
)
from .gpu import ragged_paged_attention_gpu, unsupported_shape
from .kernel import ragged_paged_attention
from .reference import ragged_paged_attention_reference
from .sharded import ragged_paged_attention_sharded
from .validation import validate_inputs, validate_options

__all__ = [
    "FP8_DTYPES",
    "SUPPORTED_DTYPES",
    "CpuKernelUnavailable",
    "load_cpu_kernel",
    "ragged_paged_attention_cpu",
    "ragged_paged_attention_cpu_sharded",
    "kv_cache_bytes",
    "kv_cache_shape",
    "latent_cache_shape",
    "check_fp8_dtype",
    "from_cache",
    "is_fp8_cache",
    "to_cache",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_sharded",
    "unsupported_shape",
    "validate_inputs",
    "validate_options",
]

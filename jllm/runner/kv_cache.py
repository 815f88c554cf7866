"""How many KV blocks fit, and the stacked cache array itself.

On TPU/GPU the cache takes `gpu_memory_utilization` of device memory less what the weights
use and what the largest step needs on top (the runner's `profile_step_bytes`: XLA's
memory analysis of the largest bucket, compiled against a stand-in cache). As in vLLM, the
utilization is a share of the whole device: on GPU, JAX's allocator holds only
`allocator_fraction()` of it (jllm raises JAX's default 0.75 to 0.95 at import, see
`jllm/__init__.py`), and the cache never asks for more than that limit. On CPU (no
memory stats) it takes an explicit size, `kv_cache_memory_bytes` (vLLM's CPU backend reads
VLLM_CPU_KVCACHE_SPACE; default 4 GiB).
`num_gpu_blocks_override` wins over both.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jllm.config import DEFAULT_CPU_KV_CACHE_BYTES
from pallas_kernels.ragged_paged_attention import kv_cache_shape
from sharding import named_sharding

logger = logging.getLogger(__name__)

CACHE_AXES = ("layers", "cache_blocks", "cache_slots", "cache_kv_heads", "head_dim")


@dataclass(frozen=True)
class CacheSpec:
    """One KV-cache group's stacked cache: how many layers it holds, their K/V heads, and
    their sliding window (None: full attention)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None

    @classmethod
    def groups_of(cls, module, cfg) -> tuple[CacheSpec, ...]:
        """The caches of a decoder `module` (models/decoder.py) of config `cfg`: one per
        KV-cache group."""
        return tuple(
            cls(len(g.layers), cfg.num_kv_heads, cfg.head_dim, g.window)
            for g in module.kv_cache_groups(cfg)
        )


def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
    return num_layers * block_size * 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def allocator_fraction(platform: str) -> float:
    """The share of a device's memory that JAX's allocator may use (its `bytes_limit`): on
    GPU, XLA_CLIENT_MEM_FRACTION (or the older XLA_PYTHON_CLIENT_MEM_FRACTION), else XLA's
    default 0.75; elsewhere the whole device."""
    if platform != "gpu":
        return 1.0
    value = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION"
    )
    return float(value) if value else 0.75


def determine_num_blocks(
    per_block: int,
    *,
    override: int | None,
    memory_bytes: int | None,
    utilization: float,
    step_bytes,
    stats: dict | None = None,
    fraction: float = 1.0,
) -> int:
    """`step_bytes()`: what the largest step needs, only asked when sizing from device
    memory. `stats`: the device's memory stats (default: the first device's). `fraction`:
    the share of the device the stats' `bytes_limit` is (`allocator_fraction`)."""
    if override is not None:
        return override
    if memory_bytes is None:
        stats = (jax.devices()[0].memory_stats() or {}) if stats is None else stats
        limit = stats.get("bytes_limit")
        if limit:
            used = stats.get("bytes_in_use", 0)
            activation_bytes = step_bytes()
            logger.info(
                "Memory profile: %.2f GiB in use (weights), the largest step needs %.2f GiB.",
                used / 2**30,
                activation_bytes / 2**30,
            )
            budget = min(int(limit / fraction * utilization), limit)
            if utilization > fraction:
                logger.warning(
                    "JAX's allocator may use %.2f of the device, less than "
                    "gpu_memory_utilization=%.2f: the KV cache is sized to the allocator's "
                    "limit (XLA_CLIENT_MEM_FRACTION raises it).",
                    fraction,
                    utilization,
                )
            memory_bytes = budget - used - activation_bytes
            if memory_bytes <= 0:
                raise ValueError(
                    "No device memory is left for the KV cache: the weights and activations "
                    f"use {used / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB. Increase "
                    "gpu_memory_utilization or use a smaller model."
                )
        else:
            memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = memory_bytes // per_block
    if num_blocks < 2:
        raise ValueError(
            f"The KV cache memory ({memory_bytes} bytes) holds fewer than 2 blocks of "
            f"{per_block} bytes; give it more memory."
        )
    return int(num_blocks)


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype, platform: str):
    """vLLM's `kv_cache_dtype` as (the cache array's dtype, the float8 format whose bytes it
    holds or None): "auto" is the model's dtype, "fp8" and "fp8_e4m3" float8_e4m3fn,
    "fp8_e5m2" float8_e5m2 (scales 1.0, vLLM's default without `calculate_kv_scales`). On
    the CPU a float8 cache is held as its bytes (uint8): XLA's CPU backend updates float8
    arrays element by element (pallas_kernels/ragged_paged_attention/cache.py)."""
    names = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
    if kv_cache_dtype == "auto":  # other names are refused by EngineArgs (KV_CACHE_DTYPES)
        return jnp.dtype(dtype), None
    kv_dtype = jnp.dtype(names[kv_cache_dtype])
    logger.info(
        "Using %s data type to store kv cache (%s, 1 byte a value, scales 1.0): %dx the tokens "
        "of a %s cache in the same memory.",
        kv_cache_dtype,
        kv_dtype.name,
        jnp.dtype(dtype).itemsize,
        jnp.dtype(dtype).name,
    )
    if platform == "cpu":
        return jnp.dtype(jnp.uint8), kv_dtype.name
    return kv_dtype, None


def abstract_kv_cache(spec: CacheSpec, num_blocks, block_size, dtype, mesh) -> jax.ShapeDtypeStruct:
    """A group's cache's shape, dtype and sharding: [Lg, B, S, 2K, H], each layer's slice the
    kernel's [B, S, 2K, H] page-major layout, sharded on the kv-head axis. Lowering against
    it allocates nothing (the profile); `allocate_kv_cache` makes it real."""
    shape = (
        spec.num_layers,
        *kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim),
    )
    return jax.ShapeDtypeStruct(
        shape, jnp.dtype(dtype), sharding=named_sharding(mesh, CACHE_AXES, shape)
    )


def allocate_kv_cache(spec: jax.ShapeDtypeStruct) -> jax.Array:
    """The zeroed cache described by `spec` (from `abstract_kv_cache`)."""
    return jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=spec.sharding)()


def allocate_kv_caches(specs):
    """`allocate_kv_cache` over a tree of specs (`size_kv_cache`'s), waiting until every
    cache is zeroed: the engine runs it on a thread while it compiles (XLA's CPU backend
    zeroes 4 GiB in about 2 s and releases the GIL meanwhile)."""
    return jax.block_until_ready(
        jax.tree.map(
            allocate_kv_cache, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )
    )


def size_kv_cache(
    models: list[tuple[CacheSpec, ...]],
    *,
    block_size: int,
    tp: int,
    dtype,
    mesh,
    platform: str,
    max_model_len: int,
    override: int | None,
    memory_bytes: int | None,
    utilization: float,
    profile=None,
):
    """Size the caches from memory (per device: they are split on their kv-head axis) and
    log them as vLLM does. `models`: the model's KV-cache groups, then a
    speculative draft model's if any; every group has `num_blocks` blocks.
    `profile(abstract caches) -> bytes`: what the largest step needs
    (`ModelRunner.profile_step_bytes`; with a draft, the pair (target's, draft's)). Returns
    (each model's tuple of group caches, abstract: `allocate_kv_caches` makes them, and
    num_blocks)."""
    specs = [spec for groups in models for spec in groups]
    per_block = sum(
        bytes_per_block(s.num_layers, block_size, s.num_kv_heads // tp, s.head_dim, dtype)
        for s in specs
    )

    def step_bytes():
        small = [tuple(abstract_kv_cache(s, 4, block_size, dtype, mesh) for s in g) for g in models]
        return profile(small[0] if len(small) == 1 else tuple(small))

    num_blocks = determine_num_blocks(
        per_block,
        override=override,
        memory_bytes=memory_bytes,
        utilization=utilization,
        step_bytes=step_bytes,
        fraction=allocator_fraction(platform),
    )
    logger.info(
        "# %s blocks: %d (%.2f GiB KV cache); maximum concurrency for %d tokens per request: %.2fx",
        platform.upper(),
        num_blocks,
        num_blocks * per_block / 2**30,
        max_model_len,
        (num_blocks - 1) * block_size / max_model_len,
    )
    caches = [
        tuple(abstract_kv_cache(s, num_blocks, block_size, dtype, mesh) for s in groups)
        for groups in models
    ]
    return caches, num_blocks

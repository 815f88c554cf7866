"""Shape and dtype helpers for the paged KV cache that the ragged paged attention kernel reads.

One array per layer, page-major: ``[B, S, 2K, H]`` with K and V interleaved on the head
axis (index ``2k`` is key head ``k``, index ``2k + 1`` is value head ``k``).
An MLA layer in its absorbed form caches one latent vector per token instead,
``[B, S, H]`` (``latent_cache_shape``: H = kv_lora_rank + qk_rope_head_dim, no head axis):
the key of one KV head shared by every query head, and in its first kv_lora_rank lanes the
value.

The cache holds the queries' float dtype, or a float8 format (``FP8_DTYPES``, scale 1.0:
vLLM's default k_scale / v_scale), one byte a value. A float8 cache is either an array of
that dtype or, with ``fp8_dtype=`` naming the format, a uint8 array of its bytes: XLA's CPU
backend updates float8 arrays element by element (writing 8 tokens into a 30-layer
SmolLM2-sized cache took 4 s against 0.1 ms for bytes), so the CPU holds bytes. Every flavour
of the kit reads float8 pages into the queries' dtype (``from_cache``); new K/V are written
with ``to_cache``.
"""

import math

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8_cache(cache_dtype, fp8_dtype=None) -> bool:
    """Whether a cache of `cache_dtype` (with `fp8_dtype` for bytes) holds float8 values."""
    return fp8_dtype is not None or jnp.dtype(cache_dtype) in FP8_DTYPES


def check_fp8_dtype(cache_dtype, fp8_dtype) -> None:
    """Raises ValueError unless (cache dtype, fp8_dtype) is a float cache (fp8_dtype None) or
    the bytes of a float8 format (uint8, fp8_dtype one of FP8_DTYPES)."""
    if fp8_dtype is None:
        if jnp.dtype(cache_dtype) == jnp.uint8:
            raise ValueError("a uint8 kv_cache holds float8 bytes: name the format, fp8_dtype=")
        return
    if jnp.dtype(fp8_dtype) not in FP8_DTYPES:
        raise ValueError(
            f"fp8_dtype must be one of {[d.name for d in FP8_DTYPES]}, not {fp8_dtype}"
        )
    if jnp.dtype(cache_dtype) != jnp.uint8:
        raise ValueError(f"fp8_dtype= is for a uint8 kv_cache of float8 bytes, not {cache_dtype}")


def to_cache(x, cache_dtype, fp8_dtype=None):
    """New keys or values in the cache's dtype. float8 conversions saturate at the format's
    largest finite value (as vLLM's fp8 kernels do) instead of overflowing to NaN or inf;
    with `fp8_dtype` the cache holds that format's bytes (uint8)."""
    fmt = jnp.dtype(fp8_dtype or cache_dtype)
    if fmt in FP8_DTYPES:
        top = float(jnp.finfo(fmt).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top).astype(fmt)
        return jax.lax.bitcast_convert_type(x, jnp.uint8) if fp8_dtype is not None else x
    return x.astype(cache_dtype)


def from_cache(x, dtype, fp8_dtype=None):
    """Values read from the cache as `dtype` (a float8 cache's bytes decoded first)."""
    if fp8_dtype is not None:
        x = jax.lax.bitcast_convert_type(x, fp8_dtype)
    return x.astype(dtype)


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Returns the shape ``(B, S, 2K, H)`` of one layer's paged KV cache."""
    b, s, k, h = _positive_ints(
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    return (b, s, 2 * k, h)


def _positive_ints(**values) -> tuple[int, ...]:
    """The values as ints; ValueError naming the first that is not a positive integer."""
    for name, value in values.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return tuple(int(value) for value in values.values())


def latent_cache_shape(num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, int, int]:
    """Returns the shape ``(B, S, H)`` of one MLA layer's latent cache, H = ``latent_dim``."""
    return _positive_ints(num_blocks=num_blocks, block_size=block_size, latent_dim=latent_dim)


def kv_cache_bytes(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype="bfloat16"
) -> int:
    """Returns the size in bytes of one layer's paged KV cache of ``dtype``."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return math.prod(shape) * jnp.dtype(dtype).itemsize

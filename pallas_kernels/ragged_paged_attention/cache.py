"""Shape helpers for the paged KV cache that the ragged paged attention kernel reads.

One array per layer, page-major: ``[B, S, 2K, H]`` with K and V interleaved on the head
axis (index ``2k`` is key head ``k``, index ``2k + 1`` is value head ``k``).
"""

import math

import jax.numpy as jnp


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Returns the shape ``(B, S, 2K, H)`` of one layer's paged KV cache."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return (int(num_blocks), int(block_size), 2 * int(num_kv_heads), int(head_dim))


def kv_cache_bytes(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype="bfloat16"
) -> int:
    """Returns the size in bytes of one layer's paged KV cache of ``dtype``."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return math.prod(shape) * jnp.dtype(dtype).itemsize

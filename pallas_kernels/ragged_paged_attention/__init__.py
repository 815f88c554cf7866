"""Ragged paged attention kit: one kernel for mixed prefill + decode over a flat batch.

``ragged_paged_attention`` is the Pallas TPU kernel (``interpret=True`` runs it on CPU),
``ragged_paged_attention_reference`` the pure-jnp oracle it is tested against,
``validate_inputs`` the shared static checks and ``kv_cache_shape`` the cache layout
``[B, S, 2K, H]`` (K and V interleaved on the head axis).
"""

from .cache import kv_cache_bytes, kv_cache_shape
from .kernel import ragged_paged_attention
from .reference import ragged_paged_attention_reference
from .validation import validate_inputs, validate_options

__all__ = [
    "kv_cache_bytes",
    "kv_cache_shape",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "validate_inputs",
    "validate_options",
]

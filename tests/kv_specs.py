"""KV-cache specs for host-side tests: one layer of one head of size 1, since the manager
never reads a spec's shape, only its kind (jllm/kv_cache_interface.py)."""

from __future__ import annotations

from jllm.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

HEADS = dict(num_kv_heads=1, head_size=1)
MLA = MLAAttentionSpec(kv_lora_rank=4, qk_rope_head_dim=2)
STATE = MambaSpec(shapes=((3, 4), (4, 4)), dtypes=("float32", "float32"))


def attention(window: int | None = None):
    """Full attention, or a sliding window of `window` tokens."""
    if window is None:
        return FullAttentionSpec(**HEADS)
    return SlidingWindowSpec(**HEADS, sliding_window=window)


def groups(*windows: int | None) -> tuple:
    """One attention group per window (None: full attention)."""
    return tuple(attention(w) for w in windows)


def chunked(size: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(**HEADS, attention_chunk_size=size)

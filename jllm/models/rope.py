"""Rotary position embeddings: default, linear and llama3 frequency scaling.

Frequencies are computed once on the host (numpy) from the Hugging Face config, in the
rotate-half layout Hugging Face checkpoints use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RopeConfig:
    inv_freq: tuple[float, ...]  # [H/2]
    attention_scaling: float = 1.0

    @classmethod
    def from_hf(cls, hf, head_dim: int) -> RopeConfig:
        params = dict(getattr(hf, "rope_parameters", None) or {})
        legacy = getattr(hf, "rope_scaling", None) or {}
        params = {**legacy, **params}
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        dim = int(head_dim * getattr(hf, "partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, params)
        elif rope_type != "default":
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported by jllm yet.")
        return cls(tuple(float(f) for f in inv_freq))


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def apply_rope(x, positions, rope: RopeConfig):
    """x [T, N, H] rotated by positions [T] (rotate-half layout)."""
    inv_freq = jnp.asarray(rope.inv_freq, jnp.float32)  # [H/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = (jnp.cos(freqs) * rope.attention_scaling)[:, None, :]
    sin = (jnp.sin(freqs) * rope.attention_scaling)[:, None, :]
    half = inv_freq.shape[0]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half : 2 * half].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if rotated.shape[-1] < x.shape[-1]:
        rotated = jnp.concatenate([rotated, x[..., 2 * half :].astype(jnp.float32)], axis=-1)
    return rotated.astype(x.dtype)

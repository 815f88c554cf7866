"""Rotary position embeddings: default, linear, llama3, YaRN (`yarn`: Qwen's long contexts,
DeepSeek's with its `mscale`, gpt-oss's) and LongRoPE (Phi-3's `longrope`, once `su`)
frequency scaling, over the whole head or its first `partial_rotary_factor` share.

Frequencies are computed once on the host (numpy) from the Hugging Face config, in the
rotate-half layout Hugging Face checkpoints use. A config whose layers differ (Gemma 3's local
and global layers) keeps one parameter dict per layer type in `rope_parameters`; `from_hf`
takes the type.

LongRoPE has two sets of per-frequency factors: short ones for contexts up to the model's
`original_max_position_embeddings`, long ones beyond. transformers switches per forward pass
on the longest position it sees, so a sequence's early keys keep the short rotation once it
grows past the boundary, and one request's rotation depends on its neighbours in a batch.
Here the choice is made once for the engine, by `max_model_len` (`for_length`): the short
factors when no request can pass the original length, the long ones otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax.numpy as jnp
import numpy as np

from jllm.config import batch_invariant
from jllm.models import invariant, layer_ops


@dataclass(frozen=True)
class RopeConfig:
    inv_freq: tuple[float, ...]  # [R/2]: R rotated dims of the head's first
    attention_scaling: float = 1.0
    # LongRoPE: the long factors' frequencies and the length beyond which they apply.
    long_inv_freq: tuple[float, ...] | None = None
    original_max_position: int | None = None
    # M-RoPE (Qwen-VL): per frequency [R/2], the row of the [3, T] positions (time, height,
    # width) that rotates it; None: one row of positions.
    mrope_rows: tuple[int, ...] | None = None

    @classmethod
    def from_hf(cls, hf, head_dim: int, layer_type: str | None = None) -> RopeConfig:
        params = dict(getattr(hf, "rope_parameters", None) or {})
        if layer_type is not None and layer_type in params:
            params = dict(params[layer_type])
        legacy = getattr(hf, "rope_scaling", None) or {}
        if layer_type is None:
            params = {**legacy, **params}
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        dim = int(head_dim * (partial or 1.0))
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        inv_freq = 1.0 / (theta**exponents)
        if rope_type == "linear":
            return cls(_tuple(inv_freq / params["factor"]))
        if rope_type == "llama3":
            return cls(_tuple(_llama3(inv_freq, params)))
        if rope_type in ("longrope", "su"):
            return _longrope(hf, params, theta, exponents)
        if rope_type == "yarn":
            truncate = (getattr(hf, "rope_parameters", None) or {}).get("truncate", True)
            return _yarn(hf, params, theta, dim, truncate)
        if rope_type != "default":
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported by jllm yet.")
        section = params.get("mrope_section")
        rows = (
            None if section is None else mrope_rows(section, bool(params.get("mrope_interleaved")))
        )
        if rows is not None and len(rows) != len(inv_freq):
            raise ValueError(
                f"mrope_section {list(section)} covers {len(rows)} frequencies; the head "
                f"rotates {len(inv_freq)}."
            )
        return cls(_tuple(inv_freq), mrope_rows=rows)

    def for_length(self, max_model_len: int) -> RopeConfig:
        """The rotation an engine of `max_model_len` uses: LongRoPE's short or long factors."""
        if self.long_inv_freq is None:
            return self
        if max_model_len > self.original_max_position:
            return replace(self, inv_freq=self.long_inv_freq, long_inv_freq=None)
        return replace(self, long_inv_freq=None)


def mrope_rows(section, interleaved: bool) -> tuple[int, ...]:
    """Which position row (0 time, 1 height, 2 width) rotates each frequency: in contiguous
    sections (Qwen2-VL, Qwen2.5-VL: `mrope_section` [t, h, w] frequencies each), or
    interleaved t, h, w, t, h, w... while each row has frequencies left, then time (Qwen3-VL's
    `mrope_interleaved`)."""
    t, h, w = (int(n) for n in section)
    if not interleaved:
        return (0,) * t + (1,) * h + (2,) * w
    rows = [0] * (t + h + w)
    for row, count in ((1, h), (2, w)):
        for i in range(row, min(3 * count, len(rows)), 3):  # transformers' slice stops there
            rows[i] = row
    return tuple(rows)


def _tuple(a: np.ndarray) -> tuple[float, ...]:
    return tuple(float(f) for f in a)


def _longrope(hf, params: dict, theta: float, exponents: np.ndarray) -> RopeConfig:
    original = params.get("original_max_position_embeddings") or getattr(
        hf, "original_max_position_embeddings", hf.max_position_embeddings
    )
    factor = params.get("factor") or hf.max_position_embeddings / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta**exponents
    short, long = (np.asarray(params[k], np.float64) for k in ("short_factor", "long_factor"))
    if short.shape != base.shape or long.shape != base.shape:
        raise ValueError(
            f"LongRoPE factors must have {len(base)} entries (rotated dims / 2), got "
            f"{len(short)} short and {len(long)} long."
        )
    return RopeConfig(
        _tuple(1.0 / (short * base)), float(scaling), _tuple(1.0 / (long * base)), original
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(hf, p: dict, theta: float, dim: int, truncate: bool) -> RopeConfig:
    """YaRN as transformers computes it: each frequency between its interpolated (divided by
    `factor`) and original value by a linear ramp over the dims between the corrections of
    `beta_fast` and `beta_slow` rotations, and cos/sin scaled by `attention_factor` (from
    `mscale` / `mscale_all_dim` where given, DeepSeek's)."""
    original = (
        p.get("original_max_position_embeddings")
        or getattr(hf, "original_max_position_embeddings", None)
        or hf.max_position_embeddings
    )
    factor = p.get("factor") or hf.max_position_embeddings / original
    scaling = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if scaling is None:
        if mscale and mscale_all_dim:
            scaling = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = yarn_mscale(factor)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(p.get("beta_fast") or 32), correction(p.get("beta_slow") or 1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    extrapolated = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = extrapolated / base + (1 - extrapolated) / (factor * base)
    return RopeConfig(_tuple(inv_freq), float(scaling))


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    with np.errstate(divide="ignore", invalid="ignore"):  # high == low: no medium band
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def apply_rope(x, positions, rope: RopeConfig):
    """x [T, N, H] rotated by positions [T] (rotate-half layout over the first R dims), or
    with M-RoPE by positions [3, T], each frequency by its row."""
    inv_freq = jnp.asarray(rope.inv_freq, jnp.float32)  # [R/2]
    if positions.ndim == 2:  # M-RoPE: [3, T]
        rows = np.asarray(rope.mrope_rows or (0,) * len(rope.inv_freq))
        pos = positions.astype(jnp.float32)[rows].T  # [T, R/2]
        freqs = pos * inv_freq[None, :]
    else:
        freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    cos = jnp.cos(freqs) * rope.attention_scaling
    sin = jnp.sin(freqs) * rope.attention_scaling
    if x.ndim == 3 and layer_ops.applies(x.dtype):
        return layer_ops.rope(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = inv_freq.shape[0]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half : 2 * half].astype(jnp.float32)
    terms = x1 * cos, x2 * sin, x2 * cos, x1 * sin
    if batch_invariant.enabled():  # each term rounded alone for any number of rows
        terms = invariant.uncontracted(*terms)
    rotated = jnp.concatenate([terms[0] - terms[1], terms[2] + terms[3]], axis=-1)
    if rotated.shape[-1] < x.shape[-1]:
        rotated = jnp.concatenate([rotated, x[..., 2 * half :].astype(jnp.float32)], axis=-1)
    return rotated.astype(x.dtype)

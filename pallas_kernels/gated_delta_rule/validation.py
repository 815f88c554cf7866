"""Static checks and small helpers the gated delta rule's paths share.

Glossary: T tokens, R request rows, Hk query/key heads, Hv value heads, K key dim, V value
dim.
"""

from __future__ import annotations

import jax.numpy as jnp


def validate_inputs(q, k, v, g, beta, state, query_start, query_lens) -> None:
    """q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; state [R, Hv, K, V]; query_start,
    query_lens [R]."""
    T, Hk, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"q and k differ in shape: {q.shape} vs {k.shape}")
    if v.ndim != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T, Hv, V] with T={T}, got {v.shape}")
    Hv, V = v.shape[1:]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"g and beta must be [T, Hv] = {(T, Hv)}, got {g.shape}, {beta.shape}")
    R = query_start.shape[0]
    if state.shape != (R, Hv, K, V):
        raise ValueError(f"state must be [R, Hv, K, V] = {(R, Hv, K, V)}, got {state.shape}")
    if query_lens.shape != (R,):
        raise ValueError(f"query_lens must be [R] = {(R,)}, got {query_lens.shape}")


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (the FLA library's l2norm)."""
    x = x.astype(jnp.float32)
    return x * (1.0 / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps))


def token_rows(query_start, query_lens, T: int):
    """[T] int32: each token's request row, -1 for tokens no row owns (padding)."""
    t = jnp.arange(T)[:, None]
    inside = (t >= query_start[None]) & (t < (query_start + query_lens)[None])  # [T, R]
    return jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)


def prepare(q, k, v, g, beta, use_qk_l2norm: bool, scale: float | None):
    """float32 inputs with q, k normalised (where asked), q scaled, and q, k repeated to
    the value heads: q, k [T, Hv, K], v [T, Hv, V], g, beta [T, Hv]."""
    q, k, v, g, beta = (jnp.asarray(a) for a in (q, k, v, g, beta))
    K = q.shape[-1]
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q.astype(jnp.float32) * (K**-0.5 if scale is None else scale)
    rep = v.shape[1] // q.shape[1]
    q, k = jnp.repeat(q, rep, axis=1), jnp.repeat(k.astype(jnp.float32), rep, axis=1)
    f32 = jnp.float32
    return q, k, v.astype(f32), g.astype(f32), beta.astype(f32)

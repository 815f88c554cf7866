"""Pure-jnp oracle for ragged paged attention: simple, eager, obviously correct.

It resolves the ragged metadata on the host (which request owns each query row and at
which position it sits), gathers every request's pages in page-table order into one
contiguous ``[R, P*S, 2K, H]`` array, and runs dense masked attention of each query row
over its own request's positions. It is what the Pallas kernel is tested against, not a
fast path: memory grows as T * P * S.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from .cache import from_cache
from .validation import (
    latent_as_kv,
    validate_inputs,
    validate_latent,
    validate_options,
    validate_sinks,
)


def ragged_paged_attention_reference(
    q: jnp.ndarray,
    kv_cache: jnp.ndarray,
    kv_lens: jnp.ndarray,
    block_tables: jnp.ndarray,
    query_start: jnp.ndarray,
    query_lens: jnp.ndarray,
    num_seqs,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    fp8_dtype=None,
    q_horizon=None,
    chunk_size: int | None = None,
    sinks=None,
    v_head_dim: int | None = None,
    latent: bool = False,
) -> jnp.ndarray:
    """Attention of a flat ragged batch of queries over a paged KV cache.

    q [T, N, H]; kv_cache [B, S, 2K, H] (K at head 2k, V at head 2k+1); kv_lens,
    query_start, query_lens [R]; block_tables [R, P]; only requests r < num_seqs are used.
    Returns [T, N, H] in q's dtype, zero on rows no valid request owns. A float8 cache
    (a float8 array, or uint8 bytes with ``fp8_dtype``) is read as float32.

    ``q_horizon`` [T] int32 (optional): the last key position each query sees, for a model
    whose image tokens attend to each other in both directions (Gemma 3): a query inside an
    image's span sees up to the span's last token, any other query its own position (None:
    causal for every query). A sliding window still counts back from the query's own
    position, and no query sees past its request's context.

    ``chunk_size`` C (optional): chunked local attention (Llama 4), a query at position p
    sees only the keys at positions >= floor(p / C) * C. ``sinks`` [N] float (optional):
    attention sinks (gpt-oss), one logit per query head that joins the softmax's denominator
    as a key of value zero: out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) +
    exp(sinks[h] - m)), m the largest of the scores and the sink (the sink is neither scaled
    nor capped). ``v_head_dim`` Hv (optional): the values are the first Hv lanes of each value
    head (a layer whose values are narrower than its keys stores them padded), and the result
    is [T, N, Hv].

    ``latent`` (MLA's absorbed form): kv_cache is [B, S, H], one latent vector per token that
    is the key of one KV head shared by every query head, and whose first ``v_head_dim`` lanes
    (required, fewer than H) are its value.
    """
    if latent:
        validate_latent(kv_cache, v_head_dim)
    layout = latent_as_kv(kv_cache) if latent else kv_cache
    validate_inputs(q, layout, kv_lens, block_tables, query_start, query_lens, num_seqs, fp8_dtype)
    validate_options(
        sm_scale,
        sliding_window,
        soft_cap,
        chunk_size=chunk_size,
        v_head_dim=v_head_dim,
        head_dim=q.shape[-1],
    )
    validate_sinks(sinks, q.shape[1])
    t, n, h = q.shape
    s = kv_cache.shape[1]
    k_heads = layout.shape[2] // 2
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(h)

    kv_lens, block_tables = np.asarray(kv_lens), np.asarray(block_tables)
    query_start, query_lens = np.asarray(query_start), np.asarray(query_lens)
    owner = np.full(t, -1)  # request owning each query row, -1 for padding
    for r in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        kv_len, q_len, q0 = int(kv_lens[r]), int(query_lens[r]), int(query_start[r])
        if not (0 <= q_len <= kv_len <= block_tables.shape[1] * s and 0 <= q0 <= t - q_len):
            raise ValueError(
                f"request {r}: inconsistent metadata (query_start={q0}, query_len={q_len}, "
                f"kv_len={kv_len}, T={t}, capacity={block_tables.shape[1] * s})"
            )
        if (owner[q0 : q0 + q_len] != -1).any():
            raise ValueError(f"request {r}: query rows overlap another request's")
        owner[q0 : q0 + q_len] = r
    owned = owner >= 0  # [T]
    req = np.maximum(owner, 0)  # [T]
    q_pos = kv_lens[req] - query_lens[req] + np.arange(t) - query_start[req]  # [T]

    r_total, p = block_tables.shape
    kv = kv_cache[block_tables].reshape(r_total, p * s, -1, h)  # [R, L, 2K or 1, H]
    kv = from_cache(kv[req], jnp.float32, fp8_dtype)  # [T, L, 2K or 1, H]: each row's own
    kv_pos = jnp.arange(p * s)[None, :]  # [1, L]
    horizon = q_pos if q_horizon is None else np.maximum(np.asarray(q_horizon), q_pos)
    mask = (kv_pos <= horizon[:, None]) & (kv_pos < kv_lens[req][:, None]) & owned[:, None]
    if sliding_window is not None:
        mask &= kv_pos > q_pos[:, None] - sliding_window
    if chunk_size is not None:
        mask &= kv_pos >= (q_pos[:, None] // chunk_size) * chunk_size
    k, v = (kv, kv) if latent else (kv[:, :, 0::2], kv[:, :, 1::2])  # a latent is both
    k = jnp.repeat(k, n // k_heads, axis=2)  # [T, L, N, H]
    v = jnp.repeat(v[..., : v_head_dim or h], n // k_heads, axis=2)  # [T, L, N, Hv]
    v = jnp.where(mask[:, :, None, None], v, 0.0)  # unused slots may hold NaN

    scores = jnp.einsum("TNH,TLNH->TNL", q.astype(jnp.float32), k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, :], scores, -jnp.inf)
    scores = jnp.where(owned[:, None, None], scores, 0.0)  # keep padding rows finite
    if sinks is not None:  # one more column, the sink's, dropped after the softmax
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None], (t, n, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)  # [T, N, L]
    out = jnp.einsum("TNL,TLNH->TNH", probs, v)
    return jnp.where(owned[:, None, None], out, 0.0).astype(q.dtype)

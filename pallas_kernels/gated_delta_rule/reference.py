"""The gated delta rule's oracle: the recurrence of the kit's docstring, one token at a time
over the flat batch (a scan), each token updating its own row's state. Simple and slow: it
is what the chunked path is tested against.

Glossary: T tokens, R request rows, Hk query/key heads, Hv value heads, K key dim, V value
dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .validation import prepare, token_rows, validate_inputs


def gated_delta_rule_reference(
    q, k, v, g, beta, state, query_start, query_lens, *, use_qk_l2norm=True, scale=None
):
    """q, k [T, Hk, K]; v [T, Hv, V]; g (log decay), beta [T, Hv]; state [R, Hv, K, V] each
    row's state before the step; query_start, query_lens [R] (rows of length 0 and tokens
    no row owns do nothing). Returns (o [T, Hv, V] float32, zero on padding; the rows'
    states after their tokens [R, Hv, K, V] float32)."""
    validate_inputs(q, k, v, g, beta, state, query_start, query_lens)
    q, k, v, g, beta = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    rows = token_rows(query_start, query_lens, q.shape[0])

    def step(S, inputs):  # S [R, Hv, K, V]
        qt, kt, vt, gt, bt, r = inputs
        s = S[jnp.maximum(r, 0)] * jnp.exp(gt)[:, None, None]  # [Hv, K, V]
        predicted = jnp.einsum("HKV,HK->HV", s, kt)
        s = s + kt[:, :, None] * ((vt - predicted) * bt[:, None])[:, None, :]
        o = jnp.einsum("HKV,HK->HV", s, qt)
        S = jnp.where(r >= 0, S.at[jnp.maximum(r, 0)].set(s), S)
        return S, jnp.where(r >= 0, o, 0.0)

    S, o = jax.lax.scan(step, state.astype(jnp.float32), (q, k, v, g, beta, rows))
    return o, S

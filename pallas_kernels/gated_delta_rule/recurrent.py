"""The gated delta rule's recurrent update for decode steps, and the switch between it and
the chunked path.

A step in which no row has more than one token (a decode-only step, the steady state of
generation) needs no scan at all: every row's one token updates its own state at once,
batched over the rows. `decode_rows` gathers each row's token and the inputs a kernel needs
(rows without a token get g = 0 and beta = 0, which leave their state bit for bit as it
was), `scatter_rows` puts the rows' outputs back at their tokens, and
`gated_delta_rule_recurrent` is the XLA form. `by_row_kind` runs the recurrent form of a
backend when the step is decode-only and its chunked form otherwise (`lax.cond`: one of
the two runs); `gated_delta_rule_xla` is that switch over XLA's two forms.

Glossary: T tokens, R request rows, Hv value heads, K key dim, V value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .chunked import gated_delta_rule_chunked
from .validation import prepare, validate_inputs


def decode_rows(q, k, v, g, beta, query_start, query_lens):
    """Prepared inputs (q, k [T, Hv, K] normalised and scaled, v [T, Hv, V], g, beta
    [T, Hv]) -> each row's token: q, k [R, Hv, K], v [R, Hv, V], g, beta [R, Hv]; rows
    without a token get zeros."""
    T = q.shape[0]
    has = query_lens > 0  # [R]
    t = jnp.clip(query_start, 0, T - 1)
    rows = tuple(jnp.where(has.reshape(-1, *[1] * (x.ndim - 1)), x[t], 0) for x in (q, k, v))
    return (*rows, jnp.where(has[:, None], g[t], 0.0), jnp.where(has[:, None], beta[t], 0.0))


def scatter_rows(o, query_start, query_lens, T: int):
    """o [R, Hv, V] -> [T, Hv, V] float32, each row's output at its token, zero elsewhere."""
    at = jnp.where(query_lens > 0, query_start, T)
    return jnp.zeros((T, *o.shape[1:]), jnp.float32).at[at].set(o, mode="drop")


def gated_delta_rule_recurrent(
    q, k, v, g, beta, state, query_start, query_lens, *, use_qk_l2norm=True, scale=None
):
    """The reference's contract (reference.py) for a step whose rows have at most one token
    each (others give wrong results: the switch is `by_row_kind`'s)."""
    validate_inputs(q, k, v, g, beta, state, query_start, query_lens)
    T = q.shape[0]
    prepared = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    q, k, v, g, beta = decode_rows(*prepared, query_start, query_lens)
    S = state.astype(jnp.float32) * jnp.exp(g)[..., None, None]  # [R, Hv, K, V]
    predicted = jnp.einsum("RHKV,RHK->RHV", S, k)
    S = S + k[..., None] * ((v - predicted) * beta[..., None])[:, :, None, :]
    o = jnp.einsum("RHKV,RHK->RHV", S, q)
    return scatter_rows(o, query_start, query_lens, T), S


def by_row_kind(recurrent, chunked, *args, **kwargs):
    """recurrent(*args, **kwargs) when no row of the step has more than one token, else
    chunked(*args, **kwargs); args are the reference's (query_lens last)."""
    query_lens = args[7]
    decode_only = jnp.max(query_lens, initial=0) <= 1
    return jax.lax.cond(
        decode_only, lambda a: recurrent(*a, **kwargs), lambda a: chunked(*a, **kwargs), args
    )


def gated_delta_rule_xla(q, k, v, g, beta, state, query_start, query_lens, **kwargs):
    """The reference's contract through XLA: the recurrent update for a decode-only step,
    the chunked path for any other (`kwargs`: use_qk_l2norm, scale)."""
    validate_inputs(q, k, v, g, beta, state, query_start, query_lens)
    args = (q, k, v, g, beta, state, query_start, query_lens)
    return by_row_kind(gated_delta_rule_recurrent, gated_delta_rule_chunked, *args, **kwargs)

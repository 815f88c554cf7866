"""The short causal depthwise convolution in front of the gated delta rule, over a flat
ragged batch: channel c of a token at step position i is sum_j w[j, c] * x[i - (J-1) + j, c]
over the row's own inputs, the row's conv window (its last J - 1 inputs before the step)
standing in for positions before the step. Returns the outputs (before the activation) and
each row's new window.

Glossary: T tokens, R request rows, C channels, J taps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .validation import token_rows


def causal_conv(x, w, window, query_start, query_lens):
    """x [T, C]; w [J, C]; window [R, J - 1, C] (each row's last inputs, oldest first);
    query_start, query_lens [R]. Returns (y [T, C] float32, zero on padding; the new windows
    [R, J - 1, C] in window's dtype; a row without tokens keeps its own)."""
    x, window = jnp.asarray(x), jnp.asarray(window)
    T, J = x.shape[0], w.shape[0]
    f32 = jnp.float32
    rows = token_rows(query_start, query_lens, T)
    r = jnp.maximum(rows, 0)
    first = query_start[r]  # [T] the row's first token in the batch
    taps = []
    for j in range(J):
        source = jnp.arange(T) - (J - 1) + j  # [T]
        back = source - first  # < 0: before the step, in the window
        from_x = x.at[jnp.maximum(source, 0)].get().astype(f32)
        from_w = window[r, jnp.clip(J - 1 + back, 0, J - 2)].astype(f32)
        taps.append(jnp.where((back >= 0)[:, None], from_x, from_w))
    y = sum(tap * w[j].astype(f32) for j, tap in enumerate(taps))
    y = jnp.where((rows >= 0)[:, None], y, 0.0)
    # The new window: the row's last J - 1 inputs, reaching back into the old one.
    m = jnp.arange(J - 1)
    back = query_lens[:, None] - (J - 1) + m[None]  # [R, J - 1] step position of each slot
    from_x = x.at[jnp.clip(query_start[:, None] + back, 0, T - 1)].get()
    from_w = jnp.take_along_axis(window, jnp.clip(J - 1 + back, 0, J - 2)[..., None], axis=1)
    new = jnp.where((back >= 0)[..., None], from_x.astype(window.dtype), from_w)
    return y, new


def causal_conv_reference(x, w, window, query_start, query_lens):
    """The same, one token at a time (a scan carrying each row's window): the oracle."""
    x, window = jnp.asarray(x), jnp.asarray(window)
    rows = token_rows(query_start, query_lens, x.shape[0])

    def step(Wn, inputs):
        xt, r = inputs
        rr = jnp.maximum(r, 0)
        taps = jnp.concatenate([Wn[rr].astype(jnp.float32), xt[None].astype(jnp.float32)])
        y = jnp.einsum("JC,JC->C", taps, w.astype(jnp.float32))
        Wn = jnp.where(r >= 0, Wn.at[rr].set(taps[1:].astype(Wn.dtype)), Wn)
        return Wn, jnp.where(r >= 0, y, 0.0)

    Wn, y = jax.lax.scan(step, window, (x, rows))
    return y, Wn

"""The gated delta rule's XLA path over a flat ragged batch, chunk by chunk.

Each request row's tokens are cut into chunks of C (`chunk_plan`: at most cdiv(T, C) + R
chunks, static per bucket; a row's last chunk may be short and is padded with tokens that
neither read nor write). Inside one chunk, with its state S [K, V] before it, the cumulative
log decay G_i = g_1 + ... + g_i and the decay between two of its tokens
Gamma_ij = exp(G_i - G_j) (j <= i, else 0), the delta rule's C sequential writes condense
into one unit lower-triangular solve (DeltaNet's WY/UT form, as the FLA library computes it):

    A     = strictly lower part of (beta k) k^T * Gamma          [C, C]
    U     = (I + A)^-1 (beta v)                                  [C, V]
    W     = (I + A)^-1 (beta k * exp(G))                         [C, K]
    v_new = U - W S                                               (what S does not predict)
    o     = (q * exp(G)) S + ((q k^T) * Gamma) v_new
    S'    = exp(G_C) S + (k * exp(G_C - G))^T v_new

Everything but the last three lines is done for all chunks at once; one scan over the
chunks, in order, carries each row's state (a row's chunks are consecutive). The chunk size
follows the bucket: C = the largest power of two <= T / R, at most `max_chunk` (a decode-only
step has chunks of one token, a long prefill chunks of 64).

Glossary: T tokens, R request rows, NC chunks, C chunk tokens, Hv value heads, K key dim,
V value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .validation import prepare, validate_inputs


def chunk_size_for(T: int, R: int, max_chunk: int = 64) -> int:
    """The chunk size of a bucket of T tokens and R rows (module docstring)."""
    per_row = max(1, T // max(R, 1))
    return min(max_chunk, 1 << (per_row.bit_length() - 1))


def chunk_plan(query_start, query_lens, T: int, C: int):
    """The step's chunks: (row [NC], first token [NC], tokens [NC]) int32, NC = cdiv(T, C)
    + R; chunks past the last row's have 0 tokens (and row 0)."""
    R = query_lens.shape[0]
    NC = -(-T // C) + R
    lens = jnp.maximum(query_lens, 0).astype(jnp.int32)
    count = (lens + C - 1) // C  # [R]
    ends = jnp.cumsum(count)
    c = jnp.arange(NC, dtype=jnp.int32)
    row = jnp.searchsorted(ends, c, side="right").astype(jnp.int32)
    valid = row < R
    row = jnp.where(valid, row, 0)
    index = c - (ends[row] - count[row])  # the chunk's rank within its row
    start = query_start[row].astype(jnp.int32) + index * C
    size = jnp.where(valid, jnp.clip(lens[row] - index * C, 0, C), 0)
    return row, start, size


def chunk_inputs(q, k, v, g, beta, query_start, query_lens, C: int):
    """The Pallas kernels' layout of prepared inputs (validation.prepare): the step's chunks
    head-major. Returns (row, size [NC] as `chunk_plan`, but chunks past the last row's
    belong to the last row that has one, so a kernel walking them in order never returns to
    an earlier row; tokens [NC, C], each slot's token or T; q, k [Hv, NC, C, K]; k
    transposed [Hv, NC, K, C]; v [Hv, NC, C, V]; the cumulative log decay as a column
    [Hv, NC, C, 1] and as a row [Hv, NC, 1, C]; beta [Hv, NC, C, 1]; the chunk's total log
    decay [Hv, NC, 1, 1]), slots outside the chunks zero (they neither read nor write)."""
    T = q.shape[0]
    row, start, size = chunk_plan(query_start, query_lens, T, C)
    last = row[jnp.maximum(jnp.sum(size > 0) - 1, 0)]
    row = jnp.where(size > 0, row, last)
    offsets = jnp.arange(C, dtype=jnp.int32)
    tokens = jnp.where(offsets[None] < size[:, None], start[:, None] + offsets[None], T)

    def gather(x):  # [T, Hv, ...] -> [Hv, NC, C, ...]
        return jnp.moveaxis(x.at[tokens].get(mode="fill", fill_value=0), 2, 0)

    qc, kc, vc, gc, bc = (gather(x) for x in (q, k, v, g, beta))
    G = jnp.cumsum(gc, axis=-1)  # [Hv, NC, C]
    kT = jnp.swapaxes(kc, -1, -2)
    total = G[..., -1:, None]  # padding adds g = 0, so the last slot holds the chunk's total
    return row, size, tokens, qc, kc, kT, vc, G[..., None], G[..., None, :], bc[..., None], total


def scatter_chunks(o, tokens, T: int):
    """o [Hv, NC, C, V] -> [T, Hv, V] float32 at the chunks' tokens, zero elsewhere."""
    o = jnp.moveaxis(o.astype(jnp.float32), 0, 2)  # [NC, C, Hv, V]
    return jnp.zeros((T, *o.shape[2:]), jnp.float32).at[tokens].set(o, mode="drop")


def gated_delta_rule_chunked(
    q,
    k,
    v,
    g,
    beta,
    state,
    query_start,
    query_lens,
    *,
    use_qk_l2norm=True,
    scale=None,
    chunk_size: int | None = None,
):
    """The reference's contract (reference.py), chunk by chunk. `chunk_size`: C (default:
    `chunk_size_for` the bucket)."""
    validate_inputs(q, k, v, g, beta, state, query_start, query_lens)
    T, R = q.shape[0], query_start.shape[0]
    C = chunk_size or chunk_size_for(T, R)
    q, k, v, g, beta = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    row, start, size = chunk_plan(query_start, query_lens, T, C)
    offsets = jnp.arange(C, dtype=jnp.int32)
    inside = offsets[None] < size[:, None]  # [NC, C]
    tokens = jnp.where(inside, start[:, None] + offsets[None], T)  # T: past the batch

    def gather(x):  # [T, Hv, ...] -> [NC, Hv, C, ...], zeros outside the chunks
        x = x.at[tokens].get(mode="fill", fill_value=0)  # [NC, C, Hv, ...]
        return jnp.moveaxis(x, 1, 2)

    qc, kc, vc, gc, bc = (gather(x) for x in (q, k, v, g, beta))  # g, beta: [NC, Hv, C]
    G = jnp.cumsum(gc, axis=-1)  # [NC, Hv, C]
    lower = offsets[:, None] >= offsets[None]  # [C, C] j <= i
    diff = G[..., :, None] - G[..., None, :]
    gamma = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # [NC, Hv, C, C]
    kb = kc * bc[..., None]
    strict = offsets[:, None] > offsets[None]
    A = jnp.where(strict, jnp.einsum("NHiK,NHjK->NHij", kb, kc) * gamma, 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    solve = jax.lax.linalg.triangular_solve
    rhs = jnp.concatenate([vc * bc[..., None], kb * jnp.exp(G)[..., None]], axis=-1)
    UW = solve(eye + A, rhs, left_side=True, lower=True, unit_diagonal=True)
    V = vc.shape[-1]
    U, W = UW[..., :V], UW[..., V:]  # [NC, Hv, C, V], [NC, Hv, C, K]
    qd = qc * jnp.exp(G)[..., None]
    attn = jnp.einsum("NHiK,NHjK->NHij", qc, kc) * gamma  # [NC, Hv, C, C]
    last = G[..., -1:]  # padding adds g = 0, so the last slot holds the chunk's total
    kd = kc * jnp.exp(last - G)[..., None]
    decay = jnp.exp(last[..., 0])  # [NC, Hv]

    def step(S_all, inputs):  # S_all [R, Hv, K, V]
        r, n, u, w, qd_c, attn_c, kd_c, d = inputs
        S = S_all[r]
        v_new = u - jnp.einsum("HCK,HKV->HCV", w, S)
        o = jnp.einsum("HCK,HKV->HCV", qd_c, S) + jnp.einsum("HCc,HcV->HCV", attn_c, v_new)
        S_new = S * d[:, None, None] + jnp.einsum("HCK,HCV->HKV", kd_c, v_new)
        S_all = S_all.at[r].set(jnp.where(n > 0, S_new, S))
        return S_all, o

    inputs = (row, size, U, W, qd, attn, kd, decay)
    S, o = jax.lax.scan(step, state.astype(jnp.float32), inputs)  # o [NC, Hv, C, V]
    o = jnp.moveaxis(o, 2, 1)  # [NC, C, Hv, V]
    out = jnp.zeros((T, *o.shape[2:]), jnp.float32)
    return out.at[tokens].set(o, mode="drop"), S

"""The gated delta rule as Pallas TPU kernels (``interpret=True`` runs them on the CPU): the
reference's contract, a decode-only step through the recurrent kernel, any other through the
chunk kernel (recurrent.by_row_kind).

Chunk kernel. The wrapper lays the step's chunks out head-major (chunked.chunk_inputs: C
tokens each, a row's chunks consecutive, their cumulative log decay G precomputed); the grid
is (Hv heads, NC chunks), heads parallel, chunks in order. Scalar prefetch hands each chunk's
row and size to the index maps, so a chunk's state block is its row's: the state stays in a
VMEM scratch across the row's chunks (loaded at its first, written back as the block index
moves on), and the state output aliases the input, so rows without tokens keep theirs.
Inside a chunk (`chunk_step`), DeltaNet's WY form with matrix products only, as the MXU
likes it: the unit lower-triangular inverse block by block, log2(C) levels of two products
each (blocks of 1, 2, 4, ... rows, each level from the exact inverses of the level before,
as blocked forward substitution: stable where keys repeat, unlike the Neumann product
(I - A)(I + A^2)(I + A^4)..., whose powers of A overflow float32 before they cancel).

Recurrent kernel. One program per (row, value head): the row's one token, its key and query
as columns [K, 1], decays the state [K, V], writes what it did not predict, reads the output;
products as broadcasts and sums over K, no matrix unit needed.

Both keep the state float32 and use float32 products at full precision.

Glossary: T tokens, R request rows, NC chunks, C chunk tokens, Hv value heads, K key dim,
V value dim, BV a value block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .chunked import chunk_inputs, chunk_size_for, scatter_chunks
from .recurrent import by_row_kind, decode_rows, scatter_rows
from .validation import prepare, validate_inputs

f32 = jnp.float32


def dot(a, b):
    """a [M, K] @ b [K, N] in float32 at full precision."""
    return jax.lax.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)


def unit_lower_inverse(A):
    """(I + A)^-1 for a strictly lower-triangular A [C, C] (C a power of two), block by
    block (module docstring): with P the exact inverse of every diagonal block of size s,
    the blocks of size 2s are P - P (A on their lower-left s-blocks) P."""
    C = A.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    inverse = (i == j).astype(f32)
    for level in range((C - 1).bit_length()):  # s = 2^level
        same = jax.lax.shift_right_logical(i ^ j, jnp.int32(level + 1)) == 0
        lower_left = same & (jax.lax.shift_right_logical(i ^ j, jnp.int32(level)) == 1)
        inverse = inverse - dot(dot(inverse, jnp.where(lower_left, A, 0.0)), inverse)
    return inverse


def chunk_step(q, k, kT, v, Gc, Gr, b, last, S):
    """One chunk of one value head: q, k [C, K], kT [K, C], v [C, BV], cumulative log
    decay as a column Gc [C, 1] and a row Gr [1, C], beta b [C, 1], the chunk's total log
    decay last [1, 1], the state S [K, BV] before the chunk -> (o [C, BV], the state after
    it). Slots past the chunk's tokens are
    zero (G repeats the last) and neither read nor write."""
    C = q.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    causal = i >= j
    gamma = jnp.where(causal, jnp.exp(jnp.where(causal, Gc - Gr, 0.0)), 0.0)  # [C, C]
    kb = k * b
    inverse = unit_lower_inverse(jnp.where(i > j, dot(kb, kT) * gamma, 0.0))
    eG = jnp.exp(Gc)  # [C, 1]
    v_new = dot(inverse, v * b) - dot(dot(inverse, kb * eG), S)  # what S does not predict
    o = dot(q * eG, S) + dot(jnp.where(causal, dot(q, kT) * gamma, 0.0), v_new)
    return o, S * jnp.exp(last) + dot(kT * jnp.exp(last - Gr), v_new)


def decode_step(q, k, v, g, b, S):
    """One token of one value head: q, k [K, 1], v [1, BV], g, b [1, 1], S [K, BV] ->
    (o [1, BV], the new state)."""
    S = S * jnp.exp(g)
    predicted = jnp.sum(S * k, axis=0, keepdims=True)  # [1, BV]
    S = S + k * ((v - predicted) * b)
    return jnp.sum(S * q, axis=0, keepdims=True), S


def decode_operands(prepared, state, query_start, query_lens):
    """The recurrent kernels' operands: each row's q, k as columns [R, Hv, K, 1], v
    [R, Hv, 1, V], g, beta [R, Hv, 1, 1], the state float32 [R, Hv, K, V]."""
    q, k, v, g, beta = decode_rows(*prepared, query_start, query_lens)
    return (
        q[..., None],
        k[..., None],
        v[:, :, None],
        g[..., None, None],
        beta[..., None, None],
        (state.astype(f32)),
    )


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref):
    o, S = decode_step(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], g_ref[0, 0], b_ref[0, 0], s_ref[0, 0])
    o_ref[0, 0] = o
    s_out_ref[0, 0] = S


def _decode(q, k, v, g, beta, state, query_start, query_lens, *, use_qk_l2norm, scale, **kw):
    T = q.shape[0]
    prepared = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    operands = decode_operands(prepared, state, query_start, query_lens)
    R, Hv, K, V = operands[-1].shape

    def block(*shape):
        return pl.BlockSpec((1, 1, *shape), lambda r, h: (r, h, 0, 0))

    o, S = pl.pallas_call(
        _decode_kernel,
        grid=(R, Hv),
        in_specs=[block(K, 1), block(K, 1), block(1, V), block(1, 1), block(1, 1), block(K, V)],
        out_specs=[block(1, V), block(K, V)],
        out_shape=[
            jax.ShapeDtypeStruct((R, Hv, 1, V), f32),
            jax.ShapeDtypeStruct(state.shape, f32),
        ],
        input_output_aliases={5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=kw["interpret"],
        name="gated_delta_rule_decode",
    )(*operands)
    return scatter_rows(o[:, :, 0], query_start, query_lens, T), S


def _chunk_kernel(
    row_ref, size_ref, q_ref, k_ref, kT_ref, v_ref, gc_ref, gr_ref, b_ref, gl_ref, s_ref, *out
):
    o_ref, s_out_ref, S_ref = out
    c = pl.program_id(1)
    first = (c == 0) | (row_ref[c] != row_ref[jnp.maximum(c - 1, 0)])

    @pl.when(first)
    def _load():
        S_ref[...] = s_ref[0, 0]

    live = size_ref[c] > 0

    @pl.when(live)
    def _chunk():
        inputs = (q_ref, k_ref, kT_ref, v_ref, gc_ref, gr_ref, b_ref, gl_ref)
        o, S = chunk_step(*(x[0, 0] for x in inputs), S_ref[...])
        o_ref[0, 0] = o
        S_ref[...] = S

    @pl.when(jnp.logical_not(live))
    def _past_the_rows():
        o_ref[0, 0] = jnp.zeros(o_ref.shape[2:], f32)

    s_out_ref[0, 0] = S_ref[...]


def _chunks(q, k, v, g, beta, state, query_start, query_lens, *, use_qk_l2norm, scale, **kw):
    T, R = q.shape[0], query_start.shape[0]
    C = kw["chunk_size"] or min(64, max(8, chunk_size_for(T, R)))
    prepared = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    row, size, tokens, *inputs = chunk_inputs(*prepared, query_start, query_lens, C)
    Hv, NC, _, K = inputs[0].shape
    V = inputs[3].shape[-1]

    def block(*shape):
        return pl.BlockSpec((1, 1, *shape), lambda h, c, row, size: (h, c, 0, 0))

    state_block = pl.BlockSpec((1, 1, K, V), lambda h, c, row, size: (row[c], h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(Hv, NC),
        in_specs=[
            *(block(C, K), block(C, K), block(K, C), block(C, V)),
            *(block(C, 1), block(1, C), block(C, 1), block(1, 1), state_block),
        ],
        out_specs=[block(C, V), state_block],
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
    )
    o, S = pl.pallas_call(
        _chunk_kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((Hv, NC, C, V), f32),
            jax.ShapeDtypeStruct(state.shape, f32),
        ],
        input_output_aliases={2 + 8: 1},  # after the two prefetched operands and 8 inputs
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=kw["interpret"],
        name="gated_delta_rule_chunks",
    )(row, size, *inputs, state.astype(f32))
    return scatter_chunks(o, tokens, T), S


def gated_delta_rule(
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
    interpret: bool = False,
):
    """The reference's contract (reference.py) on a TPU. `chunk_size`: the chunk kernel's C
    (default: `chunk_size_for` the bucket, between 8 and 64)."""
    validate_inputs(q, k, v, g, beta, state, query_start, query_lens)
    kw = dict(use_qk_l2norm=use_qk_l2norm, scale=scale, interpret=interpret)
    chunks = functools.partial(_chunks, chunk_size=chunk_size)
    return by_row_kind(_decode, chunks, q, k, v, g, beta, state, query_start, query_lens, **kw)

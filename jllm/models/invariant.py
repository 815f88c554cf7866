"""Reductions and an exp computed alike for any number of rows, for the batch-invariant mode
(jllm/config/batch_invariant.py).

XLA's CPU backend picks how to vectorize a fused loop from its whole shape, so a row's
result can round differently when more rows share the call:
- a sum over the last axis (an RMSNorm's over 576 floats does from 8 rows on): written as
  explicit elementwise adds (`row_sum`), the order is the program's, since XLA does not
  reassociate floating-point adds;
- rsqrt: its vector form (an estimate refined by a Newton step) and its scalar form round
  differently; 1 / sqrt is correctly rounded in both (RMSNorm takes it in the mode);
- a * b + c: contracted into one fused multiply-add or not by the loop's shape (the rotary
  embedding's x1 * cos - x2 * sin rounded apart for fewer than 8 rows of a tiny model's
  heads and for more, jax 0.12 on an AVX2 CPU; an RMSNorm's squares into its sum, jax
  0.11.2 there); `uncontracted` rounds each product alone;
- exp: a router's softmax over 8 experts rounded one value differently for 1 token and for
  16 (the scalar exp of a short loop against the vector one); `exp_rows` runs it on one
  fixed block shape. (An exp written out in + and * is no cure: XLA fuses some
  multiply-adds and not others, by shape.)

Glossary: D the reduced axis, L lanes of the first pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 16


def row_sum(x):
    """x [..., D] -> [..., 1]: lane l of the first pass sums x[..., i * L + l] over i in
    order, then the L lanes are added as a tree of halves."""
    D = x.shape[-1]
    lanes = LANES if D % LANES == 0 else 1
    parts = x.reshape(*x.shape[:-1], D // lanes, lanes)
    acc = parts[..., 0, :]
    for i in range(1, D // lanes):
        acc = acc + parts[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc


def row_mean(x):
    """`row_sum` / D."""
    return row_sum(x) / x.shape[-1]


BLOCK_ROWS = 64


def exp_rows(x):
    """exp of x [T, E] (E a few values: a router's experts) computed alike for any T: the
    rows padded to whole vectors of `LANES` (exp(-inf) = 0, sliced off) and to blocks of
    `BLOCK_ROWS`, and the exp run block by block on one fixed shape ([64, 16]: 1,024 values,
    whole vectors), so every value takes the same instructions whatever the number of rows.
    XLA's exp of a short or ragged loop takes its scalar form, which rounds some values
    differently from its vector form."""
    T, E = x.shape
    pad_e, pad_t = -E % LANES, -T % BLOCK_ROWS
    x = jnp.pad(x, [(0, pad_t), (0, pad_e)], constant_values=-jnp.inf)
    blocks = x.reshape(-1, BLOCK_ROWS, E + pad_e)
    return jax.lax.map(_exp_block, blocks).reshape(T + pad_t, E + pad_e)[:T, :E]


def _exp_block(block):
    """exp of one [BLOCK_ROWS, LANES * n] block, kept out of any fusion with its
    neighbours (which would give it another loop shape), e.g. once a one-block map is
    inlined."""
    return jax.lax.optimization_barrier(jnp.exp(jax.lax.optimization_barrier(block)))


def uncontracted(*products):
    """The products as they are, each rounded to float32 before anything adds them: an
    optimization barrier keeps them out of the fused loop that sums them, where XLA would
    contract a product and a sum into one multiply-add for some shapes and not others."""
    return jax.lax.optimization_barrier(products)

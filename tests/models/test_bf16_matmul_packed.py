"""Packed bf16 weights (jllm/models/bf16_matmul.py `pack`): the layout against its inverse and
an element-by-element reading of it, and the kernel's products of packed weights bitwise
against its products of the same weights as [L, K, N] (which XLA's product checks,
tests/models/test_bf16_matmul.py): the packed panels hold the pairs each path multiplies, in
the order it sums them, on the AMX tiles, the vector loop and the batch-invariant build."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jllm.config import batch_invariant
from jllm.models import bf16_matmul
from jllm.models.bf16_matmul import (
    bf16_gated_matmul,
    bf16_gated_matmul_packed,
    bf16_matmul_packed,
    pack,
    unpack,
)
from jllm.models.bf16_matmul import bf16_matmul as kernel

needs_kernel = pytest.mark.skipif(
    not bf16_matmul.supported(), reason="the bf16 matmul kernel needs AVX512-BF16"
)


def operands(m, k, n, layers=3, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 1, (layers, k, n)), jnp.bfloat16)
    return x, w


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 100), n=st.integers(1, 100), layers=st.integers(1, 3))
def test_pack_round_trips_and_reads_as_documented(k, n, layers):
    _, w = operands(1, k, n, layers)
    packed = pack(w)
    kp, panels = -(-k // 32) * 32, -(-n // 32)
    assert packed.shape == (layers, panels, 2, kp // 2, 32)
    np.testing.assert_array_equal(np.asarray(unpack(packed, k, n)), np.asarray(w))
    p, full = np.asarray(packed, np.float32), np.asarray(w, np.float32)
    padded = np.zeros((layers, kp, panels * 32), np.float32)
    padded[:, :k, :n] = full
    for q, h, k2, c, e in [(0, 0, 0, 0, 0), (panels - 1, 1, kp // 2 - 1, 15, 1), (0, 1, 0, 3, 1)]:
        # panel q, half h, row k2: (w[2 k2][n], w[2 k2 + 1][n]) for its 16 columns
        assert p[-1, q, h, k2, 2 * c + e] == padded[-1, 2 * k2 + e, 32 * q + 16 * h + c]


def both(x, w, up, layer, out_dtype, live=None):
    """(the kernel on [L, K, N], the kernel on the packed weights), plain or gated."""
    n = w.shape[-1]
    if up is None:
        return (
            kernel(x, w, layer, out_dtype, live=live),
            bf16_matmul_packed(x, pack(w), n, layer, out_dtype, live=live),
        )
    return (
        bf16_gated_matmul(x, w, up, layer, out_dtype, live=live),
        bf16_gated_matmul_packed(x, pack(w), pack(up), n, layer, out_dtype, live=live),
    )


@needs_kernel
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 96),  # one row: a wide item
        (2, 576, 1536),  # wide items of 4 panels
        (3, 33, 300),  # 3 rows: wide items of 2 panels, odd K, a masked edge
        (15, 7, 37),  # the loop's tiles, odd K
        (64, 576, 192),  # a decode batch: the tiles (with AMX), one block of rows
        (100, 7, 37),  # a partial last tile, odd K padded to 32
        (300, 1000, 65),  # several row blocks, K not a multiple of 32
        (16, 576, 40),  # a half tile
    ],
)
def test_packed_products_are_the_same_bits(m, k, n, gated):
    x, w = operands(m, k, n)
    up = operands(m, k, n, seed=5)[1] if gated else None
    for layer, out_dtype in [(0, jnp.float32), (2, jnp.bfloat16)]:
        plain, packed = both(x, w, up, layer, out_dtype)
        assert packed.dtype == out_dtype and packed.shape == (m, n)
        np.testing.assert_array_equal(np.asarray(packed), np.asarray(plain))
    # one layer's weight, unstacked
    plain, packed = both(x, w[1], None if up is None else up[1], 0, jnp.float32)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(plain))


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 70),
    k=st.integers(1, 80),
    n=st.integers(1, 100),
    gated=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_shape_packed_is_the_same_bits(m, k, n, gated, seed):
    x, w = operands(m, k, n, layers=2, seed=seed)
    up = operands(m, k, n, layers=2, seed=seed + 1)[1] if gated else None
    plain, packed = both(x, w, up, 1, jnp.float32)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(plain))


@needs_kernel
@pytest.mark.parametrize("live_rows", [None, [9], [5, 6, 7]])
def test_packed_padding_rows_are_skipped_and_zero(live_rows):
    m, k, n = 90 if live_rows is None else 16, 96, 170
    x, w = operands(m, k, n)
    _, up = operands(m, k, n, seed=4)
    live = np.ones(m, bool)
    if live_rows is None:
        live[[0, 3, 4, 20]] = False
        live[40:75] = False
    else:
        live[:] = False
        live[live_rows] = True
    x = x.at[~live].set(jnp.nan)
    for gate_up in (None, up):
        plain, packed = both(x, w, gate_up, 1, jnp.float32, live=jnp.asarray(live))
        assert not np.asarray(packed)[~live].any()
        np.testing.assert_array_equal(np.asarray(packed), np.asarray(plain))


@needs_kernel
def test_batch_invariant_build_reads_packed_weights_the_same():
    """The mode's build (no tiles): a row's bits at any row count, packed or not."""
    x, w = operands(40, 577, 300)
    _, up = operands(40, 577, 300, seed=4)
    with batch_invariant.scope(True):
        rows = []
        for m in (1, 3, 16, 40):
            plain, packed = both(x[:m], w, up, 1, jnp.float32)
            np.testing.assert_array_equal(np.asarray(packed), np.asarray(plain))
            rows.append(np.asarray(packed)[0])
    for row in rows[1:]:
        np.testing.assert_array_equal(row, rows[0])


@needs_kernel
def test_packed_refuses_what_it_cannot_multiply():
    x, w = operands(4, 32, 40)
    packed = pack(w)
    with pytest.raises(ValueError, match=r"`pack` of \[L, K, 72\]"):
        bf16_matmul_packed(x, packed, 72)  # another N: another number of panels
    with pytest.raises(ValueError, match=r"`pack` of"):  # another K, padded past the panels'
        bf16_matmul_packed(jnp.concatenate([x, x], axis=1), packed, 40)
    with pytest.raises(ValueError, match="bfloat16 x and w"):
        bf16_matmul_packed(x.astype(jnp.float32), packed, 40)
    with pytest.raises(ValueError, match="is not like gate"):
        bf16_gated_matmul_packed(x, packed, packed[:, :1], 40)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index out of range"):
        jax.block_until_ready(bf16_matmul_packed(x, packed, 40, 3))

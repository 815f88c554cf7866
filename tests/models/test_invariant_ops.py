"""The fixed-order reductions of the batch-invariant mode (models/invariant.py): a row's sum
is the same bits whatever the number of rows, where XLA's own reduction of an RMSNorm's 576
floats is not (it vectorizes differently from 8 rows on), and it is a sum within float32
rounding; RMSNorm takes it in the mode. The rotary embedding's products rounded alone (jax
0.12 on an AVX2 CPU rounded a few rows' rotation apart from more rows')."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jllm.config import batch_invariant
from jllm.models.invariant import exp_rows, row_sum
from jllm.models.layers import RMSNorm
from jllm.models.rope import RopeConfig, apply_rope


@pytest.mark.parametrize("d", [64, 576, 100, 2048])
def test_row_sum_is_a_sum_in_one_order_for_any_row_count(d):
    x = jnp.asarray(np.random.default_rng(d).standard_normal((300, d)), jnp.float32)
    f = jax.jit(row_sum)
    np.testing.assert_allclose(f(x)[:, 0], np.asarray(x).sum(-1), rtol=1e-5, atol=1e-4)
    base = np.asarray(f(x[:1]))[0]
    for m in (2, 3, 8, 17, 64, 300):
        assert np.asarray(f(x[:m]))[0] == base


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rmsnorm_in_the_mode_is_row_invariant(dtype):
    norm = RMSNorm(576, 1e-5, dtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 576)), dtype)
    with batch_invariant.scope(True):
        f = jax.jit(lambda a: norm(a).astype(jnp.float32))
        base = np.asarray(f(x[:1]))[0]
        for m in (2, 8, 64, 256):
            assert np.array_equal(np.asarray(f(x[:m]))[0], base)
    plain = jax.jit(lambda a: norm(a).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(plain(x[:4])), np.asarray(f(x[:4])), rtol=2e-2)


@pytest.mark.parametrize("e", [8, 60])
def test_exp_rows_is_the_same_for_any_row_count_and_alone(e):
    """A router's softmax terms: XLA's own exp of [1, 8] and of [16, 8] rounded a value
    differently (tests/engine/test_batch_invariant.py's Mixtral caught it)."""
    x = jnp.asarray(np.random.default_rng(e).standard_normal((300, e)) * 3, jnp.float32)
    f = jax.jit(lambda a: exp_rows(a - a.max(-1, keepdims=True)))
    full = np.asarray(f(x))
    np.testing.assert_allclose(
        full, np.exp(np.asarray(x) - np.asarray(x).max(-1, keepdims=True)), rtol=2e-7
    )
    for m in (1, 2, 7, 64, 65, 200):
        assert np.array_equal(np.asarray(f(x[:m])), full[:m])
    for i in range(0, 300, 13):
        assert np.array_equal(np.asarray(f(x[i : i + 1]))[0], full[i])


@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_in_the_mode_is_row_invariant_and_rotates(head_dim):
    """x1 cos - x2 sin per row alike for 1 row and 256 (jax 0.12's CPU backend on an AVX2 CPU
    rounded fewer than 8 rows of 4 heads of 16 apart from more: tests/engine/
    test_batch_invariant.py's tiny Llama caught it), and still the rotation numpy computes."""
    rng = np.random.default_rng(head_dim)
    rope = RopeConfig(inv_freq=tuple(10000.0 ** -(np.arange(0, head_dim, 2) / head_dim)))
    x = jnp.asarray(rng.standard_normal((256, 4, head_dim)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 500, 256), jnp.int32)
    with batch_invariant.scope(True):
        f = jax.jit(lambda a, p: apply_rope(a, p, rope))
        full = np.asarray(f(x, pos))
        for m in (1, 2, 3, 7, 8, 64):
            assert np.array_equal(np.asarray(f(x[:m], pos[:m])), full[:m])
    half = head_dim // 2
    freq = np.asarray(rope.inv_freq, np.float32)  # the angles as the step rounds them
    angle = (np.asarray(pos, np.float32)[:, None, None] * freq).astype(np.float64)
    x1, x2 = np.asarray(x, np.float64)[..., :half], np.asarray(x, np.float64)[..., half:]
    want = np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
    )
    np.testing.assert_allclose(full, want, atol=1e-5)

"""The CPU layer kernels (pallas_kernels/cpu/layer_ops.cc: RMSNorm, the add before it, the
rotary embedding) against oracles, in both builds (AVX512-BF16's lanes, and the plain loop
every other CPU takes), and the model's RMSNorm and `apply_rope` on them against XLA's.

A norm's output is compared with the float64 oracle rounded where the kernel rounds (the sum
of x + h, the normalised row before Llama's weight): the only freedom is the float32 sum of
squares' order, so an output may sit one bf16 step away, and rarely. The rotary embedding
is float32 arithmetic in a fixed order: bitwise numpy's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jllm.config import batch_invariant
from jllm.models import bf16_matmul, layer_ops
from jllm.models.layers import RMSNorm
from jllm.models.rope import RopeConfig, apply_rope
from pallas_kernels.cpu import build as cpu_build
from pallas_kernels.cpu.build import EXACT_ORDER, FfiKernel

BF16 = ml_dtypes.bfloat16
# The plain loop, on any CPU with a compiler: the build without AVX-512.
PLAIN = FfiKernel(
    layer_ops.SOURCE,
    "layer_ops",
    "CPU RMSNorm kernel without AVX-512",
    "JllmAddRmsNorm",
    "jllm_add_rms_norm_plain_cpu",
    extra_flags=EXACT_ORDER + ("-mno-avx512f",),
)
PLAIN_ROPE = FfiKernel(
    layer_ops.SOURCE,
    "layer_ops",
    "CPU rotary embedding kernel without AVX-512",
    "JllmRope",
    "jllm_rope_plain_cpu",
    extra_flags=EXACT_ORDER + ("-mno-avx512f",),
)
FAST = pytest.mark.skipif(
    not bf16_matmul.supported(), reason="the kernel's vector path needs AVX512-BF16"
)


def rows(t, d, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, scale, (t, d)), jnp.bfloat16)
    h = jnp.asarray(rng.normal(0, scale, (t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(1, 0.5, (d,)), jnp.bfloat16)
    return x, h, w


def oracle(x, h, w, eps, unit_offset):
    """(x + h in bf16, the norm of it in bf16), float64 between the roundings."""
    total = (np.asarray(x, np.float64) + np.asarray(h, np.float64)).astype(BF16)
    s = total.astype(np.float64)
    normed = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    w = np.asarray(w, np.float64)
    if unit_offset:
        return total, (normed * (1 + w)).astype(BF16)
    return total, (normed.astype(BF16).astype(np.float64) * w).astype(BF16)


def assert_near(got, want):
    """Equal, or one bf16 step apart in a few elements (the sum of squares' order)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    off = got != want
    assert off.mean() < 0.02, f"{off.sum()} of {off.size} outputs differ"
    np.testing.assert_array_less(np.abs(got - want)[off], 2**-7 * np.abs(want[off]) + 1e-30)


def add_norm(target, x, h, w, eps, unit_offset):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call(target, (out, out))(
        x, h, w, eps=np.float32(eps), unit_offset=unit_offset
    )


@pytest.mark.parametrize("build", [pytest.param("fast", marks=FAST), "plain"])
@pytest.mark.parametrize("t, d", [(1, 576), (33, 576), (70, 100), (5, 7), (3, 2048)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_norm_against_the_oracle(build, t, d, unit_offset):
    target = layer_ops.ADD_NORM.load() if build == "fast" else PLAIN.load()
    x, h, w = rows(t, d, seed=t * d)
    total, y = add_norm(target, x, h, w, 1e-6, unit_offset)
    want_total, want_y = oracle(x, h, w, 1e-6, unit_offset)
    np.testing.assert_array_equal(np.asarray(total), want_total)  # one rounding: exact
    assert_near(y, want_y)


@FAST
def test_norm_alone_and_rows_of_any_shape():
    x, _, w = rows(24, 64, seed=3)
    x3 = x.reshape(4, 6, 64)  # per-head norms: [T, N, H]
    got = layer_ops.rms_norm(x3, w, 1e-5)
    assert got.shape == x3.shape
    _, want = oracle(x, jnp.zeros_like(x), w, 1e-5, False)
    assert_near(got.reshape(24, 64), want)


@FAST
def test_a_row_does_not_depend_on_its_neighbours():
    x, h, w = rows(96, 576, seed=5)
    _, all_rows = layer_ops.add_rms_norm(x, h, w, 1e-5)
    for lo, hi in [(0, 1), (7, 40), (95, 96)]:
        _, some = layer_ops.add_rms_norm(x[lo:hi], h[lo:hi], w, 1e-5)
        np.testing.assert_array_equal(np.asarray(some), np.asarray(all_rows[lo:hi]))


@FAST
def test_zero_rows_and_large_values_stay_finite():
    x, h, w = rows(4, 576, seed=9, scale=1e30)
    x = x.at[0].set(0)
    h = h.at[0].set(0)
    total, y = layer_ops.add_rms_norm(x, h, w, 1e-6)
    assert np.isfinite(np.asarray(y, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(y[0], np.float32), 0)


@FAST
def test_the_model_norm_takes_the_kernel_only_where_it_applies():
    """RMSNorm on the kernel (bf16, the products' kernel in use) within one bf16 step of
    XLA's path; float32 and the batch-invariant mode stay XLA's."""
    if not layer_ops.applies(jnp.bfloat16):
        pytest.skip("the bf16 layer products are XLA's here")
    norm = RMSNorm(576, 1e-5, jnp.bfloat16)
    norm.weight[...] = rows(1, 576, seed=2)[2]
    x, h, _ = rows(16, 576, seed=4)
    text = jax.jit(lambda a, b: norm.add(a, b)).lower(x, h).as_text()
    assert "jllm_add_rms_norm_cpu" in text
    total, y = jax.jit(lambda a, b: norm.add(a, b))(x, h)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(x + h))
    assert_near(y, layer_ops.reference(total, norm.weight[...], 1e-5))
    with batch_invariant.scope(True):
        assert not layer_ops.applies(jnp.bfloat16)
        assert "jllm_rms_norm_cpu" not in jax.jit(norm).lower(x).as_text()
    assert not layer_ops.applies(jnp.float32)


def test_bad_operands_are_refused():
    x, h, w = rows(2, 8)
    with pytest.raises(ValueError, match="bfloat16 x"):
        layer_ops.rms_norm(x.astype(jnp.float32), w, 1e-5)
    with pytest.raises(ValueError, match="w \\[D\\]"):
        layer_ops.rms_norm(x, w[:4], 1e-5)
    with pytest.raises(ValueError, match="is not like x"):
        layer_ops.add_rms_norm(x, h[:1], w, 1e-5)
    with pytest.raises(ValueError, match="2 R <= 8"):
        layer_ops.rope(x.reshape(2, 1, 8), jnp.zeros((2, 5)), jnp.zeros((2, 5)))


def rope_oracle(x, cos, sin):
    """fma(a, c, -(b s)) and fma(b, c, a s) in float32 (each product of two float32s exact
    in float64, the sum rounded once), rounded to bf16."""
    x = np.asarray(x, np.float64)
    r = cos.shape[1]
    c, s = np.asarray(cos, np.float64)[:, None, :], np.asarray(sin, np.float64)[:, None, :]
    a, b = x[..., :r], x[..., r : 2 * r]
    lo = a * c - (b * s).astype(np.float32)
    hi = b * c + (a * s).astype(np.float32)
    rotated = np.concatenate([lo.astype(np.float32), hi.astype(np.float32)], axis=-1)
    return np.concatenate([rotated, x[..., 2 * r :]], axis=-1).astype(BF16)


@pytest.mark.parametrize("build", [pytest.param("fast", marks=FAST), "plain"])
@pytest.mark.parametrize(
    "t, n, h, r", [(1, 9, 64, 32), (37, 3, 64, 32), (5, 2, 80, 20), (4, 1, 10, 3)]
)
def test_rope_against_numpy(build, t, n, h, r):
    """Whole heads (SmolLM2's 64 dims), a partial rotary part (Phi's 80 with 40 rotated),
    and halves that are not a multiple of 16 lanes."""
    rng = np.random.default_rng(t * n + r)
    x = jnp.asarray(rng.normal(0, 2, (t, n, h)), jnp.bfloat16)
    cos = jnp.asarray(rng.uniform(-1, 1, (t, r)), jnp.float32)
    sin = jnp.asarray(rng.uniform(-1, 1, (t, r)), jnp.float32)
    if build == "fast":
        got = layer_ops.rope(x, cos, sin)
    else:
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        got = jax.ffi.ffi_call(PLAIN_ROPE.load(), out)(x, cos, sin)
    np.testing.assert_array_equal(np.asarray(got), rope_oracle(x, cos, sin))


@FAST
def test_apply_rope_takes_the_kernel_where_it_applies(monkeypatch):
    """`apply_rope` on the kernel against its jnp path: the same bits (both fuse the same
    multiply-adds). Under the AVX-512 emulation (tools/avx512_emulation) XLA's code is the
    host's, not the emulated CPU's, and may fuse otherwise: there within a last bit. The jnp
    path is the default mode's (the batch-invariant mode rounds each product alone)."""
    if not layer_ops.applies(jnp.bfloat16):
        pytest.skip("the bf16 layer products are XLA's here")
    rope = RopeConfig(tuple(1.0 / 10000 ** (np.arange(0, 64, 2) / 64)), 1.0)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(0, 1, (300, 3, 64)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 30000, 300), jnp.int32)
    kernel = jax.jit(lambda x, p: apply_rope(x, p, rope))
    assert "jllm_rope_cpu" in kernel.lower(x, positions).as_text()
    got = np.asarray(kernel(x, positions)).astype(np.float32)
    monkeypatch.setattr(layer_ops, "applies", lambda dtype: False)
    jnp_path = jax.jit(lambda x, p: apply_rope(x, p, rope))
    assert "jllm_rope_cpu" not in jnp_path.lower(x, positions).as_text()
    want = jnp_path(x, positions)
    want = np.asarray(want).astype(np.float32)
    if "-DJLLM_AVX512_EMULATION" in cpu_build.FLAGS:
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-14)
        assert np.mean(got != want) < 1e-3
    else:
        np.testing.assert_array_equal(got, want)

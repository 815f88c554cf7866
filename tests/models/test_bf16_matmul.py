"""The CPU bf16 matmul kernel (pallas_kernels/cpu/bf16_matmul.cc) against XLA's product, and the
engine on it: greedy tokens against transformers in float32, and no layer's weights copied
out of the stack in a compiled step. Packed weights (`pack`): the layout against its inverse
and an element-by-element reading, and the products of packed weights bitwise those of the
same weights as [L, K, N].

The kernel needs AVX512-BF16, which both development machines have (Zen 4, and the Xeons
with AMX); elsewhere these tests are skipped with that reason, and the engine's products
stay XLA's (`enabled`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import SMALL, assert_bf16_near_fp32, save_tiny, weight_copies

from jllm import LLM
from jllm.config import batch_invariant
from jllm.models import bf16_matmul, f32_matmul
from jllm.models.bf16_matmul import (
    bf16_gated_matmul,
    bf16_gated_matmul_packed,
    bf16_matmul_packed,
    gated_reference,
    pack,
    reference,
    unpack,
)
from jllm.models.bf16_matmul import bf16_matmul as kernel

pytestmark = pytest.mark.skipif(
    not bf16_matmul.supported(), reason="the bf16 matmul kernel needs AVX512-BF16"
)


def operands(m, k, n, layers=3, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 1, (layers, k, n)), jnp.bfloat16)
    return x, w


def assert_product(x, w, layer, got, out_dtype):
    """float32 results within float32 summation error of XLA's; bf16 ones within one bf16
    rounding of XLA's float32 result."""
    exact = np.asarray(reference(x, w, layer, jnp.float32))
    scale = np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(w[layer], np.float32))
    got = np.asarray(got, np.float32)
    if out_dtype == jnp.float32:
        np.testing.assert_array_less(np.abs(got - exact), 1e-5 * scale + 1e-30)
    else:
        np.testing.assert_array_less(np.abs(got - exact), 2**-8 * np.abs(exact) + 1e-6 * scale)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 96),  # one row (a single decode)
        (64, 576, 192),  # SmolLM2's k_proj at a decode batch: tiles of 13 and 12 rows
        (14, 32, 32),  # one full tile of the vector loop
        (15, 7, 37),  # odd K (the last input paired with zero), a masked right edge
        (130, 128, 64),  # two row blocks (112 + 18)
        (3, 1536, 40),
        # 1 to 4 rows: wide items (4 panels at 1-2 rows, 2 at 3-4), masked past N
        (2, 576, 1536),
        (4, 101, 200),
        (3, 33, 300),
        # 5 rows and more: the AMX tiles where the CPU has them
        (100, 7, 37),  # a partial last tile of 4 rows, odd K padded to 32, a masked edge
        (64, 1000, 65),  # K not a multiple of 32 (a padded copy of x), 3 panels
        (32, 64, 32),  # one whole tile read in place
        (16, 576, 40),  # a half tile: one A tile, two accumulators
    ],
)
def test_matches_xla(m, k, n, out_dtype):
    x, w = operands(m, k, n)
    for layer in (0, 2):
        got = jax.jit(kernel, static_argnums=3)(x, w, layer, out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert_product(x, w, layer, got, out_dtype)
    two_d = kernel(x, w[1], 0, out_dtype)  # an unstacked [K, N] weight
    assert_product(x, w, 1, two_d, out_dtype)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 80),
    n=st.integers(1, 100),
    layer=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_any_shape_matches_xla(m, k, n, layer, seed):
    x, w = operands(m, k, n, layers=2, seed=seed)
    assert_product(x, w, layer, kernel(x, w, layer, jnp.float32), jnp.float32)


def test_rows_are_independent():
    """A NaN in one row (a padding row's garbage, say) reaches no other row's outputs."""
    x, w = operands(20, 96, 70)
    x = x.at[7, 5].set(jnp.nan)
    got = np.asarray(kernel(x, w, 1, jnp.float32))
    assert np.isnan(got[7]).all()
    others = np.delete(np.arange(20), 7)
    assert np.isfinite(got[others]).all()
    assert_product(x[others], w, 1, got[others], jnp.float32)


def test_a_rows_sums_do_not_depend_on_how_many_rows_the_loop_takes():
    """In the vector loop a row's sums are bitwise the same at any row count: 1 to 4 rows
    take wide items of several panels, 5 and more the loop's tiles of up to 14 rows; each
    column sums its inputs in one order either way (what the batch-invariant mode relies on).
    Its build (no AMX) runs every count in the loop; elsewhere the tiles take 5 rows and more."""
    x, w = operands(15, 577, 300)
    _, up = operands(15, 577, 300, seed=4)
    with batch_invariant.scope(True):
        plain = [np.asarray(kernel(x[:m], w, 1, jnp.float32))[0] for m in range(1, 16)]
        gated = [np.asarray(bf16_gated_matmul(x[:m], w, up, 1, jnp.float32))[0] for m in (1, 3, 9)]
    for row in plain[1:]:
        np.testing.assert_array_equal(row, plain[0])
    for row in gated[1:]:
        np.testing.assert_array_equal(row, gated[0])


@pytest.mark.parametrize("scale", [1.0, 40.0])  # 40: gate values in the hundreds, both signs
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 96),
        (2, 64, 300),
        (4, 33, 200),
        (64, 576, 192),
        (15, 7, 37),
        (130, 128, 64),
        (100, 7, 37),
    ],
)
def test_gated_matches_silu_of_the_products(m, k, n, scale):
    """silu(x @ gate) * (x @ up) in one pass: against the kernel's own float32 products (each
    checked against XLA above) through jax.nn.silu, so only its exp approximation differs;
    in bf16 against XLA's float32 reference, within one bf16 rounding."""
    x, gate = operands(m, k, n, seed=1)
    _, up = operands(m, k, n, seed=2)
    x = (x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    g, u = kernel(x, gate, 2, jnp.float32), kernel(x, up, 2, jnp.float32)
    want = np.asarray(jax.nn.silu(g) * u)
    got = np.asarray(bf16_gated_matmul(x, gate, up, 2, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    got16 = np.asarray(bf16_gated_matmul(x, gate, up, 2), np.float32)
    ref = np.asarray(gated_reference(x, gate, up, 2, jnp.float32))
    np.testing.assert_allclose(got16, ref, rtol=2**-8, atol=1e-3 * np.abs(ref).max())


def test_gated_propagates_nan_to_its_row_only():
    x, gate = operands(20, 64, 40)
    _, up = operands(20, 64, 40, seed=3)
    x = x.at[3, 0].set(jnp.nan)
    got = np.asarray(bf16_gated_matmul(x, gate, up, 0, jnp.float32))
    assert np.isnan(got[3]).all() and np.isfinite(np.delete(got, 3, axis=0)).all()


@pytest.mark.parametrize(
    "m,live_rows",
    [
        (90, None),  # runs of every length around padding
        (16, [9]),  # a lone decode in a padded bucket: one wide item row, not row 0
        (16, [5, 6, 7]),  # three rows: the wide items of 3-4 rows
    ],
)
@pytest.mark.parametrize("gated", [False, True])
def test_padding_rows_are_skipped_and_zero(gated, m, live_rows):
    """Rows marked not live (a step's padding) come out zero whatever x holds there (NaN
    here), and the live rows are the full product."""
    k, n = 96, 170
    x, w = operands(m, k, n)
    _, up = operands(m, k, n, seed=4)
    live = np.ones(m, bool)
    if live_rows is None:
        live[[0, 3, 4, 20]] = False
        live[40:75] = False  # a decode bucket's padding: a long run
    else:
        live[:] = False
        live[live_rows] = True
    x = x.at[~live].set(jnp.nan)
    if gated:
        got = bf16_gated_matmul(x, w, up, 1, jnp.float32, live=jnp.asarray(live))
        full = bf16_gated_matmul(x[live], w, up, 1, jnp.float32)
    else:
        got = kernel(x, w, 1, jnp.float32, live=jnp.asarray(live))
        full = kernel(x[live], w, 1, jnp.float32)
    got = np.asarray(got)
    assert not got[~live].any()
    np.testing.assert_array_equal(got[live], np.asarray(full))


def test_refuses_what_it_cannot_multiply():
    x, w = operands(4, 32, 16)
    with pytest.raises(ValueError, match="bfloat16 x and w"):
        kernel(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        kernel(x, w[:, :16])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernel(x, w, 0, jnp.float16)
    with pytest.raises(ValueError, match="live must be"):
        kernel(x, w, 0, live=jnp.ones(5, bool))
    with pytest.raises(ValueError, match="is not like gate"):
        bf16_gated_matmul(x, w, w[:, :, :8])


@pytest.fixture(scope="module")
def bf16_qwen3(tmp_path_factory, tokenizer_dir):
    # Per-head q/k norms and a head dim (32) that is not hidden / heads: o_proj's input
    # (heads x head dim, 128) differs from its output (64).
    return save_tiny("qwen3", tmp_path_factory.mktemp("bf16mm"), tokenizer_dir, torch.bfloat16)


@pytest.mark.parametrize("on", [True, False])
def test_engine_on_the_kernel_against_fp32_oracle(bf16_qwen3, monkeypatch, on):
    """The engine with its layer products on the kernel (and, as the control, on XLA's):
    greedy choices stay the float32 argmax or within bf16's error of it, the kernel is in
    the compiled step (on the projections packed at start-up, models/packing.py), and no
    layer's weight is copied out of the stack there."""
    monkeypatch.setattr(bf16_matmul, "enabled", lambda invariant=False: on)
    monkeypatch.setattr(f32_matmul, "widens_bf16", lambda: False)  # XLA's, as the control
    jax.clear_caches()  # the decision is made at trace time: no trace of the other choice
    llm = LLM(bf16_qwen3, dtype="bfloat16", **SMALL)
    runner = llm.llm_engine.runner
    text = runner.forward_for(runner.layout.shapes()[-1]).as_text()
    assert ("jllm_bf16_matmul_packed_cpu" in text) == on
    assert ("jllm_bf16_gated_matmul_packed_cpu" in text) == on
    gate_shape = (64, 128)  # gate_proj's [D, F]
    assert bool(weight_copies(text, "bf16", gate_shape)) != on
    assert not weight_copies(text, "bf16", (4, 2, 32, 32))  # nor its packed panels

    assert_bf16_near_fp32(llm, bf16_qwen3)
    jax.clear_caches()


@pytest.mark.parametrize(
    "flags,invariant,want,reason",
    [
        ({"avx512f", "avx512_bf16"}, False, True, "the C++ kernel (AVX512-BF16)"),
        ({"avx512_bf16", "amx_bf16"}, False, True, "AMX tiles from 5 rows"),
        ({"avx512_bf16", "amx_bf16"}, True, True, "without AMX, batch-invariant mode"),
        ({"avx2"}, False, False, "no AVX512-BF16"),
    ],
)
def test_where_the_kernel_runs(monkeypatch, caplog, flags, invariant, want, reason):
    monkeypatch.setattr(bf16_matmul, "cpu_flags", lambda: flags)
    with caplog.at_level("INFO", logger="jllm"):
        assert bf16_matmul.enabled.__wrapped__(invariant) is want
    assert reason in caplog.text


@pytest.mark.skipif("amx_bf16" not in bf16_matmul.cpu_flags(), reason="needs AMX")
def test_amx_rows_do_not_depend_on_their_neighbours():
    """On the tiles a row's sums are the same whichever tile it sits in, at any row count
    from 5 (each tile sums its rows' 32-input chunks in one order, half tile or whole);
    below 5 the vector loop takes them. The batch-invariant mode's build (no tiles) gives
    one order at every count."""
    x, w = operands(300, 576, 96)
    counts = (5, 9, 16, 17, 32, 64, 97, 300)
    rows = [np.asarray(kernel(x[:m], w, 1, jnp.float32))[0] for m in counts]
    for row in rows[1:]:
        np.testing.assert_array_equal(row, rows[0])
    with batch_invariant.scope(True):
        exact = [np.asarray(jax.jit(kernel)(x[:m], w, 1))[0] for m in (1, 31, 32, 300)]
    for row in exact[1:]:
        np.testing.assert_array_equal(row, exact[0])


@pytest.mark.skipif(not bf16_matmul.supported(), reason="needs AVX512-BF16")
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 576, 4096),  # a single decode's head: one B tile, one lane group
        (40, 96, 200),  # two row tiles (32 + 8), a partial last block of the table; 3 groups
        (17, 7, 33),  # odd K (padded copies of the table's blocks), a masked right edge
        (64, 1000, 64),  # K not a multiple of 32
    ],
)
def test_transposed_matches_xla(m, k, n):
    """The tied head's product, x @ table.T with the table [N, K] read in place, in float32
    and bf16, stacked or not; padding rows zero. On the AMX tiles where the CPU has them, else
    on the vector loop (x's rows as lanes, two groups of 16 at a time, one at the end)."""
    rng = np.random.default_rng(m + k)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.bfloat16)
    table = jnp.asarray(rng.normal(0, 1, (2, n, k)), jnp.bfloat16)
    flipped = jnp.swapaxes(table, -1, -2)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = kernel(x, table, 1, out_dtype, transposed=True)
        assert got.shape == (m, n) and got.dtype == out_dtype
        assert_product(x, flipped, 1, got, out_dtype)
    live = np.arange(m) % 3 != 1
    got = np.asarray(kernel(x, table[0], 0, jnp.float32, live=jnp.asarray(live), transposed=True))
    assert not got[~live].any()
    assert_product(x[live], flipped, 0, got[live], jnp.float32)
    amx = "amx_bf16" in bf16_matmul.cpu_flags()
    limit = bf16_matmul.HEAD_ROWS if amx else bf16_matmul.HEAD_ROWS_VECTOR
    assert bf16_matmul.head_applies(jnp.bfloat16, 32)
    assert bf16_matmul.head_applies(jnp.bfloat16, limit)
    assert not bf16_matmul.head_applies(jnp.bfloat16, limit + 1)
    with batch_invariant.scope(True):
        assert not bf16_matmul.head_applies(jnp.bfloat16, 1)


# ---- packed weights (`pack`): the products of the same weights packed once are the same bits,
# on the tiles, the vector loop and the batch-invariant build (whose pairs and order they hold)


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

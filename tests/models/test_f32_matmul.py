"""The CPU float32 matmul kernel (pallas_kernels/cpu/f32_matmul.cc) against XLA's product, and the
engine on it: greedy tokens and logprobs against transformers in float32, and the kernel in
every compiled step (the layer products and the tied LM head, its weight transposed) with
no layer's weights copied out of the stack. Its bfloat16 operands (widened to float32, for
CPUs without bf16 instructions) likewise, the engine in bfloat16 against transformers in
float32.

The kernel needs an x86 CPU with FMA and AVX2 (or AVX-512), which every development and CI
machine has; elsewhere these tests are skipped with that reason and the products stay
XLA's (`enabled`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import (
    SMALL,
    assert_bf16_near_fp32,
    prompt_ids,
    save_tiny,
    weight_copies,
    worst_teacher_forced_gaps,
)

from jllm import LLM, SamplingParams
from jllm.models import bf16_matmul, f32_matmul
from jllm.models.f32_matmul import f32_gated_matmul, gated_reference, reference
from jllm.models.f32_matmul import f32_matmul as kernel

pytestmark = pytest.mark.skipif(
    not f32_matmul.supported(), reason="the float32 matmul kernel needs x86 FMA with AVX2"
)


def operands(m, k, n, layers=3, seed=0, transposed=False):
    """x [m, k] and w [layers, k, n], or [layers, n, k] transposed."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (layers, n, k) if transposed else (layers, k, n)), jnp.float32)
    return x, w


def assert_product(x, w, layer, got, transposed=False):
    """Within float32 summation error of XLA's product at the highest precision: K terms
    summed in another order differ by a few K ulps of the sum of the terms' magnitudes."""
    exact = np.asarray(reference(x, w, layer, transposed))
    w = np.asarray(w[layer])
    scale = np.abs(np.asarray(x)) @ np.abs(w.T if transposed else w)
    k = x.shape[1]
    np.testing.assert_array_less(np.abs(np.asarray(got) - exact), 2e-7 * k * scale + 1e-30)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 96),  # one row (a single decode), a panel and an edge
        (64, 576, 192),  # SmolLM2's k_proj at a decode batch: tiles of 6 and 5 rows
        (6, 32, 64),  # one full tile
        (2, 7, 37),  # odd K, columns of an edge only
        (130, 128, 64),  # one block of 22 tiles: the panels packed first
        (200, 48, 70),  # two blocks, and a column edge
        (3, 1536, 40),
    ],
)
def test_matches_xla(m, k, n):
    x, w = operands(m, k, n)
    for layer in (0, 2):
        got = jax.jit(kernel)(x, w, layer)
        assert got.dtype == jnp.float32 and got.shape == (m, n)
        assert_product(x, w, layer, got)
    two_d = kernel(x, w[1], 0)  # an unstacked [K, N] weight
    assert_product(x, w, 1, two_d)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 96),  # one row: dot tiles over w's rows in place
        (5, 37, 30),  # one tile of 5 rows (dot tiles of 3 and 2), K not a multiple of 8
        (64, 576, 200),  # the LM head at a decode batch: panels transposed, an edge of 8
        (200, 45, 70),  # two blocks: the whole weight transposed first
        (13, 8, 33),
    ],
)
def test_transposed_matches_xla(m, k, n):
    """w [L, N, K] (a tied embedding table's [Out, In] layout): x @ w[layer].T."""
    x, w = operands(m, k, n, transposed=True)
    for layer in (0, 2):
        got = jax.jit(kernel, static_argnames="transposed")(x, w, layer, transposed=True)
        assert got.dtype == jnp.float32 and got.shape == (m, n)
        assert_product(x, w, layer, got, transposed=True)
    assert_product(x, w, 1, kernel(x, w[1], transposed=True), transposed=True)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 80),
    n=st.integers(1, 140),
    layer=st.integers(0, 1),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_shape_matches_xla(m, k, n, layer, transposed, seed):
    x, w = operands(m, k, n, layers=2, seed=seed, transposed=transposed)
    got = kernel(x, w, layer, transposed=transposed)
    assert_product(x, w, layer, got, transposed)


def test_rows_are_independent():
    """A NaN in one row (a padding row's garbage, say) reaches no other row's outputs."""
    x, w = operands(20, 96, 70)
    x = x.at[7, 5].set(jnp.nan)
    got = np.asarray(kernel(x, w, 1))
    assert np.isnan(got[7]).all()
    others = np.delete(np.arange(20), 7)
    assert np.isfinite(got[others]).all()
    assert_product(x[others], w, 1, got[others])


@pytest.mark.parametrize("transposed", [False, True])
def test_padding_rows_are_skipped_and_zero(transposed):
    """Rows marked not live (a step's padding) come out zero whatever x holds there (NaN
    here), and the live rows, in runs of every length around them, are the full product."""
    m, k, n = 90, 96, 70
    x, w = operands(m, k, n, transposed=transposed)
    live = np.ones(m, bool)
    live[[0, 3, 4, 20]] = False
    live[40:75] = False  # a decode bucket's padding: a long run
    x = x.at[~live].set(jnp.nan)
    got = np.asarray(kernel(x, w, 1, live=jnp.asarray(live), transposed=transposed))
    assert not got[~live].any()
    want = kernel(x[live], w, 1, transposed=transposed)
    np.testing.assert_array_equal(got[live], np.asarray(want))


BF16 = jnp.bfloat16


def assert_widened_product(x, w, layer, got, transposed=False):
    """got against the float32 product of the operands as they are (bf16 ones widened
    exactly): within float32 summation error, and half a bf16 ulp more where got is bf16."""
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    exact = np.asarray(reference(x32, w32, layer, transposed))
    w32 = np.asarray(w32[layer])
    scale = np.abs(np.asarray(x32)) @ np.abs(w32.T if transposed else w32)
    tol = 2e-7 * x.shape[1] * scale + 1e-30
    if got.dtype == BF16:
        tol = 1.01 * tol + 2.0**-8 * np.abs(exact)
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float32) - exact), tol)


@pytest.mark.parametrize(
    "x_dtype,w_dtype,out_dtype",
    [
        (BF16, BF16, BF16),  # a bf16 model's layer products
        (BF16, BF16, jnp.float32),  # its LM head
        (jnp.float32, BF16, jnp.float32),
        (BF16, jnp.float32, BF16),
    ],
)
@pytest.mark.parametrize(
    "m,k,n,transposed",
    [
        (1, 64, 96, False),  # one tile: w read in place, widened as it is read
        (2, 7, 37, False),  # odd K, columns of an edge only
        (64, 576, 192, False),  # one block: each panel widened as it is packed
        (200, 48, 70, False),  # two blocks: the whole weight widened first, and an edge
        (1, 64, 96, True),  # dot tiles over w's rows in place
        (64, 576, 200, True),  # transposed panels, an edge of 8
        (200, 45, 70, True),
    ],
)
def test_bf16_operands_match_xla(x_dtype, w_dtype, out_dtype, m, k, n, transposed):
    x, w = operands(m, k, n, transposed=transposed)
    x, w = x.astype(x_dtype), w.astype(w_dtype)
    call = jax.jit(kernel, static_argnames=("transposed", "out_dtype"))
    for layer in (0, 2):
        got = call(x, w, layer, transposed=transposed, out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert_widened_product(x, w, layer, got, transposed)


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_padding_rows_are_skipped_and_zero(transposed):
    m, k, n = 90, 96, 70
    x, w = operands(m, k, n, transposed=transposed)
    x, w = x.astype(BF16), w.astype(BF16)
    live = np.ones(m, bool)
    live[[0, 3, 4, 20]] = False
    live[40:75] = False
    x = x.at[~live].set(jnp.nan)
    got = np.asarray(kernel(x, w, 1, live=jnp.asarray(live), transposed=transposed), np.float32)
    assert not got[~live].any()
    want = kernel(x[live], w, 1, transposed=transposed)
    np.testing.assert_array_equal(got[live], np.asarray(want, np.float32))


def test_bf16_result_rounds_as_xla_converts():
    """A bf16 result is the float32 sum rounded once, to nearest even, as XLA's convert
    rounds: ties both ways, the largest float32 to infinity, infinities and NaN kept. x @ 1
    is x, so each result is x rounded; 70 columns cover the vector stores and the edge."""
    bits = np.array(
        [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0x7F7FFFFF, 0xFF7FFFFF],
        np.uint32,
    )
    specials = np.concatenate([bits.view(np.float32), [np.inf, -np.inf, np.nan, 1e-30, 3.0]])
    rng = np.random.default_rng(0)
    values = np.concatenate([specials, rng.normal(0, 100, 20)]).astype(np.float32)
    x = jnp.asarray(values[:, None])  # [M, 1]
    ones = jnp.ones((1, 70), BF16)
    for live in (None, jnp.ones(len(values), bool)):
        got = np.asarray(kernel(x, ones, live=live, out_dtype=BF16))
        want = np.repeat(np.asarray(x.astype(BF16)), 70, axis=1)
        nan = np.isnan(values)
        assert np.isnan(got[nan].astype(np.float32)).all()
        np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


def assert_gated(x, gate, up, layer, got):
    """got against silu(x @ gate) * (x @ up) in float32 through XLA: each product's float32
    summation error carried through (SiLU's slope is below 1.1), the SiLU's own (relative
    2e-7, a few roundings), and half a bf16 ulp more where got is bf16."""
    x32, gate32, up32 = (a.astype(jnp.float32) for a in (x, gate, up))
    want = np.asarray(gated_reference(x32, gate32, up32, layer))
    g = np.asarray(reference(x32, gate32, layer))
    u = np.asarray(reference(x32, up32, layer))
    k, ax = x.shape[1], np.abs(np.asarray(x32))
    e_g = 2e-7 * k * (ax @ np.abs(np.asarray(gate32[layer])))
    e_u = 2e-7 * k * (ax @ np.abs(np.asarray(up32[layer])))
    tol = 1.1 * (np.abs(u) + e_u) * e_g + (np.abs(g) + e_g) * e_u + 1e-6 * np.abs(want) + 1e-30
    if got.dtype == BF16:
        tol = 1.01 * tol + 2.0**-8 * np.abs(want)
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float32) - want), tol)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 96),  # one tile: both weights read in place, and an edge
        (2, 7, 37),  # odd K, columns of an edge only
        (64, 576, 192),  # one block: both panels packed per work item
        (200, 48, 70),  # two blocks: both weights packed first, and an edge
    ],
)
def test_gated_matches_xla(dtype, m, k, n):
    x, gate = operands(m, k, n, seed=1)
    up = operands(m, k, n, seed=2)[1]
    x, gate, up = x.astype(dtype), gate.astype(dtype), up.astype(dtype)
    for layer in (0, 2):
        got = jax.jit(f32_gated_matmul)(x, gate, up, layer)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_gated(x, gate, up, layer, got)


def test_gated_silu_at_the_extremes():
    """Gate sums from -1e4 to 1e4 (SiLU's exp far under- and overflowing), and NaN: the
    result is XLA's silu(g) * u, and a NaN row stays NaN without reaching the others."""
    g_values = np.array([-1e4, -300, -88, -87, -20, -1, -1e-3, 0, 1e-3, 1, 20, 88, 300, 1e4])
    x = jnp.asarray(np.concatenate([g_values, [np.nan]])[:, None], jnp.float32)  # [15, 1]
    gate = jnp.ones((1, 40), jnp.float32)
    up = jnp.full((1, 40), 0.5, jnp.float32)
    got = np.asarray(f32_gated_matmul(x, gate, up))
    g = np.asarray(x)
    want = np.broadcast_to(np.asarray(jax.nn.silu(x) * (x * 0.5)), got.shape)
    # Below a gate of -87 the sigmoid is taken as exp(-87), 1.6e-38, in place of a smaller
    # one: an error of at most 1.6e-38 of |g * u|, far under any float32 sum's rounding.
    tol = 2e-6 * np.abs(want) + 2e-38 * np.abs(g * g * 0.5)
    np.testing.assert_array_less(np.abs(got[:-1] - want[:-1]), tol[:-1] + 1e-45)
    assert np.isnan(got[-1]).all()


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_gated_padding_rows_are_skipped_and_zero(dtype):
    m, k, n = 90, 96, 70
    x, gate = operands(m, k, n, seed=1)
    up = operands(m, k, n, seed=2)[1]
    x, gate, up = x.astype(dtype), gate.astype(dtype), up.astype(dtype)
    live = np.ones(m, bool)
    live[[0, 3, 4, 20]] = False
    live[40:75] = False
    x = x.at[~live].set(jnp.nan)
    got = np.asarray(f32_gated_matmul(x, gate, up, 1, live=jnp.asarray(live)), np.float32)
    assert not got[~live].any()
    want = f32_gated_matmul(x[live], gate, up, 1)
    np.testing.assert_array_equal(got[live], np.asarray(want, np.float32))


def test_refuses_what_it_cannot_multiply():
    x, w = operands(4, 32, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        kernel(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="float32 or bfloat16 the result"):
        kernel(x, w, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="is not like gate"):
        f32_gated_matmul(x, w, w[:, :, :8])
    with pytest.raises(ValueError, match="is not like gate"):
        f32_gated_matmul(x, w, w.astype(BF16))
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        kernel(x, w[:, :16])
    with pytest.raises(ValueError, match=r"w \[L, N, K\]"):
        kernel(x, w, transposed=True)  # [L, K, N] given for [L, N, K]
    with pytest.raises(ValueError, match="live must be"):
        kernel(x, w, 0, live=jnp.ones(5, bool))


def assert_steps_on_the_kernel(llm, dtype: str):
    """The smallest and the largest forward bucket of the tiny Qwen3 each run q, k, v, o and
    down on the kernel, gate and up in one gated call, and nothing on the bf16 kernel; no
    layer's weights are copied out of the stack. The sampler's step runs the tied LM head
    once, transposed."""
    runner = llm.llm_engine.runner
    gate_shape = (64, 128)  # gate_proj's [D, F]
    keys = runner.layout.shapes()
    for key in (keys[0], keys[-1]):
        text = runner.forward_for(key).as_text()
        assert text.count('custom_call_target="jllm_f32_matmul_cpu"') == 5, key
        assert text.count('custom_call_target="jllm_f32_gated_matmul_cpu"') == 1, key
        assert "jllm_bf16" not in text, key
        assert not weight_copies(text, dtype, gate_shape), key
    hidden = runner.forward_for(keys[0]).out_info[0]
    text = runner._sample_executable(runner.layout.sample_buckets[0], hidden).as_text()
    assert text.count('custom_call_target="jllm_f32_matmul_cpu"') == 1
    assert text.count("w_transposed = true") == 1


@pytest.fixture(scope="module")
def f32_qwen3(tmp_path_factory, tokenizer_dir):
    # Per-head q/k norms and a head dim (32) that is not hidden / heads: o_proj's input
    # (heads x head dim, 128) differs from its output (64).
    return save_tiny("qwen3", tmp_path_factory.mktemp("f32mm"), tokenizer_dir)


def test_engine_on_the_kernel_against_transformers(f32_qwen3):
    """A float32 engine runs every step's layer products (the MLP's gate and up in one gated
    call) and its tied LM head on the kernel, with no copy of a layer's weights out of the
    stack, in decode and prefill buckets alike; its greedy choices and logprobs are
    transformers' in float32."""
    jax.clear_caches()
    llm = LLM(f32_qwen3, dtype="float32", **SMALL)
    assert_steps_on_the_kernel(llm, "f32")

    model = transformers.AutoModelForCausalLM.from_pretrained(f32_qwen3).eval()
    assert model.config.tie_word_embeddings
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    batch = prompt_ids(2, 5) + prompt_ids(1, 40, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    runs = [(p, o.outputs[0]) for p, o in zip(batch, outs, strict=True)]
    worst_choice, worst_logprob = worst_teacher_forced_gaps(model, runs)
    assert worst_choice <= 1e-4, worst_choice
    assert worst_logprob <= 1e-3, worst_logprob
    jax.clear_caches()


@pytest.fixture(scope="module")
def bf16_qwen3(tmp_path_factory, tokenizer_dir):
    return save_tiny("qwen3", tmp_path_factory.mktemp("f32mm16"), tokenizer_dir, torch.bfloat16)


def test_bf16_engine_widened_against_fp32_oracle(bf16_qwen3, monkeypatch):
    """A bfloat16 engine on a CPU without bf16 instructions (forced here, whatever this CPU
    has): every layer product and the tied LM head on the kernel, widening the bf16 weights
    in the stack, none copied out of it; greedy choices stay the float32 argmax or within
    bf16's error of it (the bounds of the bf16 kernel's test)."""
    monkeypatch.setattr(bf16_matmul, "enabled", lambda invariant=False: False)
    monkeypatch.setattr(f32_matmul, "widens_bf16", lambda: True)
    jax.clear_caches()
    llm = LLM(bf16_qwen3, dtype="bfloat16", **SMALL)
    assert_steps_on_the_kernel(llm, "bf16")

    assert_bf16_near_fp32(llm, bf16_qwen3)
    jax.clear_caches()


@pytest.mark.parametrize(
    "flags,want",
    [({"avx2", "fma"}, True), ({"avx512f", "avx512_bf16"}, False), ({"amx_bf16"}, False)],
)
def test_which_cpus_widen_bf16(monkeypatch, flags, want):
    """bf16 products come here only where neither the bf16 kernel (AVX512-BF16) nor XLA's
    AMX products take them."""
    monkeypatch.setattr(f32_matmul, "cpu_flags", lambda: flags)
    assert f32_matmul.widens_bf16() is want


@pytest.mark.parametrize(
    "flags,want,reason",
    [
        ({"avx2", "fma"}, True, "the C++ kernel"),
        ({"avx512f", "fma"}, True, "the C++ kernel"),
        ({"sse4_2"}, False, "no FMA with AVX2"),
    ],
)
def test_where_the_kernel_runs(monkeypatch, caplog, flags, want, reason):
    monkeypatch.setattr(f32_matmul, "cpu_flags", lambda: flags)
    with caplog.at_level("INFO", logger="jllm"):
        assert f32_matmul.enabled.__wrapped__() is want
    assert reason in caplog.text

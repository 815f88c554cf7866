"""MLA's latent attention in its absorbed form (`AttentionOptions(latent=True)`) on the XLA
path: against the kit's jnp reference, and against a float64 numpy oracle of the expanded
form, whose identity with the absorbed one is the point of MLA: with k_nope = c_kv W_UK and
v = c_kv W_UV per head, attention of [q_nope, q_pe] over keys [k_nope, k_pe] and values v
equals attention of [q_nope W_UK^T, q_pe] over the cached latents [c_kv, k_pe] with values
c_kv, projected through W_UV. Over one step's decode rows (two bands) and prefill chunks that
start mid-sequence and inside blocks (two bands of tiles), crossed with the options a latent
layer can take, a float8 cache, and the refusal of every other backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batches import tiled_flat_batch

from jllm.attention import AttentionOptions, get_backend
from jllm.attention.base import write_latent
from jllm.engine.platform import resolve_backend
from pallas_kernels.ragged_paged_attention import (
    from_cache,
    ragged_paged_attention_reference,
    to_cache,
)

S, C, P = 16, 4, 48
R, ROPE, N = 32, 16, 4  # kv_lora_rank, qk_rope_head_dim, query heads
NOPE, V = 16, 16  # the expanded form's qk_nope_head_dim and v_head_dim
H = R + ROPE  # the latent's width
SCALE = (NOPE + ROPE) ** -0.5
# 15 decodes and a padding row: two bands of 8. Prefills (cached, new): chunks past a long
# context starting inside a block (500 = 31 * 16 + 4, 37), a fresh prompt, and one ending on
# a block's edge (308 + 12 = 320): 15 tiles and a padding one, two bands.
DECODES = [600, 583, 530, 470, 400, 333, 320, 300, 130, 96, 64, 40, 33, 17, 3]
PREFILLS = [(500, 20), (37, 12), (0, 13), (308, 12)]
T = len(DECODES) + 1 + 16 * C  # the flat batch's tokens
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def latent_options(**more) -> AttentionOptions:
    return AttentionOptions(scale=SCALE, latent=True, v_head_dim=R, **more)


def token_positions(flat):
    """[(token, row, position)] of every real query token of the flat batch."""
    rows = zip(flat.query_start, flat.query_lens, flat.kv_lens, strict=True)
    return [(q0 + i, row, kv - n + i) for row, (q0, n, kv) in enumerate(rows) for i in range(n)]


def run_step(options, q, latent, seed=0, fp8=None, backend="xla"):
    """One step of layer 1 on `backend` with the latent queries q [T, N, H] and new
    latents [T, H]: layer 0 is NaN (NaN bytes in a float8 cache) and, with a window or a local
    chunk, so is every slot of a row's pages that its queries do not see. Checks the latents
    the step wrote. -> (out, the reference's, the cache as written, the flat batch, the
    metadata)."""
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if fp8 else np.float32
    flat, B, first_key = tiled_flat_batch(
        rng,
        S,
        C,
        P,
        H * np.dtype(dtype).itemsize,
        DECODES,
        PREFILLS,
        window=options.window,
        chunk_size=options.chunk_size,
        tiles=16,
    )
    assert len(flat.slot_mapping) == T
    flat.kv_fp8 = None if fp8 is None else fp8.name
    cache = np.array(to_cache(rng.normal(size=(2, B, S, H)), dtype, fp8))  # [L, B, S, H]
    new = latent.reshape(T, H)
    expected = write_latent(jnp.asarray(cache), 1, new, jnp.asarray(flat.slot_mapping), fp8)
    cache[0] = 0x7F if fp8 else np.nan
    if options.window is not None or options.chunk_size is not None:
        for row, (lo, kv) in enumerate(zip(first_key, flat.kv_lens, strict=True)):
            pos = np.arange(-(-kv // S) * S)
            pos = pos[(pos < lo) | (pos >= kv)]
            cache[1, flat.block_tables[row, pos // S], pos % S] = np.nan
    sinks = jnp.asarray(rng.normal(size=N) * 2, jnp.float32) if options.sinks else None
    impl = get_backend(backend)
    md = impl.build_metadata(flat)
    attend = jax.jit(
        lambda q, k, cache, md, sinks: impl.attend(q, k, None, cache, 1, md, options, sinks)
    )
    out, written = attend(q, latent, jnp.asarray(cache), md, sinks)

    real = flat.slot_mapping < B * S
    slots = flat.slot_mapping[real]
    assert len(slots) == len(DECODES) + sum(n for _, n in PREFILLS)
    np.testing.assert_array_equal(
        np.asarray(written[1]).reshape(B * S, H)[slots],
        np.asarray(expected[1]).reshape(B * S, H)[slots],
    )
    ref = ragged_paged_attention_reference(
        q,
        expected[1],
        *map(jnp.asarray, (flat.kv_lens, flat.block_tables, flat.query_start, flat.query_lens)),
        jnp.asarray([len(flat.kv_lens)], np.int32),
        sm_scale=options.scale,
        sliding_window=options.window,
        soft_cap=options.soft_cap,
        chunk_size=options.chunk_size,
        sinks=sinks,
        v_head_dim=options.v_head_dim,
        latent=True,
        fp8_dtype=fp8,
    )
    return np.asarray(out), np.asarray(ref), np.asarray(expected[1]), flat, md


def test_absorbed_latent_attention_equals_expanded_mla():
    """The formula, built from MLA's weights: the XLA path and the reference on the absorbed
    query, projected through W_UV, equal float64 attention over the expanded heads."""
    rng = np.random.default_rng(1)
    q_nope = rng.normal(size=(T, N, NOPE))
    q_pe = rng.normal(size=(T, N, ROPE))
    w_uk = rng.normal(size=(R, N, NOPE)) / np.sqrt(R)  # c_kv -> each head's k_nope
    w_uv = rng.normal(size=(R, N, V)) / np.sqrt(R)  # c_kv -> each head's value
    q = np.concatenate([np.einsum("TNP,RNP->TNR", q_nope, w_uk), q_pe], axis=-1)
    latent = rng.normal(size=(T, H))  # the new tokens' [c_kv, k_pe]
    to32 = jnp.float32
    out, ref, cache, flat, md = run_step(
        latent_options(), jnp.asarray(q, to32), jnp.asarray(latent, to32)
    )
    assert len(md.decode_chunks) == 2 and len(md.tile_chunks) == 2
    assert out.shape == (T, N, R) and np.isfinite(out).all()

    cache = cache.astype(np.float64).reshape(-1, S, H)
    expanded = np.zeros((T, N, V))
    tokens = token_positions(flat)
    for t, row, pos in tokens:
        keys = np.arange(pos + 1)
        ctx = cache[flat.block_tables[row, keys // S], keys % S]  # [s, H]
        c_kv, k_pe = ctx[:, :R], ctx[:, R:]
        k_nope = np.einsum("sR,RNP->sNP", c_kv, w_uk)
        v = np.einsum("sR,RNV->sNV", c_kv, w_uv)
        scores = (np.einsum("NP,sNP->Ns", q_nope[t], k_nope) + q_pe[t] @ k_pe.T) * SCALE
        p = np.exp(scores - scores.max(-1, keepdims=True))
        expanded[t] = np.einsum("Ns,sNV->NV", p / p.sum(-1, keepdims=True), v)
    rows = [t for t, _, _ in tokens]
    for got in (out, ref):
        projected = np.einsum("TNR,RNV->TNV", got[rows].astype(np.float64), w_uv)
        np.testing.assert_allclose(projected, expanded[rows], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(out[rows], ref[rows], atol=2e-5, rtol=1e-5)


CASES = {
    # Latents given as [T, 1, H] (k_pe's head axis kept) in this one.
    "window, soft cap, sinks": latent_options(window=40, soft_cap=2.0, sinks=True),
    # Local chunks of 12 keys in blocks of 16: chunk starts inside blocks.
    "chunk inside blocks": latent_options(chunk_size=12),
}


@pytest.mark.parametrize("name", list(CASES))
def test_latent_crossed_with_options_matches_reference(name):
    options = CASES[name]
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    latent = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    if options.sinks:
        latent = latent[:, None]
    out, ref, _, flat, md = run_step(options, q, latent)
    rows = [t for t, _, _ in token_positions(flat)]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[rows], ref[rows], atol=2e-5, rtol=1e-5)
    assert md.decode_first[0] > 0 and md.tile_first[0] > 0  # the long bands skip chunks


def test_latent_float8_cache():
    """A float8 cache held as bytes: the new latents are written saturated to e4m3, and
    read back so by the tiles and the reference alike."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    latent = jnp.asarray(rng.normal(size=(T, H)) * 4, jnp.float32).at[0, 0].set(1e6)
    out, ref, cache, flat, _ = run_step(latent_options(), q, latent, fp8=FP8)
    assert cache.dtype == np.uint8
    decode_slot = flat.slot_mapping[0]
    top = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448: saturated, not NaN
    first = from_cache(jnp.asarray(cache.reshape(-1, H)[decode_slot, 0]), jnp.float32, FP8)
    assert float(first) == top
    rows = [t for t, _, _ in token_positions(flat)]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[rows], ref[rows], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_kernel", "pallas_interpret", "pallas_gpu_interpret"])
@pytest.mark.parametrize("fp8", [None, FP8])
def test_kernel_backends_attend_latent_layers(backend, fp8):
    """The step's latents written and read by the C++ kernel and the Pallas kernels
    (interpret mode) as by the reference, a float8 cache too; the window and soft cap cross
    with the latent."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    latent = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    options = latent_options(window=40, soft_cap=2.0) if fp8 is None else latent_options()
    out, ref, _, flat, _ = run_step(options, q, latent, fp8=fp8, backend=backend)
    rows = [t for t, _, _ in token_positions(flat)]
    assert out.shape == (T, N, R) and np.isfinite(out).all()
    np.testing.assert_allclose(out[rows], ref[rows], atol=1e-4 if fp8 else 2e-5, rtol=1e-5)


def test_the_kernels_refuse_narrower_values_outside_a_latent():
    """The kernels take a latent, not narrower values beside keys of their own, nor a
    latent's sinks."""
    narrower = "unlike the key head size \\(v_head_dim=8\\) outside a latent layer"
    for name in ("cpu_kernel", "pallas", "pallas_gpu"):
        impl = get_backend(name)
        with pytest.raises(ValueError, match=narrower):
            impl.check(AttentionOptions(scale=1.0, v_head_dim=8))
        with pytest.raises(ValueError, match=f"'{name}' has no attention sinks"):
            impl.attend(None, None, None, None, 0, None, latent_options(sinks=True))


def test_start_up_takes_the_kernels_or_xla_for_latent_layers():
    layers = [latent_options()]
    assert resolve_backend("cpu_kernel", "cpu", jnp.float32, options=layers) == "cpu_kernel"
    assert resolve_backend("auto", "cpu", jnp.bfloat16, options=layers) == "cpu_kernel"
    sinks = [latent_options(sinks=True)]
    assert resolve_backend("auto", "cpu", jnp.bfloat16, options=sinks) == "xla"
    assert resolve_backend("auto", "tpu", jnp.bfloat16, options=layers) == "pallas"
    # DeepSeek's head_dim is its rotary lanes, the GPU kernel's other load beside the values
    gpu = resolve_backend("auto", "gpu", jnp.bfloat16, head_dim=ROPE, options=layers)
    assert gpu == "pallas_gpu"
    odd = [AttentionOptions(scale=1.0, latent=True, v_head_dim=24)]
    assert resolve_backend("auto", "gpu", jnp.bfloat16, head_dim=ROPE, options=odd) == "xla"
    with pytest.raises(ValueError, match="kv_lora_rank 24"):
        resolve_backend("pallas_gpu_interpret", "cpu", jnp.float32, options=odd)


def test_latent_inputs_are_checked():
    with pytest.raises(ValueError, match="set v_head_dim to its kv_lora_rank"):
        AttentionOptions(scale=1.0, latent=True)
    with pytest.raises(ValueError, match="latent says whether the layer is MLA's"):
        AttentionOptions(scale=1.0, latent=1, v_head_dim=R)
    assert latent_options().used() == ("latent", "v_head_dim")

    flat, B, _ = tiled_flat_batch(np.random.default_rng(0), S, C, P, H * 4, [5], [(0, 3)])
    md = get_backend("xla").build_metadata(flat)
    T = len(flat.slot_mapping)
    q, k, cache = jnp.zeros((T, N, H)), jnp.zeros((T, H)), jnp.zeros((1, B, S, H))
    xla = get_backend("xla")
    with pytest.raises(ValueError, match="pass v=None"):
        xla.attend(q, k, k, cache, 0, md, latent_options())
    with pytest.raises(ValueError, match=r"cache is \[L, B, S, H\] \(no head axis\)"):
        xla.attend(q, k, None, cache[:, :, :, None], 0, md, latent_options())
    with pytest.raises(ValueError, match="k \\[T, H\\] or \\[T, 1, H\\]"):
        xla.attend(q, k[:, :R], None, cache, 0, md, latent_options())
    with pytest.raises(ValueError, match="v_head_dim=48\\) are the first lanes"):
        xla.attend(q, k, None, cache, 0, md, AttentionOptions(scale=1.0, latent=True, v_head_dim=H))
    metadata = map(
        jnp.asarray, (flat.kv_lens, flat.block_tables, flat.query_start, flat.query_lens)
    )
    args = (*metadata, jnp.asarray([len(flat.kv_lens)], np.int32))
    with pytest.raises(ValueError, match="fewer than its 48: got v_head_dim=None"):
        ragged_paged_attention_reference(q, cache[0], *args, latent=True)
    with pytest.raises(ValueError, match=r"latent kv_cache is \[B, S, H\]"):
        ragged_paged_attention_reference(q, cache, *args, latent=True, v_head_dim=R)

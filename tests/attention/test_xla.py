"""The XLA backend's attention options against the kit's jnp reference: attention sinks,
chunked local attention and a value head size unlike the key head size, alone and crossed
with the sliding window and the soft cap, over one step's decode rows (two bands of them) and
prefill tiles (chunks that start mid-sequence, two bands), with NaN in every slot a row's
queries do not see."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batches import tiled_flat_batch

from jllm.attention import AttentionOptions, get_backend, write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

S, C, K, G, P = 16, 4, 2, 2, 48
N = K * G
# 15 decodes and a padding row: two bands of 8 rows. Prefills (cached, new): chunks past a
# long context, a fresh prompt, a short continuation: 15 tiles and a padding one, two bands.
DECODES = [600, 583, 530, 470, 400, 333, 320, 300, 130, 96, 64, 40, 33, 17, 3]
PREFILLS = [(500, 20), (300, 9), (0, 13), (37, 12)]


def reference(q, cache, flat, options, sinks):
    return ragged_paged_attention_reference(
        q,
        cache,
        *map(jnp.asarray, (flat.kv_lens, flat.block_tables, flat.query_start, flat.query_lens)),
        jnp.asarray([len(flat.kv_lens)], np.int32),
        sm_scale=options.scale,
        sliding_window=options.window,
        soft_cap=options.soft_cap,
        chunk_size=options.chunk_size,
        sinks=sinks,
        v_head_dim=options.v_head_dim,
    )


def run_step(options, H, Hv, seed=0):
    """One step on the XLA backend with `options` (keys of head size H, values Hv): the layer
    the step does not attend is NaN and, with a window or a local chunk, so is every slot of
    a row's pages that its queries do not see (a freed block may hold anything). Checks the
    K/V the step wrote. -> (out, the reference's output on the clean cache, the metadata, the
    rows that are tokens, the reference of any options on the same inputs)."""
    rng = np.random.default_rng(seed)
    Hc = max(H, Hv)  # the cache's head size
    flat, B, first_key = tiled_flat_batch(
        rng,
        S,
        C,
        P,
        2 * K * Hc * 4,
        DECODES,
        PREFILLS,
        window=options.window,
        chunk_size=options.chunk_size,
        tiles=16,
    )
    T = len(flat.slot_mapping)
    clean = rng.normal(size=(2, B, S, 2 * K, Hc)).astype(np.float32)  # [L, B, S, 2K, Hc]
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(T, K, Hv)), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=N) * 2, jnp.float32) if options.sinks else None

    cache = clean.copy()
    cache[0] = np.nan
    local = options.window is not None or options.chunk_size is not None
    for r, (lo, kv) in enumerate(zip(first_key, flat.kv_lens, strict=True)):
        if not local:
            break
        pos = np.arange(-(-kv // S) * S)
        pos = pos[(pos < lo) | (pos >= kv)]
        cache[1, flat.block_tables[r, pos // S], pos % S] = np.nan
    md = get_backend("xla").build_metadata(flat)
    attend = jax.jit(
        lambda q, k, v, cache, md, sinks: get_backend("xla").attend(
            q, k, v, cache, 1, md, options, sinks=sinks
        )
    )
    out, written = attend(q, k, v, jnp.asarray(cache), md, sinks)

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, 0), (0, Hc - x.shape[-1])])

    # The cache written as the backend's docstring says: values (or keys) padded to Hc.
    clean = write_kv(jnp.asarray(clean), 1, pad(k), pad(v), jnp.asarray(flat.slot_mapping))
    real = flat.slot_mapping < B * S
    assert real.sum() == len(DECODES) + sum(n for _, n in PREFILLS)
    slots = flat.slot_mapping[real]
    np.testing.assert_array_equal(
        np.asarray(written[1]).reshape(B * S, 2 * K, Hc)[slots],
        np.asarray(clean[1]).reshape(B * S, 2 * K, Hc)[slots],
    )

    def ref(options):
        with_sinks = sinks if options.sinks else None
        return np.asarray(reference(pad(q), clean[1], flat, options, with_sinks))

    return np.asarray(out), ref(options), md, real, ref


CASES = {
    "sinks": AttentionOptions(scale=0.25, sinks=True),
    # Chunks of 12 keys in blocks of 16: boundaries inside blocks.
    "chunk inside blocks": AttentionOptions(scale=0.25, chunk_size=12),
    # Chunks of 40: across blocks, boundaries inside them and on their edges (80, 160, ...).
    "chunk across blocks, soft cap, sinks": AttentionOptions(
        scale=0.25, chunk_size=40, soft_cap=2.0, sinks=True
    ),
    "window, soft cap, sinks": AttentionOptions(scale=0.25, window=40, soft_cap=1.5, sinks=True),
    "chunk and window": AttentionOptions(scale=0.25, chunk_size=32, window=20),
    "narrow values": AttentionOptions(scale=0.25, v_head_dim=8),
    "narrow values, window, soft cap, sinks": AttentionOptions(
        scale=0.25, v_head_dim=8, window=30, soft_cap=2.0, sinks=True
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_xla_options_match_reference(name):
    options = CASES[name]
    H = 16
    out, ref, md, real, reference_of = run_step(options, H, options.v_head_dim or H)
    assert out.shape == (len(real), N, options.v_head_dim or H)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[real], ref[real], atol=2e-5, rtol=1e-5)
    # Two bands of each kind of row; with a window or a local chunk the long rows' bands
    # (each row's first key past 256) skip the first chunk of keys.
    assert len(md.decode_chunks) == 2 and len(md.tile_chunks) == 2
    if options.window or options.chunk_size:
        assert md.decode_first[0] > 0 and md.tile_first[0] > 0
    # Each new option has an effect: the reference without it differs.
    for field, off in (("sinks", False), ("chunk_size", None)):
        if getattr(options, field) not in (None, False):
            without = reference_of(dataclasses.replace(options, **{field: off}))
            assert not np.allclose(without[real], ref[real], atol=1e-3), field


def test_xla_values_wider_than_keys():
    """Keys of 8 lanes, values of 16: the cache holds 16, queries and keys padded with zeros
    leave the scores as they were."""
    options = AttentionOptions(scale=0.3, v_head_dim=16, chunk_size=20, sinks=True)
    out, ref, _, real, _ = run_step(options, 8, 16, seed=1)
    assert out.shape[-1] == 16
    np.testing.assert_allclose(out[real], ref[real], atol=2e-5, rtol=1e-5)


def test_xla_refuses_inconsistent_sinks_and_head_sizes():
    flat, _, _ = tiled_flat_batch(np.random.default_rng(0), S, C, P, 256, [5], [(0, 3)])
    md = get_backend("xla").build_metadata(flat)
    T = len(flat.slot_mapping)
    q, kv = jnp.zeros((T, N, 16)), jnp.zeros((T, K, 16))
    cache = jnp.zeros((1, 8, S, 2 * K, 16))
    xla = get_backend("xla")
    with pytest.raises(ValueError, match="sinks=True, but none were given"):
        xla.attend(q, kv, kv, cache, 0, md, AttentionOptions(scale=1.0, sinks=True))
    with pytest.raises(ValueError, match="sinks=False, but they were given"):
        xla.attend(q, kv, kv, cache, 0, md, AttentionOptions(scale=1.0), sinks=jnp.zeros(N))
    with pytest.raises(ValueError, match=r"sinks must be \[N=4\]"):
        xla.attend(
            q, kv, kv, cache, 0, md, AttentionOptions(scale=1.0, sinks=True), sinks=jnp.zeros(2)
        )
    with pytest.raises(ValueError, match="v has head size 16, the layer's options say 8"):
        xla.attend(q, kv, kv, cache, 0, md, AttentionOptions(scale=1.0, v_head_dim=8))
    with pytest.raises(ValueError, match="keys of 16 and values of 32 need 32"):
        v = jnp.zeros((T, K, 32))
        xla.attend(q, kv, v, cache, 0, md, AttentionOptions(scale=1.0, v_head_dim=32))

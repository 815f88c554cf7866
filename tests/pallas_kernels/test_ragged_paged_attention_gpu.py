"""The GPU flavour of ragged paged attention (Pallas on Triton) against the kit's jnp
reference: in interpret mode on the CPU across the kit's cases (and under `shard_map`, in
the TPU kernel's tests), lowered to Triton for an
H100 without one (every operation has a Triton lowering and a power-of-two shape), and on a
real GPU where one is present (the `gpu` marker).

The batches come from the TPU kernel's tests: permuted block tables, NaN query rows between
requests, padding requests whose metadata points at real rows, NaN in every unowned slot.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged_batches import MIX, assert_matches, horizon_batch, make_batch

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    unsupported_shape,
)
from pallas_kernels.ragged_paged_attention.gpu import _tile_table, default_tiling

interpret = functools.partial(ragged_paged_attention_gpu, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s", [8, 16])
@pytest.mark.parametrize("n,k", [(4, 4), (8, 2), (6, 1), (9, 3)])
def test_matches_reference(dtype, s, n, k):
    # G = 1, 4, 6 and 3: groups that do and do not divide the 16-row tile.
    args, _ = make_batch(MIX, n=n, k=k, h=16, s=s, dtype=dtype, seed=s + n)
    ref = ragged_paged_attention_reference(*args)
    out = interpret(*args)
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize(
    "block_m,pages_per_tile,splits",
    [(16, 2, 1), (16, 2, 3), (32, 4, 1), (64, 8, 2), (16, 16, 8)],
)
def test_tilings(block_m, pages_per_tile, splits):
    # pages_per_tile=16 exceeds P (masked pages); 8 splits exceed most requests' KV tiles.
    args, _ = make_batch(MIX, n=8, k=2, h=32, s=8, dtype=jnp.float32, seed=block_m + splits)
    ref = ragged_paged_attention_reference(*args)
    out = interpret(*args, block_m=block_m, pages_per_tile=pages_per_tile, num_kv_splits=splits)
    assert_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (None, 1.0), (12, 2.0), (1, None)])
@pytest.mark.parametrize("splits", [1, 2])
def test_window_and_soft_cap(sliding_window, soft_cap, splits):
    args, _ = make_batch(MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32, seed=7)
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    ref = ragged_paged_attention_reference(*args, **options)
    out = interpret(*args, **options, num_kv_splits=splits, pages_per_tile=2)
    assert_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize("sliding_window", [None, 24])  # 24: longer than every span
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q_horizon_matches_reference(dtype, sliding_window):
    # Tiles of 4 tokens (G = 4) over 16 KV positions: a span's rows read KV tiles past their
    # tile's last causal position, in one part or split over 3.
    args, _, horizon = horizon_batch(dtype, seed=5)
    options = dict(sliding_window=sliding_window)
    ref = ragged_paged_attention_reference(*args, q_horizon=horizon, **options)
    causal = ragged_paged_attention_reference(*args, **options)
    assert not np.allclose(ref.astype(jnp.float32), causal.astype(jnp.float32), atol=0.1)
    for splits in (1, 3):
        out = interpret(
            *args, q_horizon=horizon, **options, block_m=16, pages_per_tile=2, num_kv_splits=splits
        )
        assert out.dtype == dtype
        assert_matches(out, ref, args, dtype)


def _sinks(n, seed):
    """gpt-oss's learned sink logits: one per query head, of the scores' scale."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(n) * 2, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,k", [(8, 2), (9, 3)])
@pytest.mark.parametrize("splits", [1, 8])
def test_sinks_match_reference(dtype, n, k, splits):
    # MIX mixes decodes and prefill chunks; G = 4 and 3 (a tile's rows wrap over the group
    # mid-tile); 8 splits leave some parts of every request with no KV tile.
    args, _ = make_batch(MIX, n=n, k=k, h=16, s=8, dtype=dtype, seed=n + splits)
    sinks = _sinks(n, seed=n)
    ref = ragged_paged_attention_reference(*args, sinks=sinks)
    without = ragged_paged_attention_reference(*args)
    assert not np.allclose(ref.astype(jnp.float32), without.astype(jnp.float32), atol=0.1)
    out = interpret(*args, sinks=sinks, num_kv_splits=splits, pages_per_tile=2)
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (None, 1.0), (1, 2.0)])
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_with_window_and_soft_cap(sliding_window, soft_cap, splits):
    # A soft cap of 1 bounds the scores to (-1, 1), never the sinks (normal * 2).
    args, _ = make_batch(MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32, seed=9)
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=_sinks(4, seed=3))
    ref = ragged_paged_attention_reference(*args, **options)
    out = interpret(*args, **options, num_kv_splits=splits, pages_per_tile=2)
    assert_matches(out, ref, args, jnp.float32)


def test_sinks_batch_invariant():
    """One tiling, no split: a request's rows with sinks are the same bits in the batch as
    alone, and match the reference."""
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.bfloat16, seed=4)
    sinks = _sinks(8, seed=4)
    out = interpret(*args, sinks=sinks, batch_invariant=True)
    assert_matches(out, ragged_paged_attention_reference(*args, sinks=sinks), args, jnp.bfloat16)
    q, cache, kv_lens, tables, query_start, query_lens, _ = args
    for r in (1, 2, 3):  # a prefill, a chunk continuing one, a decode
        q0, q_len = int(query_start[r]), int(query_lens[r])
        alone = interpret(
            q[q0 : q0 + q_len],
            cache,
            kv_lens[r : r + 1],
            tables[r : r + 1],
            jnp.zeros(1, jnp.int32),
            query_lens[r : r + 1],
            jnp.ones(1, jnp.int32),
            sinks=sinks,
            batch_invariant=True,
        )
        rows = np.asarray(out[q0 : q0 + q_len].astype(jnp.float32)).view(np.int32)
        assert np.array_equal(rows, np.asarray(alone.astype(jnp.float32)).view(np.int32))


def test_sinks_refused_when_malformed_or_latent():
    args, _ = make_batch(MIX, n=4, k=2, h=32, s=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="sinks must be \\[N=4\\]"):
        interpret(*args, sinks=jnp.zeros(2, jnp.float32))
    with pytest.raises(ValueError, match="floating point"):
        interpret(*args, sinks=jnp.zeros(4, jnp.int32))
    # a latent cache [B, S, H] of 16 value and 16 rotary lanes: MLA has no sinks
    q, cache, *meta = make_batch(MIX, n=4, k=1, h=32, s=8, dtype=jnp.float32)[0]
    with pytest.raises(ValueError, match="latent"):
        interpret(q, cache[:, :, 0], *meta, latent=True, v_head_dim=16, sinks=jnp.zeros(4))


def test_long_contexts_split_over_the_kv():
    # Decodes at 300-700 positions beside a chunked prefill: many KV tiles per split.
    seqs = [(700, 1), (300, 1), (513, 1), (400, 24)]
    args, _ = make_batch(seqs, n=8, k=2, h=64, s=16, dtype=jnp.bfloat16, seed=3)
    ref = ragged_paged_attention_reference(*args)
    for splits in (1, 4, 16):
        out = interpret(*args, num_kv_splits=splits)
        assert_matches(out, ref, args, jnp.bfloat16)


def test_reads_one_layer_of_the_stacked_cache_under_jit():
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.float32, seed=5)
    q, cache, *meta = args
    stacked = jnp.stack([jnp.full_like(cache, 7.0), cache, jnp.full_like(cache, -3.0)])
    ref = ragged_paged_attention_reference(*args)
    run = jax.jit(lambda stacked, layer, *a: interpret(a[0], stacked, *a[1:], layer=layer))
    out = run(stacked, jnp.int32(1), q, *meta)
    assert_matches(out, ref, args, jnp.float32)


def test_num_seqs_zero_and_scalar():
    args, _ = make_batch(MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32, seed=2)
    out = interpret(*args[:-1], jnp.int32(0))
    assert (np.asarray(out) == 0).all()
    ref = ragged_paged_attention_reference(*args)
    assert_matches(interpret(*args[:-1], jnp.int32(len(MIX))), ref, args, jnp.float32)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    tokens_per_tile=st.integers(1, 16),
    num_valid=st.integers(0, 8),
)
def test_tile_table_covers_every_query_once(lens, tokens_per_tile, num_valid):
    num_valid = min(num_valid, len(lens))
    t = sum(lens)
    num_tiles = -(-t // tokens_per_tile) + len(lens)
    req, tok = _tile_table(
        jnp.asarray(lens, jnp.int32), jnp.int32(num_valid), tokens_per_tile, num_tiles
    )
    covered = []
    for r, first in zip(np.asarray(req), np.asarray(tok), strict=True):
        if r < len(lens):
            assert r < num_valid and 0 <= first < lens[r] and first % tokens_per_tile == 0
            covered += [(r, j) for j in range(first, min(first + tokens_per_tile, lens[r]))]
        else:
            assert r == len(lens)  # unused tiles point past the last request
    expected = [(r, j) for r in range(num_valid) for j in range(lens[r])]
    assert sorted(covered) == expected


def test_default_tiling():
    # Decode-shaped: 16-row tiles (G=4 -> 4 tokens each); a lone decode splits its KV 16 ways.
    assert default_tiling(1, 1, 32, 8, 16) == (16, 4, 16)
    assert default_tiling(256, 256, 32, 8, 16)[::2] == (16, 1)
    # Prefill-shaped: 64-row tiles; G=7 rounds the tile's floor up to 8.
    assert default_tiling(8192, 64, 28, 4, 16)[0] == 64
    assert default_tiling(1, 1, 64, 2, 16)[0] == 32  # G=32 needs 32 rows


def test_shapes_triton_cannot_tile_are_refused():
    assert unsupported_shape(64, 16) is None
    assert "head dim" in unsupported_shape(80, 16)
    assert "head dim" in unsupported_shape(8, 16)
    assert "block size" in unsupported_shape(64, 12)
    args, _ = make_batch(MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="head dim of at least 16"):
        interpret(args[0][..., :8], args[1][..., :8], *args[2:])
    with pytest.raises(ValueError, match="block_m"):
        interpret(*args, block_m=24)
    with pytest.raises(ValueError, match="num_kv_splits"):
        interpret(*args, num_kv_splits=0)


# Shapes of the models the GPU benchmark runs: (N, K, H, T, R).
MODEL_SHAPES = {
    "llama-3.1-8b decode 256": (32, 8, 128, 256, 256),
    "llama-3.1-8b prefill 8192": (32, 8, 128, 8192, 64),
    "qwen2.5-7b (G=7)": (28, 4, 128, 2048, 8),
    "smollm2 single decode (G=3)": (9, 3, 64, 1, 1),
}


@pytest.mark.parametrize("option", ["causal", "q_horizon", "sinks"])
@pytest.mark.parametrize("name", list(MODEL_SHAPES))
def test_lowers_to_triton_for_an_h100(name, option):
    """Lowering (no GPU needed) for an abstract H100: every operation of the kernel has a
    Triton lowering with the shapes Triton takes, and the result is one Triton call."""
    n, k, h, t, r = MODEL_SHAPES[name]
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("x",),
        abstract_device=jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu"),
    )
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    shapes = (
        jax.ShapeDtypeStruct((t, n, h), jnp.bfloat16),
        jax.ShapeDtypeStruct((32, 1024, 16, 2 * k, h), jnp.bfloat16),
        i32((r,)),
        i32((r, 64)),
        i32((r,)),
        i32((r,)),
        i32((1,)),
        i32(()),
        i32((t,)),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )

    def run(q, cache, *meta):
        q_horizon = meta[6] if option == "q_horizon" else None
        sinks = meta[7] if option == "sinks" else None
        return ragged_paged_attention_gpu(
            q, cache, *meta[:5], layer=meta[5], q_horizon=q_horizon, sinks=sinks
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(run).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def _on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs a CUDA GPU (benchmarks/gpu/run.sh runs it)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,k,h", [(32, 8, 128), (28, 4, 128), (9, 3, 64), (8, 8, 64)])
def test_on_gpu_matches_reference(dtype, n, k, h):
    seqs = MIX + [(700, 1), (2000, 1), (600, 300), (64, 64)]
    args, _ = make_batch(seqs, n=n, k=k, h=h, s=16, dtype=dtype, seed=n + h)
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 dot is TF32
        ref = ragged_paged_attention_reference(*args)
    for splits in (None, 1, 4):
        out = jax.jit(functools.partial(ragged_paged_attention_gpu, num_kv_splits=splits))(*args)
        assert_matches(out, ref, args, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs a CUDA GPU (benchmarks/gpu/run.sh runs it)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_gpu_q_horizon_matches_reference(dtype):
    args, _, horizon = horizon_batch(dtype, n=32, k=8, h=128, s=16, seed=6)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(*args, q_horizon=horizon, sliding_window=24)
    for splits in (None, 1, 4):  # static: the split count shapes the grid
        run = functools.partial(ragged_paged_attention_gpu, sliding_window=24, num_kv_splits=splits)
        out = jax.jit(run)(*args, q_horizon=horizon)
        assert_matches(out, ref, args, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs a CUDA GPU (benchmarks/gpu/run.sh runs it)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_gpu_sinks_match_reference(dtype):
    seqs = MIX + [(700, 1), (2000, 1), (600, 300)]
    args, _ = make_batch(seqs, n=64, k=8, h=64, s=16, dtype=dtype, seed=11)  # gpt-oss's heads
    options = dict(sinks=_sinks(64, seed=11), sliding_window=128)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(*args, **options)
    for splits in (None, 1, 4):  # static: the split count shapes the grid
        run = jax.jit(
            functools.partial(ragged_paged_attention_gpu, **options, num_kv_splits=splits)
        )
        assert_matches(run(*args), ref, args, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_size,sliding_window", [(8, None), (4, 6), (16, None)])
@pytest.mark.parametrize("splits", [1, 3])
def test_chunked_local_attention_matches_reference(dtype, chunk_size, sliding_window, splits):
    """Llama 4's chunked local attention: a row at p sees keys from floor(p / C) * C; tiles
    of 4 tokens (G = 4) cross chunk boundaries, and a split walks only the chunk's tiles."""
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=dtype, seed=chunk_size + splits)
    options = dict(chunk_size=chunk_size, sliding_window=sliding_window)
    ref = ragged_paged_attention_reference(*args, **options)
    out = interpret(*args, **options, num_kv_splits=splits, pages_per_tile=2)
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs a CUDA GPU (benchmarks/gpu/run.sh runs it)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_gpu_chunked_local_attention_matches_reference(dtype):
    seqs = MIX + [(700, 1), (2000, 1), (600, 300)]
    args, _ = make_batch(seqs, n=40, k=8, h=128, s=16, dtype=dtype, seed=12)  # Scout's heads
    options = dict(chunk_size=512)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(*args, **options)
    for splits in (None, 1, 4):  # static: the split count shapes the grid
        run = jax.jit(
            functools.partial(ragged_paged_attention_gpu, **options, num_kv_splits=splits)
        )
        assert_matches(run(*args), ref, args, dtype)

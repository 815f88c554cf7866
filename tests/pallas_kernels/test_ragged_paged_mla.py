"""MLA's latent attention (`latent=True`) in the kit's kernels: the TPU kernel and the GPU
one, each in interpret mode on the CPU, and the C++ CPU kernel, against the jnp reference.
A latent cache [B, S, H] holds one vector per token whose first v_head_dim lanes are its
value; the batches are `make_batch`'s (permuted block tables, gaps of NaN rows, padding
requests, NaN in every slot no request owns) with one KV head, whose keys become the
latents.

Crossed with the options a latent layer takes on these kernels (a window, a soft cap), a
float8 cache (as float8, and as bytes), one layer of a stacked cache read in place under
jit, the GPU kernel's KV splits, and heads split over devices with the latent replicated.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batches import MIX, make_batch, owned_rows

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_sharded,
    unsupported_shape,
)

R, ROPE = 32, 16  # kv_lora_rank (the value lanes) and qk_rope_head_dim: the GPU's two parts
H = R + ROPE

FLAVOURS = {
    "tpu": functools.partial(ragged_paged_attention, block_q=8, pages_per_chunk=2, interpret=True),
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    "cpu": functools.partial(ragged_paged_attention_cpu),
}


def latent_batch(dtype, *, n=8, s=8, seed=0, kv_dtype=None):
    """`make_batch`'s arguments with the latent cache [B, S, H]: its one KV head's keys."""
    args, _ = make_batch(MIX, n=n, k=1, h=H, s=s, dtype=dtype, seed=seed, kv_dtype=kv_dtype)
    q, cache, *meta = args
    return (q, cache[:, :, 0], *meta)


def reference(args, **options):
    return ragged_paged_attention_reference(*args, latent=True, v_head_dim=R, **options)


def assert_latent_matches(out, ref, args, dtype):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    q = args[0]
    assert out.shape == (q.shape[0], q.shape[1], R)
    assert not np.isnan(out).any()
    assert (out[~owned_rows(args)] == 0).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (5, 2.0)])
def test_latent_kernel_matches_reference(flavour, dtype, sliding_window, soft_cap):
    args = latent_batch(dtype, seed=7)
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    ref = reference(args, **options)
    out = FLAVOURS[flavour](*args, latent=True, v_head_dim=R, **options)
    assert out.dtype == dtype
    assert_latent_matches(out, ref, args, dtype)


def test_latent_gpu_kernel_kv_splits_and_tiles():
    """Flash decoding's parts merged, and a tile of 32 rows over 4 heads (8 tokens)."""
    args = latent_batch(jnp.float32, n=4, s=16, seed=8)
    ref = reference(args)
    for tiling in (dict(num_kv_splits=3), dict(block_m=32, pages_per_tile=2)):
        out = ragged_paged_attention_gpu(*args, latent=True, v_head_dim=R, interpret=True, **tiling)
        assert_latent_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("dtype,as_bytes", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_latent_fp8_cache_matches_reference(flavour, kv_dtype, dtype, as_bytes):
    """One format for the whole latent, its keys and values both (vLLM's fp8 MLA cache)."""
    args = latent_batch(dtype, s=16, seed=11, kv_dtype=kv_dtype)
    q, cache, *meta = args
    assert cache.dtype == kv_dtype
    options = {}
    if as_bytes:
        options["fp8_dtype"] = kv_dtype
        args = (q, jax.lax.bitcast_convert_type(cache, jnp.uint8), *meta)
    ref = reference(args, **options)
    as_float = reference((q, cache.astype(jnp.float32), *meta))
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(as_float.astype(ref.dtype)))
    out = FLAVOURS[flavour](*args, latent=True, v_head_dim=R, **options)
    assert_latent_matches(out, ref, args, dtype)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_latent_kernel_reads_one_layer_of_the_stacked_cache_under_jit(flavour):
    args = latent_batch(jnp.float32, seed=3)
    q, cache, *meta = args
    nan = jnp.full_like(cache, jnp.nan)
    stacked = jnp.stack([nan, cache, nan])  # [L=3, B, S, H]: only layer 1 is real
    kernel = functools.partial(FLAVOURS[flavour], latent=True, v_head_dim=R)
    run = jax.jit(lambda q, c, layer, *m: kernel(q, c, *m, layer=layer))
    out = run(q, stacked, jnp.int32(1), *meta)
    assert_latent_matches(out, reference(args), args, jnp.float32)
    with pytest.raises(ValueError, match=r"stacked kv_cache \[L, B, S, H\] needs layer="):
        kernel(q, stacked, *meta)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_latent_kernel_under_shard_map_matches_reference(flavour):
    """Query heads split over 2 fake devices (tests/conftest.py), the latent cache
    replicated: each device reads all of it for its own heads."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(2)
    args = latent_batch(jnp.float32, seed=5)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    cache = jax.device_put(cache, NamedSharding(mesh, P()))
    kernel = FLAVOURS[flavour]
    run = jax.jit(
        functools.partial(
            ragged_paged_attention_sharded,
            mesh,
            MODEL_AXIS,
            kernel=kernel.func,
            latent=True,
            v_head_dim=R,
            **kernel.keywords,
        )
    )
    out = run(q, cache, *meta)
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert out.addressable_shards[0].data.shape == (q.shape[0], 4, R)
    assert_latent_matches(out, reference(args), args, jnp.float32)


def test_latent_kernel_inputs_are_checked():
    args = latent_batch(jnp.float32)
    q, cache, *meta = args
    for kernel in FLAVOURS.values():
        with pytest.raises(ValueError, match="fewer than its 48: got v_head_dim=None"):
            kernel(*args, latent=True)
        with pytest.raises(ValueError, match="v_head_dim only with a latent cache"):
            kernel(q, cache[:, :, None].repeat(2, 2), *meta, v_head_dim=R)
    # Triton's tiles: both parts of a latent a power of two of at least 16
    assert unsupported_shape(576, 16, 512) is None
    assert "512 + 8" in unsupported_shape(520, 16, 512)
    with pytest.raises(ValueError, match="24 \\+ 24"):
        ragged_paged_attention_gpu(*args, latent=True, v_head_dim=24, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h,r", [(H, R), (576, 512)])
@pytest.mark.parametrize("sliding_window,soft_cap,horizon", [(None, None, False), (5, 2.0, True)])
def test_latent_cpu_kernel_vector_routine(dtype, h, r, sliding_window, soft_cap, horizon):
    """Block size 16 takes the C++ kernel's vector routine (query heads as lanes), at this
    file's lanes and at DeepSeek-V2/V3's (512 + 64; 16 heads), with every row kind of `MIX`,
    crossed with a window, a soft cap and bidirectional spans (q_horizon)."""
    args, _ = make_batch(MIX, n=16, k=1, h=h, s=16, dtype=dtype, seed=13)
    q, cache, *meta = args
    args = (q, cache[:, :, 0], *meta)
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    if horizon:  # horizons at or past the queries' positions (clipped to their contexts)
        options["q_horizon"] = jnp.arange(q.shape[0], dtype=jnp.int32) + 2 - meta[2][0]
    ref = ragged_paged_attention_reference(*args, latent=True, v_head_dim=r, **options)
    out = ragged_paged_attention_cpu(*args, latent=True, v_head_dim=r, **options)
    assert out.dtype == dtype and out.shape == (q.shape[0], 16, r)
    out, ref = (np.asarray(x.astype(jnp.float32)) for x in (out, ref))
    assert not np.isnan(out).any() and (out[~owned_rows(args)] == 0).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


def test_latent_cpu_kernel_rows_are_batch_invariant():
    """A latent's every row takes one routine, so a request's output bits do not depend on
    the rows beside it, nor on whether it decodes: each request of `MIX` alone equals its
    rows in the whole batch, in bfloat16 at DeepSeek's lanes, without the batch-invariant
    mode."""
    args, _ = make_batch(MIX, n=16, k=1, h=576, s=16, dtype=jnp.bfloat16, seed=17)
    q, cache, kv_lens, tables, starts, lens, _ = args
    cache = cache[:, :, 0]
    run = functools.partial(ragged_paged_attention_cpu, latent=True, v_head_dim=512)
    whole = np.asarray(run(q, cache, kv_lens, tables, starts, lens, jnp.int32(len(MIX))))
    for r in range(len(MIX)):
        one = (kv_lens[r : r + 1], tables[r : r + 1], starts[r : r + 1], lens[r : r + 1])
        alone = np.asarray(run(q, cache, *one, jnp.int32(1)))
        rows = slice(int(starts[r]), int(starts[r] + lens[r]))
        np.testing.assert_array_equal(alone[rows], whole[rows])


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU (benchmarks/gpu/run.sh runs it)"
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_latent_gpu_kernel_on_device_matches_reference(dtype):
    """The latent path compiled by Triton for the device (its two-part loads, at this file's
    32 + 16 lanes), KV splits automatic, one and four, against the reference with full
    float32 products (a GPU's default is TF32)."""
    args = latent_batch(dtype, n=16, s=16, seed=21)
    with jax.default_matmul_precision("highest"):
        ref = reference(args)
    for splits in (None, 1, 4):
        run = functools.partial(
            ragged_paged_attention_gpu, latent=True, v_head_dim=R, num_kv_splits=splits
        )
        assert_latent_matches(jax.jit(run)(*args), ref, args, dtype)

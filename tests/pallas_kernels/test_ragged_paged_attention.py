"""Ragged paged attention: the Pallas kernel (TPU interpret mode on CPU) and the C++ CPU
kernel against the jnp reference, and the reference against naive numpy attention over
contiguous K/V.

Batches are built to catch indexing mistakes: randomly permuted block tables, gaps of
NaN query rows between requests and at the end, padding requests (r >= num_seqs) whose
metadata points at real rows, and NaN in every cache slot no valid request owns.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from ragged_batches import HORIZON_SEQS, MIX, assert_matches, horizon_batch, make_batch

from pallas_kernels.ragged_paged_attention import (
    kv_cache_bytes,
    kv_cache_shape,
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_cpu_sharded,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    validate_inputs,
)


def naive_attention(
    q,
    kv,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    chunk_size=None,
    sinks=None,
    v_head_dim=None,
):
    """Per-token causal attention in float64 over contiguous kv [L, 2K, H]: transformers'
    eager attention (gpt-oss's with `sinks`, a last softmax column dropped after it; Llama
    4's chunk mask with `chunk_size`); values the first `v_head_dim` lanes."""
    q = np.asarray(q, np.float64)  # [Q, N, H]
    q_len, n, h = q.shape
    kv_len, two_k, _ = kv.shape
    group = n // (two_k // 2)
    hv = v_head_dim or h
    out = np.zeros((q_len, n, hv))
    for j in range(q_len):
        pos = kv_len - q_len + j
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        if chunk_size is not None:
            lo = max(lo, pos // chunk_size * chunk_size)
        for head in range(n):
            keys = kv[lo : pos + 1, 2 * (head // group)].astype(np.float64)
            values = kv[lo : pos + 1, 2 * (head // group) + 1, :hv].astype(np.float64)
            scores = keys @ q[j, head] * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            if sinks is not None:
                scores = np.append(scores, float(sinks[head]))
            weights = np.exp(scores - scores.max())
            weights = weights / weights.sum()
            out[j, head] = weights[: len(values)] @ values
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s", [8, 16])
@pytest.mark.parametrize("n,k", [(4, 4), (8, 2), (6, 1)])
def test_kernel_matches_reference(dtype, s, n, k):
    args, _ = make_batch(MIX, n=n, k=k, h=16, s=s, dtype=dtype, seed=s + n)
    ref = ragged_paged_attention_reference(*args)
    out = ragged_paged_attention(*args, block_q=8, pages_per_chunk=2, interpret=True)
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize("block_q,pages_per_chunk", [(1, 1), (5, 3), (64, 16)])
def test_kernel_tile_sizes(block_q, pages_per_chunk):
    # block_q=64 exceeds T (window clamped to T); pages_per_chunk=16 exceeds P.
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.float32, seed=block_q)
    ref = ragged_paged_attention_reference(*args)
    out = ragged_paged_attention(
        *args, block_q=block_q, pages_per_chunk=pages_per_chunk, interpret=True
    )
    assert_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (None, 1.0), (12, 2.0), (1, None)])
def test_kernel_window_and_soft_cap(sliding_window, soft_cap):
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.float32, seed=3)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.7)
    ref = ragged_paged_attention_reference(*args, **opts)
    plain = ragged_paged_attention_reference(*args, sm_scale=0.7)
    assert not np.allclose(ref, plain, atol=1e-3)  # the option has an effect
    out = ragged_paged_attention(*args, **opts, block_q=8, pages_per_chunk=1, interpret=True)
    assert_matches(out, ref, args, jnp.float32)


def test_kernel_under_jit_and_strict_interpreter():
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=16, dtype=jnp.float32, seed=7)
    ref = ragged_paged_attention_reference(*args)
    # Eager DMAs plus the race detector: a read of a kv slot while its DMA is in
    # flight, or an output write racing the next step's read, raises here.
    strict = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    fn = jax.jit(
        functools.partial(ragged_paged_attention, block_q=8, pages_per_chunk=2, interpret=strict)
    )
    out = fn(*args)
    assert_matches(out, ref, args, jnp.float32)


def test_kernel_num_seqs_zero_and_scalar():
    args, _ = make_batch(MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32)
    none = args[:6] + (jnp.int32(0),)
    out = ragged_paged_attention(*none, block_q=8, interpret=True)
    assert (np.asarray(out) == 0).all()
    out = ragged_paged_attention(*args[:6], jnp.int32(2), block_q=8, interpret=True)
    assert_matches(out, ragged_paged_attention_reference(*args), args, jnp.float32)


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (6, None), (None, 1.5)])
def test_reference_matches_naive_attention(sliding_window, soft_cap):
    h = 16
    args, contiguous = make_batch(MIX, n=6, k=2, h=h, s=8, dtype=jnp.float32, seed=11)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    out = np.asarray(ragged_paged_attention_reference(*args, **opts))
    q, query_start = np.asarray(args[0]), np.asarray(args[4])
    expected = np.zeros(q.shape)
    for (_, q_len), q0, kv in zip(MIX, query_start, contiguous, strict=False):
        expected[q0 : q0 + q_len] = naive_attention(
            q[q0 : q0 + q_len], kv, sm_scale=1 / math.sqrt(h), **opts
        )
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "opts",
    [
        dict(chunk_size=4),  # MIX's chunks straddle chunk boundaries, inside 8-slot pages
        dict(chunk_size=11, sliding_window=6),  # across pages, crossed with a window
        dict(sinks=True),
        dict(sinks=True, sliding_window=6, soft_cap=1.5),
        dict(v_head_dim=5, sinks=True, chunk_size=8),  # boundaries on the pages' edges
    ],
    ids=str,
)
def test_reference_options_match_naive_attention(opts):
    h, n, opts = 16, 6, dict(opts)
    args, contiguous = make_batch(MIX, n=n, k=2, h=h, s=8, dtype=jnp.float32, seed=12)
    if opts.pop("sinks", False):
        opts["sinks"] = jnp.asarray(np.random.default_rng(0).normal(size=n) * 2, jnp.float32)
    out = np.asarray(ragged_paged_attention_reference(*args, **opts))
    q, query_start = np.asarray(args[0]), np.asarray(args[4])
    assert out.shape == (*q.shape[:2], opts.get("v_head_dim", h))
    expected = np.zeros(out.shape)
    for (_, q_len), q0, kv in zip(MIX, query_start, contiguous, strict=False):
        expected[q0 : q0 + q_len] = naive_attention(
            q[q0 : q0 + q_len], kv, sm_scale=1 / math.sqrt(h), **opts
        )
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    plain = ragged_paged_attention_reference(*args, sliding_window=opts.get("sliding_window"))
    assert not np.allclose(out[..., :5], np.asarray(plain)[..., :5], atol=1e-3)


def _bad_inputs():
    args, _ = make_batch(MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32, num_pad_requests=0)
    q, cache, kv_lens, bt, qs, ql, ns = args
    yield "q rank", (q[0], cache, kv_lens, bt, qs, ql, ns)
    yield "head dim", (q[..., :4], cache, kv_lens, bt, qs, ql, ns)
    yield "odd kv heads", (q, cache[:, :, :3], kv_lens, bt, qs, ql, ns)
    yield "N % K", (q[:, :3], cache, kv_lens, bt, qs, ql, ns)
    yield "float lens", (q, cache, kv_lens.astype(jnp.float32), bt, qs, ql, ns)
    yield "R mismatch", (q, cache, kv_lens, bt[:1], qs, ql, ns)
    yield "query_lens shape", (q, cache, kv_lens, bt, qs, ql[:1], ns)
    yield "num_seqs shape", (q, cache, kv_lens, bt, qs, ql, jnp.zeros(2, jnp.int32))
    yield "int q", (q.astype(jnp.int32), cache, kv_lens, bt, qs, ql, ns)


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_validate_inputs_rejects(case):
    _, bad = case
    with pytest.raises(ValueError):
        validate_inputs(*bad)
    with pytest.raises(ValueError):
        ragged_paged_attention(*bad, interpret=True)


def test_validate_inputs_accepts_and_bad_options():
    args, _ = make_batch(MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32)
    validate_inputs(*args)
    validate_inputs(*args[:6], 2)
    for bad in (
        dict(sliding_window=0),
        dict(soft_cap=0.0),
        dict(sm_scale=-1.0),
        dict(chunk_size=0),
        dict(v_head_dim=9),  # wider than the cache's heads
        dict(sinks=jnp.zeros(3)),  # not one per query head
        dict(sinks=jnp.zeros(4, jnp.int32)),
    ):
        with pytest.raises(ValueError):
            ragged_paged_attention_reference(*args, **bad)


def test_kv_cache_shape():
    assert kv_cache_shape(10, 16, 4, 64) == (10, 16, 8, 64)
    assert kv_cache_bytes(10, 16, 4, 64, jnp.bfloat16) == 10 * 16 * 8 * 64 * 2
    with pytest.raises(ValueError):
        kv_cache_shape(10, 0, 4, 64)


@pytest.mark.parametrize("sliding_window", [None, 24])  # 24: longer than every span
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_q_horizon_matches_reference(dtype, sliding_window):
    args, _, horizon = horizon_batch(dtype, seed=1)
    opts = dict(sliding_window=sliding_window)
    ref = ragged_paged_attention_reference(*args, q_horizon=horizon, **opts)
    causal = ragged_paged_attention_reference(*args, **opts)
    assert not np.allclose(ref.astype(jnp.float32), causal.astype(jnp.float32), atol=0.1)
    out = ragged_paged_attention(
        *args, q_horizon=horizon, **opts, block_q=8, pages_per_chunk=1, interpret=True
    )
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


def test_reference_q_horizon_matches_naive_attention():
    """The oracle's horizon: a span's rows see the span's keys both ways, no further than
    the context."""
    h = 16
    args, contiguous, horizon = horizon_batch(jnp.float32, n=4, k=2, h=h, seed=2)
    out = np.asarray(ragged_paged_attention_reference(*args, q_horizon=horizon))
    q, query_start, horizon = np.asarray(args[0]), np.asarray(args[4]), np.asarray(horizon)
    for (kv_len, q_len, _), q0, kv in zip(HORIZON_SEQS, query_start, contiguous, strict=False):
        for j in range(q_len):
            sees = min(max(kv_len - q_len + j, horizon[q0 + j]), kv_len - 1)
            expected = naive_attention(q[q0 + j][None], kv[: sees + 1], sm_scale=1 / math.sqrt(h))
            np.testing.assert_allclose(out[q0 + j], expected[0], atol=1e-5, rtol=1e-5)


def test_kernel_q_horizon_under_jit_and_strict_interpreter():
    args, _, horizon = horizon_batch(jnp.float32, seed=3)
    ref = ragged_paged_attention_reference(*args, q_horizon=horizon, sliding_window=24)
    strict = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    run = functools.partial(
        ragged_paged_attention, block_q=8, pages_per_chunk=2, interpret=strict, sliding_window=24
    )
    out = jax.jit(lambda *a: run(*a[:-1], q_horizon=a[-1]))(*args, horizon)
    assert_matches(out, ref, args, jnp.float32)


def test_q_horizon_is_validated():
    args, _, horizon = horizon_batch(jnp.float32)
    for bad in (horizon[:-1], horizon.astype(jnp.float32), horizon[:, None]):
        for kernel in (ragged_paged_attention, ragged_paged_attention_gpu):
            with pytest.raises(ValueError, match="q_horizon"):
                kernel(*args, q_horizon=bad, interpret=True)


# The TPU kernel and the GPU one (`ragged_paged_attention_gpu`), each in interpret mode.
FLAVOURS = {
    "tpu": dict(block_q=8, pages_per_chunk=2, interpret=True),
    "gpu": dict(kernel=ragged_paged_attention_gpu, interpret=True),
}


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("tp,n,k", [(2, 8, 2), (4, 8, 4), (2, 4, 4)])
def test_kernel_under_shard_map_matches_reference(tp, n, k, flavour):
    """Heads split over `tp` fake devices (tests/conftest.py), metadata replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_sharded
    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(tp)
    args, _ = make_batch(MIX, n=n, k=k, h=16, s=8, dtype=jnp.float32, seed=tp + n)
    ref = ragged_paged_attention_reference(*args)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    cache = jax.device_put(cache, NamedSharding(mesh, P(None, None, MODEL_AXIS, None)))
    run = jax.jit(
        functools.partial(ragged_paged_attention_sharded, mesh, MODEL_AXIS, **FLAVOURS[flavour])
    )
    out = run(q, cache, *meta)
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert out.addressable_shards[0].data.shape == (q.shape[0], n // tp, 16)
    assert_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_kernel_q_horizon_under_shard_map_matches_reference(flavour):
    """q_horizon replicated beside the metadata, on 2 fake devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_sharded
    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(2)
    args, _, horizon = horizon_batch(jnp.float32, seed=4)
    ref = ragged_paged_attention_reference(*args, q_horizon=horizon)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    cache = jax.device_put(cache, NamedSharding(mesh, P(None, None, MODEL_AXIS, None)))
    sharded = functools.partial(
        ragged_paged_attention_sharded, mesh, MODEL_AXIS, **FLAVOURS[flavour]
    )
    out = jax.jit(lambda q, cache, *m: sharded(q, cache, *m[:-1], q_horizon=m[-1]))(
        q, cache, *meta, horizon
    )
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert_matches(out, ref, args, jnp.float32)


# A float8 cache (kv_cache_dtype="fp8"), as a float8 array or as its bytes (uint8, with
# fp8_dtype=: how the engine holds it on the CPU): every flavour reads its pages into q's
# dtype. The reference on the float8 cache equals the reference on a float cache of the
# same values.
FP8_FLAVOURS = {
    "cpu": ragged_paged_attention_cpu,
    "tpu": functools.partial(ragged_paged_attention, **FLAVOURS["tpu"]),
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
}


@pytest.mark.parametrize("flavour", list(FP8_FLAVOURS))
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("dtype,as_bytes", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_fp8_cache_matches_reference(flavour, kv_dtype, dtype, as_bytes):
    h = 64 if flavour == "cpu" else 16  # the CPU kernel's vector path
    args, _ = make_batch(MIX, n=8, k=2, h=h, s=16, dtype=dtype, seed=11, kv_dtype=kv_dtype)
    q, cache, *meta = args
    assert cache.dtype == kv_dtype
    as_float = ragged_paged_attention_reference(q, cache.astype(jnp.float32), *meta)
    options = {}
    if as_bytes:
        options["fp8_dtype"] = kv_dtype
        args = (q, jax.lax.bitcast_convert_type(cache, jnp.uint8), *meta)
    ref = ragged_paged_attention_reference(*args, **options)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(as_float.astype(ref.dtype)))
    out = FP8_FLAVOURS[flavour](*args, **options)
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("h", [16, 64])  # the C++ kernel's generic loop; its vector path
def test_cpu_kernel_decodes_every_fp8_code(kv_dtype, h):
    """Requests of one token attend to it alone, so their output is its value vector: V
    holds all 256 byte codes (subnormals, zeros, NaN and inf included), checked against
    ml_dtypes' decoding."""
    import ml_dtypes

    r = 256 // h
    codes = np.arange(256, dtype=np.uint8).reshape(r, h)
    cache = np.zeros((r + 1, 16, 2, h), np.uint8)  # block 0 unused; K = 0 (code 0)
    cache[1:, 0, 1] = codes
    args = (
        jnp.ones((r, 1, h), jnp.float32),
        jnp.asarray(cache),
        jnp.ones(r, jnp.int32),  # kv_lens
        jnp.arange(1, r + 1, dtype=jnp.int32)[:, None],  # block_tables
        jnp.arange(r, dtype=jnp.int32),  # query_start
        jnp.ones(r, jnp.int32),  # query_lens
        jnp.asarray([r], jnp.int32),
    )
    out = np.asarray(ragged_paged_attention_cpu(*args, fp8_dtype=kv_dtype))[:, 0]
    want = codes.view(np.dtype(getattr(ml_dtypes, jnp.dtype(kv_dtype).name)))
    np.testing.assert_array_equal(out, want.astype(np.float32))


def test_fp8_cache_conversions_and_checks():
    from pallas_kernels.ragged_paged_attention import from_cache, to_cache

    x = jnp.asarray([1e6, -1e6, 0.3, -2.0, 500.0])
    e4m3 = np.asarray(to_cache(x, jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(e4m3, [448, -448, 0.3125, -2, 448])  # saturated
    e5m2 = np.asarray(to_cache(x, jnp.float8_e5m2).astype(jnp.float32))
    np.testing.assert_array_equal(e5m2, [57344, -57344, 0.3125, -2, 512])
    as_bytes = to_cache(x, jnp.uint8, jnp.float8_e5m2)
    assert as_bytes.dtype == jnp.uint8
    np.testing.assert_array_equal(from_cache(as_bytes, jnp.float32, jnp.float8_e5m2), e5m2)
    assert to_cache(x, jnp.bfloat16).dtype == jnp.bfloat16
    args, _ = make_batch(MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32)
    q, cache, *meta = args
    raw = jax.lax.bitcast_convert_type(cache.astype(jnp.float8_e4m3fn), jnp.uint8)
    with pytest.raises(ValueError, match="name the format, fp8_dtype="):
        ragged_paged_attention_reference(q, raw, *meta)
    with pytest.raises(ValueError, match="fp8_dtype= is for a uint8 kv_cache"):
        ragged_paged_attention_reference(*args, fp8_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        ragged_paged_attention_cpu(q, raw, *meta, fp8_dtype=jnp.bfloat16)


# The C++ CPU kernel (cpu_kernel.cc). h=16 or s=8 take its generic loop; s=16 with h=64 or
# h=128 its vector paths: run_prefill for blocks of several queries (rows as lanes: 9/3 heads
# leave padding lanes in a block's last group) and for single queries with more than 16
# query heads per kv head (32/1), run_decode for the other single queries.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s", [8, 16])
@pytest.mark.parametrize("n,k,h", [(4, 4, 16), (8, 2, 64), (6, 1, 128), (9, 3, 64), (32, 1, 64)])
def test_cpu_kernel_matches_reference(dtype, s, n, k, h):
    args, _ = make_batch(MIX, n=n, k=k, h=h, s=s, dtype=dtype, seed=s + n + h)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.3)
    out = ragged_paged_attention_cpu(*args, sm_scale=0.3)
    assert out.dtype == dtype
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize("dtype,h", [(jnp.float32, 64), (jnp.bfloat16, 64), (jnp.bfloat16, 16)])
def test_cpu_kernel_long_contexts_and_default_scale(dtype, h):
    # Many pages per request, so the online softmax rescales across pages, and prefills of
    # 40, 64 and 33 queries, several of the kernel's 16-query blocks (the last of 33 a single
    # query, which takes the decode path).
    seqs = [(300, 1), (257, 40), (64, 64), (1, 1), (70, 33)]
    args, _ = make_batch(seqs, n=8, k=2, h=h, s=16, dtype=dtype, seed=5)
    assert_matches(
        ragged_paged_attention_cpu(*args), ragged_paged_attention_reference(*args), args, dtype
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,k,h", [(8, 8, 64), (8, 1, 64), (8, 1, 32)])
def test_cpu_kernel_later_values_never_reach_earlier_queries(n, k, h, dtype):
    # An infinite V at the last position of a prefill must not leak into earlier queries
    # through 0 * inf (the vector paths cover whole pages, bf16's in pairs of keys; the
    # reference masks V), and the earlier queries' bits are those of a clean cache (bf16: the
    # page's masked products against whole pairs).
    args, _ = make_batch([(13, 13)], n=n, k=k, h=h, s=16, dtype=dtype, seed=4)
    q, cache, kv_lens, tables, *rest = args
    clean = np.asarray(ragged_paged_attention_cpu(*args).astype(jnp.float32))
    cache = cache.at[tables[0, 0], 12, 1::2].set(jnp.inf)
    args = (q, cache, kv_lens, tables, *rest)
    out = np.asarray(ragged_paged_attention_cpu(*args).astype(jnp.float32))
    ref = np.asarray(ragged_paged_attention_reference(*args).astype(jnp.float32))
    q0 = int(args[4][0])
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out[q0 : q0 + 12], ref[q0 : q0 + 12], atol=tol, rtol=tol)
    assert np.isfinite(out[q0 : q0 + 12]).all()
    assert np.array_equal(out[q0 : q0 + 12].view(np.int32), clean[q0 : q0 + 12].view(np.int32))


def test_cpu_kernel_reads_one_layer_of_the_stacked_cache_under_jit():
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.bfloat16, seed=2)
    q, cache, *meta = args
    nan = jnp.full_like(cache, jnp.nan)
    stacked = jnp.stack([nan, cache, nan])  # [L=3, B, S, 2K, H]: only layer 1 is real
    run = jax.jit(lambda q, c, layer, *m: ragged_paged_attention_cpu(q, c, *m, layer=layer))
    out = run(q, stacked, jnp.int32(1), *meta)
    assert_matches(out, ragged_paged_attention_reference(*args), args, jnp.bfloat16)


def test_kernel_reads_one_layer_of_the_stacked_cache_under_jit():
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.float32, seed=3)
    q, cache, *meta = args
    nan = jnp.full_like(cache, jnp.nan)
    stacked = jnp.stack([nan, nan, cache])  # [L=3, B, S, 2K, H]: only layer 2 is real
    run = jax.jit(
        lambda q, c, layer, *m: ragged_paged_attention(
            q, c, *m, layer=layer, block_q=8, pages_per_chunk=2, interpret=True
        )
    )
    out = run(q, stacked, jnp.int32(2), *meta)
    assert_matches(out, ragged_paged_attention_reference(*args), args, jnp.float32)
    with pytest.raises(ValueError, match="needs layer="):
        ragged_paged_attention(q, stacked, *meta, interpret=True)
    with pytest.raises(ValueError, match="layer= needs the stacked"):
        ragged_paged_attention(q, cache, *meta, layer=0, interpret=True)


def test_cpu_kernel_num_seqs_and_errors():
    args, _ = make_batch(MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32)
    assert (np.asarray(ragged_paged_attention_cpu(*args[:6], jnp.int32(0))) == 0).all()
    out = ragged_paged_attention_cpu(*args[:6], 2)
    assert_matches(out, ragged_paged_attention_reference(*args), args, jnp.float32)
    q, cache, *meta = args
    with pytest.raises(ValueError, match="dtype"):
        ragged_paged_attention_cpu(q.astype(jnp.bfloat16), cache, *meta)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ragged_paged_attention_cpu(q.astype(jnp.float16), cache.astype(jnp.float16), *meta)
    with pytest.raises(ValueError, match="layer"):
        ragged_paged_attention_cpu(q, cache[None], *meta)
    with pytest.raises(ValueError, match="layer"):
        ragged_paged_attention_cpu(q, cache, *meta, layer=0)
    for _, bad in _bad_inputs():
        with pytest.raises(ValueError):
            ragged_paged_attention_cpu(*bad)
    # Metadata the static checks cannot see is refused at run time, not read out of bounds.
    kv_lens = meta[0].at[0].set(10_000)
    with pytest.raises(Exception, match="inconsistent ragged metadata"):
        ragged_paged_attention_cpu(q, cache, kv_lens, *meta[1:]).block_until_ready()
    tables = meta[1].at[0, 0].set(cache.shape[0])
    with pytest.raises(Exception, match="block table entry out of range"):
        ragged_paged_attention_cpu(q, cache, meta[0], tables, *meta[2:]).block_until_ready()
    starts = meta[2].at[1].set(meta[2][0])  # request 1's rows on top of request 0's
    with pytest.raises(Exception, match="overlap"):
        ragged_paged_attention_cpu(q, cache, *meta[:2], starts, *meta[3:]).block_until_ready()


@pytest.mark.parametrize("tp,n,k", [(2, 8, 2), (4, 8, 4)])
def test_cpu_kernel_under_shard_map_matches_reference(tp, n, k):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(tp)
    args, _ = make_batch(MIX, n=n, k=k, h=16, s=8, dtype=jnp.float32, seed=tp + n)
    ref = ragged_paged_attention_reference(*args)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    stacked = jax.device_put(
        cache[None], NamedSharding(mesh, P(None, None, None, MODEL_AXIS, None))
    )
    run = jax.jit(functools.partial(ragged_paged_attention_cpu_sharded, mesh, MODEL_AXIS))
    out = run(q, stacked, jnp.int32(0), *meta)
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert_matches(out, ref, args, jnp.float32)


# Sliding windows and soft caps in the C++ kernel, on the mix plus requests of many pages:
# decode rows and prefill chunks of several 16-query blocks. Windows of 1 and 5 lie inside a
# block; 20 and 37 span several, and chunks' queries straddle a window's edge (the chunk of
# 40 at positions 110..149 sees keys 74..149 with a window of 37: its blocks start at
# different pages); 1000 exceeds every context.
WINDOW_MIX = [*MIX, (100, 1), (150, 40), (70, 33), (64, 64), (48, 16), (90, 1)]
WINDOW_OPTIONS = [
    (1, None),
    (5, None),
    (20, None),
    (37, None),
    (1000, None),
    (None, 1.5),
    (37, 2.0),
    (5, 0.5),
]


@pytest.mark.parametrize("sliding_window,soft_cap", WINDOW_OPTIONS)
def test_window_options_change_the_reference(sliding_window, soft_cap):
    """Each option of WINDOW_OPTIONS has an effect on WINDOW_MIX (but a window longer than
    every context)."""
    args, _ = make_batch(WINDOW_MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32, seed=1)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.3)
    ref = np.asarray(ragged_paged_attention_reference(*args, **opts))
    plain = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.3))
    if sliding_window == 1000:
        np.testing.assert_allclose(ref, plain, atol=1e-6)
    else:
        assert not np.allclose(ref, plain, atol=1e-3)


# h=16 or s=8: the generic loop; s=16 with h=64 or 128: the vector paths (run_prefill, with
# padding lanes for 9/3 heads and for single queries of 32/1; run_decode, and its AVX512-BF16
# twin for bfloat16 where the CPU has it). Every option on the generic loop and on 8/2 (both
# vector paths); the shapes that differ from 8/2 in lanes only (their plain runs:
# test_cpu_kernel_matches_reference) with a window inside a page, one across pages with a
# cap, and a cap on a short window.
WINDOW_CASES = [
    *((shape, option) for shape in [(4, 4, 16, 8), (8, 2, 64, 16)] for option in WINDOW_OPTIONS),
    *(
        (shape, option)
        for shape in [(9, 3, 64, 16), (32, 1, 64, 16), (6, 1, 128, 16)]
        for option in [(1, None), (37, 2.0), (5, 0.5)]
    ),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "n,k,h,s,sliding_window,soft_cap", [(*shape, *option) for shape, option in WINDOW_CASES]
)
def test_cpu_kernel_window_and_soft_cap_match_reference(
    dtype, sliding_window, soft_cap, n, k, h, s
):
    args, _ = make_batch(WINDOW_MIX, n=n, k=k, h=h, s=s, dtype=dtype, seed=n + h + s)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.3)
    out = ragged_paged_attention_cpu(*args, **opts)
    assert out.dtype == dtype
    assert_matches(out, ragged_paged_attention_reference(*args, **opts), args, dtype)


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (37, 2.0)])
@pytest.mark.parametrize("h,s", [(16, 8), (64, 16)])
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("dtype,as_bytes", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_cpu_kernel_fp8_cache_window_and_soft_cap(
    dtype, as_bytes, kv_dtype, h, s, sliding_window, soft_cap
):
    args, _ = make_batch(WINDOW_MIX, n=8, k=2, h=h, s=s, dtype=dtype, seed=h, kv_dtype=kv_dtype)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    if as_bytes:
        q, cache, *meta = args
        args = (q, jax.lax.bitcast_convert_type(cache, jnp.uint8), *meta)
        opts["fp8_dtype"] = kv_dtype
    out = ragged_paged_attention_cpu(*args, **opts)
    assert out.dtype == dtype
    assert_matches(out, ragged_paged_attention_reference(*args, **opts), args, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,k,h,s", [(4, 4, 16, 8), (8, 2, 64, 16), (32, 1, 64, 16)])
def test_cpu_kernel_keys_before_the_window_never_reach_a_query(dtype, n, k, h, s):
    """K and V are NaN at every position no query of its request sees (before its first
    query's window): in the pages the kernel skips, and in the first page it reads, where a
    decode row's window may start at an odd token (the bf16 decode pairs value rows). The
    output is the reference's on the clean cache."""
    window = 21
    args, _ = make_batch(WINDOW_MIX, n=n, k=k, h=h, s=s, dtype=dtype, seed=n + h)
    q, cache, kv_lens, tables, query_start, query_lens, num_seqs = args
    poisoned, tables = np.array(cache.astype(jnp.float32)), np.asarray(tables)
    for r in range(int(num_seqs[0])):
        first = int(kv_lens[r] - query_lens[r])  # the first query's position
        for pos in range(max(0, first - window + 1)):
            poisoned[tables[r, pos // s], pos % s] = np.nan
    bad = (q, jnp.asarray(poisoned).astype(dtype), *args[2:])
    out = ragged_paged_attention_cpu(*bad, sliding_window=window)
    ref = ragged_paged_attention_reference(*args, sliding_window=window)
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n,k,h", [(8, 8, 64), (8, 1, 64), (8, 1, 32)])
def test_cpu_kernel_values_outside_a_window_never_reach_its_query(n, k, h, dtype):
    # An infinite V at position 3 of a prefill must not reach queries from position 11 on,
    # whose windows of 8 start after it, through 0 * inf: in the vector paths they share
    # query blocks (and lane groups) with queries that see it.
    args, _ = make_batch([(40, 40)], n=n, k=k, h=h, s=16, dtype=dtype, seed=4)
    q, cache, kv_lens, tables, *rest = args
    clean = np.asarray(ragged_paged_attention_cpu(*args, sliding_window=8).astype(jnp.float32))
    cache = cache.at[tables[0, 0], 3, 1::2].set(jnp.inf)
    args = (q, cache, kv_lens, tables, *rest)
    out = np.asarray(ragged_paged_attention_cpu(*args, sliding_window=8).astype(jnp.float32))
    ref = np.asarray(ragged_paged_attention_reference(*args, sliding_window=8).astype(jnp.float32))
    q0 = int(args[4][0])
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out[q0 + 11 : q0 + 40], ref[q0 + 11 : q0 + 40], atol=tol, rtol=tol)
    assert np.array_equal(
        out[q0 + 11 : q0 + 40].view(np.int32), clean[q0 + 11 : q0 + 40].view(np.int32)
    )
    assert np.isfinite(out[q0 + 11 : q0 + 40]).all()
    assert not np.isfinite(out[q0 + 3 : q0 + 11]).all()  # the queries that see it


def test_cpu_kernel_window_and_soft_cap_on_a_stacked_cache_under_jit():
    args, _ = make_batch(WINDOW_MIX, n=8, k=2, h=64, s=16, dtype=jnp.bfloat16, seed=6)
    q, cache, *meta = args
    nan = jnp.full_like(cache, jnp.nan)
    stacked = jnp.stack([nan, cache])  # [L=2, B, S, 2K, H]: only layer 1 is real
    opts = dict(sliding_window=20, soft_cap=1.5)
    run = jax.jit(lambda q, c, layer, *m: ragged_paged_attention_cpu(q, c, *m, layer=layer, **opts))
    out = run(q, stacked, jnp.int32(1), *meta)
    assert_matches(out, ragged_paged_attention_reference(*args, **opts), args, jnp.bfloat16)


def test_cpu_kernel_under_shard_map_with_window_and_soft_cap():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(2)
    args, _ = make_batch(WINDOW_MIX, n=8, k=2, h=64, s=16, dtype=jnp.float32, seed=9)
    opts = dict(sliding_window=37, soft_cap=2.0)
    ref = ragged_paged_attention_reference(*args, **opts)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    stacked = jax.device_put(
        cache[None], NamedSharding(mesh, P(None, None, None, MODEL_AXIS, None))
    )
    run = jax.jit(functools.partial(ragged_paged_attention_cpu_sharded, mesh, MODEL_AXIS, **opts))
    out = run(q, stacked, jnp.int32(0), *meta)
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize(
    "bad",
    [
        dict(sliding_window=0),
        dict(sliding_window=-4),
        dict(sliding_window=2.5),
        dict(soft_cap=0.0),
        dict(soft_cap=-1.0),
        dict(sm_scale=0.0),
    ],
    ids=str,
)
def test_cpu_kernel_rejects_bad_options(bad):
    from sharding import MODEL_AXIS, make_mesh

    args, _ = make_batch(MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32)
    q, cache, *meta = args
    with pytest.raises(ValueError):
        ragged_paged_attention_cpu(*args, **bad)
    with pytest.raises(ValueError):
        ragged_paged_attention_cpu_sharded(
            make_mesh(2), MODEL_AXIS, q, cache[None], 0, *meta, **bad
        )


@pytest.mark.parametrize(
    "opts",
    [dict(), dict(sliding_window=6, soft_cap=1.5)],
    ids=["plain", "window-cap"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_sinks_match_reference(dtype, opts):
    """gpt-oss's sinks in the TPU kernel: the running max starts at each head's sink, the
    normaliser at 1; MIX mixes prefill chunks and decodes, and its padding rows stay 0."""
    n = 8
    args, _ = make_batch(MIX, n=n, k=2, h=16, s=8, dtype=dtype, seed=13)
    sinks = jnp.asarray(np.random.default_rng(1).normal(size=n) * 2, jnp.float32)
    ref = ragged_paged_attention_reference(*args, sinks=sinks, **opts)
    out = ragged_paged_attention(
        *args, sinks=sinks, **opts, block_q=8, pages_per_chunk=2, interpret=True
    )
    assert_matches(out, ref, args, dtype)
    plain = ragged_paged_attention_reference(*args, **opts)
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(plain, np.float32), atol=0.05)


def test_kernel_sinks_under_shard_map():
    """Each device takes its own heads' sinks."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_sharded
    from sharding import MODEL_AXIS, make_mesh

    n = 8
    args, _ = make_batch(MIX, n=n, k=2, h=16, s=8, dtype=jnp.float32, seed=14)
    sinks = jnp.asarray(np.random.default_rng(2).normal(size=n) * 2, jnp.float32)
    kernel = functools.partial(ragged_paged_attention, block_q=8, interpret=True)
    out = ragged_paged_attention_sharded(
        make_mesh(2), MODEL_AXIS, *args, kernel=kernel, sinks=sinks
    )
    assert_matches(out, ragged_paged_attention_reference(*args, sinks=sinks), args, jnp.float32)


def test_sinks_refused_with_a_latent_cache():
    from pallas_kernels.ragged_paged_attention.validation import validate_sinks

    with pytest.raises(ValueError, match="latent"):
        validate_sinks(jnp.zeros(4), 4, latent=True)


@pytest.mark.parametrize(
    "opts",
    [dict(chunk_size=8), dict(chunk_size=4, sliding_window=6), dict(chunk_size=16)],
    ids=["chunk8", "chunk4-window", "chunk16"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_chunked_local_attention_matches_reference(dtype, opts):
    """Llama 4's chunked local attention in the TPU kernel: a row at p sees keys from
    floor(p / C) * C. MIX's prefill chunks and q blocks cross chunk boundaries (a block's
    rows in two chunks), its contexts run past several chunks."""
    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=dtype, seed=21)
    ref = ragged_paged_attention_reference(*args, **opts)
    out = ragged_paged_attention(*args, **opts, block_q=8, pages_per_chunk=2, interpret=True)
    assert_matches(out, ref, args, dtype)
    full = ragged_paged_attention_reference(*args)
    assert not np.allclose(np.asarray(ref, np.float32), np.asarray(full, np.float32), atol=0.05)


def test_kernel_chunked_attention_with_sinks_under_shard_map():
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_sharded
    from sharding import MODEL_AXIS, make_mesh

    args, _ = make_batch(MIX, n=8, k=2, h=16, s=8, dtype=jnp.float32, seed=22)
    sinks = jnp.asarray(np.random.default_rng(3).normal(size=8) * 2, jnp.float32)
    kernel = functools.partial(ragged_paged_attention, block_q=8, interpret=True)
    out = ragged_paged_attention_sharded(
        make_mesh(2), MODEL_AXIS, *args, kernel=kernel, sinks=sinks, chunk_size=8
    )
    ref = ragged_paged_attention_reference(*args, sinks=sinks, chunk_size=8)
    assert_matches(out, ref, args, jnp.float32)

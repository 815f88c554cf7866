"""The C++ CPU kernel's q_horizon (bidirectional spans, Gemma 3's images) against the jnp
reference: spans inside the prefill rows of several requests, starting before a chunk or
running past its context (clipped to kv_len), ending exactly at a request's last position,
across the kernel's 16-query blocks and pages; with and without sliding windows, on each of
the kernel's paths, float32, bfloat16 and float8 caches, and under shard_map.

Its attention sinks (gpt-oss) likewise: each routine (the scalar loop, run_prefill with its
lanes of several heads, the decode paths), crossed with windows, soft caps and the
batch-invariant mode, on float8 caches, split over devices with the heads, and a row's bits
in the batch-invariant mode whatever routine its neighbours would take.

The rest of the kernel's tests (causal attention, windows, soft caps, errors) are in
test_ragged_paged_attention.py, beside the other flavours'.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_batches import MIX, assert_matches, make_batch, owned_rows

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_cpu,
    ragged_paged_attention_cpu_sharded,
    ragged_paged_attention_reference,
)

# (kv_len, query_len): a fresh prefill of three 16-query blocks, chunks of prefills (at
# positions 37..69 and 80..99), a whole request of one span, decodes, a prefill with no span.
SPAN_MIX = [(40, 40), (70, 33), (13, 13), (5, 1), (30, 7), (9, 9), (17, 1), (100, 20)]
# (request, first position, last position) of each span. 30..39, 0..12 and 84..99 end at
# their request's last position; 30..45 starts before its chunk; 60..80 runs past its
# context (to 69) and 2..9 past a decode row's (its position, 4); 5..20 and 84..99 cross
# a block's and a page's edge.
SPANS = [
    *[(0, 5, 20), (0, 30, 39), (1, 30, 45), (1, 60, 80)],
    *[(2, 0, 12), (3, 2, 9), (4, 25, 27), (7, 84, 99)],
]
# No window, one longer than every span (24), one shorter (5): a span's first rows then see
# forward to its end and back 5.
WINDOWS = [None, 24, 5]


def horizons(args, spans=SPANS, seed=0) -> jax.Array:
    """q_horizon [T] for a batch: a row of request r at a position of a span (r, a, b) sees up
    to b; the other rows of valid requests get a horizon at or before their own position
    (causal), padding rows anything."""
    q, _, kv_lens, _, query_start, query_lens, num_seqs = (np.asarray(a) for a in args)
    rng = np.random.default_rng(seed)
    horizon = rng.integers(-(2**31), 2**31 - 1, q.shape[0], dtype=np.int64)
    for r in range(int(num_seqs[0])):
        q0, q_len = int(query_start[r]), int(query_lens[r])
        pos = kv_lens[r] - q_len + np.arange(q_len)  # [q_len]
        horizon[q0 : q0 + q_len] = rng.integers(-1, pos + 1)
        for span_r, a, b in spans:
            if span_r == r:
                horizon[q0 : q0 + q_len][(a <= pos) & (pos <= b)] = b
    return jnp.asarray(horizon, jnp.int32)


def test_spans_change_the_reference():
    """The spans reach the reference's output on their rows but the last of each span (which
    sees what a causal query sees), and nowhere else."""
    args, _ = make_batch(SPAN_MIX, n=4, k=2, h=16, s=8, dtype=jnp.float32, seed=1)
    q_horizon = horizons(args)
    out = np.asarray(ragged_paged_attention_reference(*args, q_horizon=q_horizon))
    causal = np.asarray(ragged_paged_attention_reference(*args))
    kv_lens, query_start, query_lens = (np.asarray(args[i]) for i in (2, 4, 5))
    changed = np.zeros(len(out), bool)
    for r, a, b in SPANS:
        q0, q_len = int(query_start[r]), int(query_lens[r])
        pos = kv_lens[r] - q_len + np.arange(q_len)
        changed[q0 : q0 + q_len] |= (a <= pos) & (pos < min(b, kv_lens[r] - 1))
    assert changed.sum() > 50
    differs = np.abs(out - causal).max(axis=(1, 2)) > 1e-3
    np.testing.assert_array_equal(differs, changed)


# h=16 or s=8: the generic loop; s=16 with h=64 or 128: run_prefill (9/3 heads and single
# queries of 32/1 leave padding lanes; with 4/4, one head per kv head, a lane group holds 16
# queries, more than the window of 5, so a span's rows see keys in the window's lower edge
# past their own positions) and the decode paths.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize(
    "n,k,h,s",
    [
        (4, 4, 16, 8),
        (4, 4, 64, 16),
        (8, 2, 64, 16),
        (9, 3, 64, 16),
        (32, 1, 64, 16),
        (6, 1, 128, 16),
    ],
)
def test_cpu_kernel_horizon_matches_reference(dtype, sliding_window, n, k, h, s):
    args, _ = make_batch(SPAN_MIX, n=n, k=k, h=h, s=s, dtype=dtype, seed=n + h + s)
    opts = dict(sliding_window=sliding_window, sm_scale=0.3, q_horizon=horizons(args, seed=n))
    out = ragged_paged_attention_cpu(*args, **opts)
    assert out.dtype == dtype
    assert_matches(out, ragged_paged_attention_reference(*args, **opts), args, dtype)


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (24, 2.0)])
@pytest.mark.parametrize("h,s", [(16, 8), (64, 16)])
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("dtype,as_bytes", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_cpu_kernel_horizon_on_an_fp8_cache(
    dtype, as_bytes, kv_dtype, h, s, sliding_window, soft_cap
):
    args, _ = make_batch(SPAN_MIX, n=8, k=2, h=h, s=s, dtype=dtype, seed=h, kv_dtype=kv_dtype)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap, q_horizon=horizons(args))
    if as_bytes:
        q, cache, *meta = args
        args = (q, jax.lax.bitcast_convert_type(cache, jnp.uint8), *meta)
        opts["fp8_dtype"] = kv_dtype
    out = ragged_paged_attention_cpu(*args, **opts)
    assert out.dtype == dtype
    assert_matches(out, ragged_paged_attention_reference(*args, **opts), args, dtype)


@pytest.mark.parametrize("n,k,h,s", [(4, 4, 16, 8), (8, 2, 64, 16), (9, 3, 64, 16)])
def test_cpu_kernel_horizon_at_each_position_is_causal(n, k, h, s):
    """Horizons at or before each row's own position give the causal output, bit for bit."""
    args, _ = make_batch(SPAN_MIX, n=n, k=k, h=h, s=s, dtype=jnp.float32, seed=3)
    causal = ragged_paged_attention_cpu(*args, sliding_window=24)
    out = ragged_paged_attention_cpu(*args, sliding_window=24, q_horizon=horizons(args, []))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(causal))


@pytest.mark.parametrize("n,k,h", [(8, 8, 64), (8, 1, 64), (8, 1, 32)])
def test_cpu_kernel_values_past_a_horizon_never_reach_its_query(n, k, h):
    # An infinite V at position 12 of a prefill must not reach the span 3..10's queries, which
    # see past their own positions but not that far, nor the queries before 12, through
    # 0 * inf: in the vector path they share query blocks (and lane groups) with the queries
    # that see it.
    args, _ = make_batch([(40, 40)], n=n, k=k, h=h, s=16, dtype=jnp.float32, seed=4)
    q, cache, kv_lens, tables, *rest = args
    cache = cache.at[tables[0, 0], 12, 1::2].set(jnp.inf)
    args = (q, cache, kv_lens, tables, *rest)
    q_horizon = horizons(args, [(0, 3, 10)])
    out = np.asarray(ragged_paged_attention_cpu(*args, q_horizon=q_horizon))
    ref = np.asarray(ragged_paged_attention_reference(*args, q_horizon=q_horizon))
    q0 = int(args[4][0])
    np.testing.assert_allclose(out[q0 : q0 + 12], ref[q0 : q0 + 12], atol=1e-5, rtol=1e-5)
    assert np.isfinite(out[q0 : q0 + 12]).all()
    assert not np.isfinite(out[q0 + 12 : q0 + 40]).all()  # the queries that see it


def test_cpu_kernel_horizon_on_a_stacked_cache_under_jit():
    args, _ = make_batch(SPAN_MIX, n=8, k=2, h=64, s=16, dtype=jnp.bfloat16, seed=6)
    q, cache, *meta = args
    stacked = jnp.stack([jnp.full_like(cache, jnp.nan), cache])  # only layer 1 is real
    q_horizon = horizons(args)
    run = jax.jit(
        lambda q, c, layer, hz, *m: ragged_paged_attention_cpu(
            q, c, *m, layer=layer, sliding_window=24, q_horizon=hz
        )
    )
    out = run(q, stacked, jnp.int32(1), q_horizon, *meta)
    ref = ragged_paged_attention_reference(*args, sliding_window=24, q_horizon=q_horizon)
    assert_matches(out, ref, args, jnp.bfloat16)


@pytest.mark.parametrize("tp,n,k", [(2, 8, 2), (4, 8, 4)])
def test_cpu_kernel_under_shard_map_with_horizon(tp, n, k):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(tp)
    args, _ = make_batch(SPAN_MIX, n=n, k=k, h=64, s=16, dtype=jnp.float32, seed=tp + n)
    opts = dict(sliding_window=24, soft_cap=2.0)
    q_horizon = horizons(args)
    ref = ragged_paged_attention_reference(*args, q_horizon=q_horizon, **opts)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    stacked = jax.device_put(
        cache[None], NamedSharding(mesh, P(None, None, None, MODEL_AXIS, None))
    )
    run = jax.jit(functools.partial(ragged_paged_attention_cpu_sharded, mesh, MODEL_AXIS, **opts))
    out = run(q, stacked, jnp.int32(0), *meta, q_horizon=q_horizon)
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert_matches(out, ref, args, jnp.float32)


BAD_HORIZONS = {
    "short": lambda t: np.zeros(t - 1, np.int32),
    "rank-2": lambda t: np.zeros((t, 1), np.int32),
    "int64": lambda t: np.zeros(t, np.int64),
    "a-list": lambda t: [0] * t,
}


@pytest.mark.parametrize("bad", list(BAD_HORIZONS))
def test_cpu_kernel_rejects_a_bad_horizon(bad):
    from sharding import MODEL_AXIS, make_mesh

    args, _ = make_batch(SPAN_MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32)
    q, cache, *meta = args
    q_horizon = BAD_HORIZONS[bad](q.shape[0])
    with pytest.raises(ValueError, match="q_horizon must be int32"):
        ragged_paged_attention_cpu(*args, q_horizon=q_horizon)
    with pytest.raises(ValueError, match="q_horizon must be int32"):
        ragged_paged_attention_cpu_sharded(
            make_mesh(2), MODEL_AXIS, q, cache[None], 0, *meta, q_horizon=q_horizon
        )


# Attention sinks. A decode over many pages (the online softmax rescales the sink's term
# across them) and a prefill of three 16-query blocks beside MIX's decodes and chunks.
SINK_MIX = [*MIX, (100, 1), (70, 33)]
SINK_OPTIONS = [(None, None), (5, None), (37, 2.0)]  # (sliding_window, soft_cap)


def random_sinks(n, seed=0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=n) * 2, jnp.float32)


@pytest.mark.parametrize("n,k,h,s", [(4, 4, 16, 8), (8, 2, 64, 16)])
def test_sinks_change_the_output(n, k, h, s):
    """The sinks reach every owned row of the reference and of the kernel (so the tests below
    would see a kernel that dropped them, or read another head's)."""
    args, _ = make_batch(SINK_MIX, n=n, k=k, h=h, s=s, dtype=jnp.float32, seed=5)
    sinks = random_sinks(n)
    owned = owned_rows(args)
    for attend in (ragged_paged_attention_reference, ragged_paged_attention_cpu):
        out = np.asarray(attend(*args, sm_scale=0.3, sinks=sinks))[owned]
        plain = np.asarray(attend(*args, sm_scale=0.3))[owned]
        change = np.abs(out - plain).max(axis=2)  # [rows, heads]
        assert (change > 1e-5).all() and (change.max(axis=1) > 1e-3).all()
        # The same sinks in another head order change it again.
        swapped = np.asarray(attend(*args, sm_scale=0.3, sinks=sinks[::-1]))[owned]
        assert not np.allclose(out, swapped, atol=1e-3)


# h=16 or s=8: the scalar loop; s=16 with h=64 or 128: run_prefill (8/2 and 6/1: lanes of
# several queries' heads; 32/1: single queries too, 32 heads per kv head) and the decode
# paths (their AVX512-BF16 twin for bfloat16 where the CPU has it); the batch-invariant mode
# sends the decode rows through run_prefill.
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("sliding_window,soft_cap", SINK_OPTIONS)
@pytest.mark.parametrize(
    "n,k,h,s", [(4, 4, 16, 8), (8, 2, 64, 16), (6, 1, 128, 16), (32, 1, 64, 16)]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_sinks_match_reference(
    dtype, n, k, h, s, sliding_window, soft_cap, batch_invariant
):
    args, _ = make_batch(SINK_MIX, n=n, k=k, h=h, s=s, dtype=dtype, seed=n + h + s)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.3)
    sinks = random_sinks(n, seed=h)
    out = ragged_paged_attention_cpu(*args, **opts, sinks=sinks, batch_invariant=batch_invariant)
    assert out.dtype == dtype
    ref = ragged_paged_attention_reference(*args, **opts, sinks=sinks)
    assert_matches(out, ref, args, dtype)


@pytest.mark.parametrize("h,s", [(16, 8), (64, 16)])
@pytest.mark.parametrize(
    "dtype,kv_dtype,as_bytes",
    [(jnp.float32, jnp.float8_e4m3fn, False), (jnp.bfloat16, jnp.float8_e5m2, True)],
)
def test_cpu_kernel_sinks_on_an_fp8_cache(dtype, kv_dtype, as_bytes, h, s):
    args, _ = make_batch(SINK_MIX, n=8, k=2, h=h, s=s, dtype=dtype, seed=h, kv_dtype=kv_dtype)
    opts = dict(sliding_window=37, soft_cap=2.0, sinks=random_sinks(8, seed=1))
    if as_bytes:
        q, cache, *meta = args
        args = (q, jax.lax.bitcast_convert_type(cache, jnp.uint8), *meta)
        opts["fp8_dtype"] = kv_dtype
    out = ragged_paged_attention_cpu(*args, **opts)
    assert out.dtype == dtype
    assert_matches(out, ragged_paged_attention_reference(*args, **opts), args, dtype)


@pytest.mark.parametrize("n,k,h,s", [(8, 2, 64, 16), (4, 4, 16, 8)])
def test_cpu_kernel_under_shard_map_with_sinks(n, k, h, s):
    """Two devices, each with its half of the heads and of the sinks (traced, under jit)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import MODEL_AXIS, make_mesh

    mesh = make_mesh(2)
    args, _ = make_batch(SINK_MIX, n=n, k=k, h=h, s=s, dtype=jnp.float32, seed=n + h)
    opts = dict(sliding_window=37, soft_cap=2.0)
    sinks = random_sinks(n, seed=2)
    ref = ragged_paged_attention_reference(*args, sinks=sinks, **opts)
    q, cache, *meta = args
    q = jax.device_put(q, NamedSharding(mesh, P(None, MODEL_AXIS, None)))
    stacked = jax.device_put(
        cache[None], NamedSharding(mesh, P(None, None, None, MODEL_AXIS, None))
    )
    run = jax.jit(functools.partial(ragged_paged_attention_cpu_sharded, mesh, MODEL_AXIS, **opts))
    out = run(q, stacked, jnp.int32(0), *meta, sinks=sinks)
    assert out.sharding.spec == P(None, MODEL_AXIS, None)
    assert_matches(out, ref, args, jnp.float32)


@pytest.mark.parametrize(
    "limit", [dict(sliding_window=20), dict(chunk_size=16)], ids=["window", "chunks"]
)
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h", [16, 64])
def test_cpu_kernel_batch_invariant_row_with_sinks(h, dtype, with_sinks, limit):
    """In the batch-invariant mode, with sinks (and without), a query's bits are the same as a
    decode row alone, as a chunk's last row beside a neighbour, and as a middle row of a
    prompt: there (h=64, run_prefill) keys at its window's (or attention chunk's) lower edge
    share a lane group's pass with later queries' keys, which must add up in key order all
    the same."""
    rng = np.random.default_rng(h)
    s, k, n, length = 16, 2, 4, 45
    pages = -(-length // s)
    cache = jnp.asarray(rng.standard_normal((1 + 2 * pages, s, 2 * k, h)), dtype)
    tables = jnp.asarray([[1 + i * pages + j for j in range(pages)] for i in range(2)], jnp.int32)
    q_rows = rng.standard_normal((2, length, n, h)).astype(np.float32)
    sinks = random_sinks(n, seed=3) if with_sinks else None

    def row(requests, position):  # requests: (first position, query count); the probe's first
        q = np.concatenate([q_rows[i][p : p + c] for i, (p, c) in enumerate(requests)])
        out = ragged_paged_attention_cpu(
            jnp.asarray(q, dtype),
            cache,
            jnp.asarray([p + c for p, c in requests], jnp.int32),
            tables[: len(requests)],
            jnp.asarray(np.cumsum([0] + [c for _, c in requests])[:-1], jnp.int32),
            jnp.asarray([c for _, c in requests], jnp.int32),
            jnp.asarray([len(requests)], jnp.int32),
            sinks=sinks,
            batch_invariant=True,
            **limit,
        )
        first = requests[0][0]
        return np.asarray(out.astype(jnp.float32))[position - first].view(np.int32)

    probe = length - 1
    alone = row([(probe, 1)], probe)
    assert np.array_equal(row([(length - 7, 7), (3, 30)], probe), alone)
    assert np.array_equal(row([(0, length)], probe), alone)
    assert np.array_equal(row([(0, length)], 33), row([(33, 1), (10, 1)], 33))


BAD_SINKS = {
    "short": (lambda n: jnp.zeros(n - 1), "sinks must be"),
    "rank-2": (lambda n: jnp.zeros((n, 1)), "sinks must be"),
    "int32": (lambda n: jnp.zeros(n, jnp.int32), "sinks must be floating"),
}


@pytest.mark.parametrize("bad", list(BAD_SINKS))
def test_cpu_kernel_rejects_bad_sinks(bad):
    from sharding import MODEL_AXIS, make_mesh

    args, _ = make_batch(MIX[:2], n=4, k=2, h=8, s=8, dtype=jnp.float32)
    q, cache, *meta = args
    make, message = BAD_SINKS[bad]
    sinks = make(q.shape[1])
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_cpu(*args, sinks=sinks)
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_cpu_sharded(
            make_mesh(2), MODEL_AXIS, q, cache[None], 0, *meta, sinks=sinks
        )


def test_cpu_kernel_refuses_sinks_with_a_latent_cache():
    from sharding import MODEL_AXIS, make_mesh

    args, _ = make_batch(MIX[:2], n=4, k=1, h=16, s=8, dtype=jnp.float32)
    q, cache, *meta = args
    latent = cache[:, :, 0]  # [B, S, H]: one vector per token
    options = dict(latent=True, v_head_dim=8)
    ragged_paged_attention_cpu(q, latent, *meta, **options)  # without sinks: fine
    with pytest.raises(ValueError, match="sinks with a latent"):
        ragged_paged_attention_cpu(q, latent, *meta, **options, sinks=jnp.zeros(4))
    with pytest.raises(ValueError, match="sinks with a latent"):
        ragged_paged_attention_cpu_sharded(
            make_mesh(2), MODEL_AXIS, q, latent[None], 0, *meta, **options, sinks=jnp.zeros(4)
        )


# (chunk_size, sliding_window, soft_cap): chunks alone, inside a wider window, past a narrower
CHUNK_OPTIONS = [(16, None, None), (8, 37, 2.0), (32, 5, None)]


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("chunk_size,sliding_window,soft_cap", CHUNK_OPTIONS)
@pytest.mark.parametrize(
    "n,k,h,s", [(4, 4, 16, 8), (8, 2, 64, 16), (6, 1, 128, 16), (32, 1, 64, 16)]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_chunked_local_attention_matches_reference(
    dtype, n, k, h, s, chunk_size, sliding_window, soft_cap, batch_invariant
):
    """Llama 4's chunked local attention in every routine (the scalar loop, run_prefill's
    lane groups whose rows start in different chunks, the decode paths): a row at p sees
    keys from floor(p / C) * C. SINK_MIX's contexts run past several chunks."""
    args, _ = make_batch(SINK_MIX, n=n, k=k, h=h, s=s, dtype=dtype, seed=n + h + s + 1)
    opts = dict(
        chunk_size=chunk_size, sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=0.3
    )
    out = ragged_paged_attention_cpu(*args, **opts, batch_invariant=batch_invariant)
    ref = ragged_paged_attention_reference(*args, **opts)
    assert_matches(out, ref, args, dtype)
    sinks = random_sinks(n, seed=h + 1)
    out = ragged_paged_attention_cpu(*args, **opts, sinks=sinks, batch_invariant=batch_invariant)
    assert_matches(out, ragged_paged_attention_reference(*args, **opts, sinks=sinks), args, dtype)


def test_cpu_kernel_chunked_attention_under_shard_map():
    from sharding import MODEL_AXIS, make_mesh

    args, _ = make_batch(SINK_MIX, n=8, k=2, h=64, s=16, dtype=jnp.float32, seed=5)
    q, cache, *meta = args
    out = ragged_paged_attention_cpu_sharded(
        make_mesh(2), MODEL_AXIS, q, cache[None], 0, *meta, chunk_size=16
    )
    ref = ragged_paged_attention_reference(*args, chunk_size=16)
    assert_matches(out, ref, args, jnp.float32)

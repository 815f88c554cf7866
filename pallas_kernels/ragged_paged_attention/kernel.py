"""Ragged paged attention as a Pallas TPU kernel: mixed prefill + decode in one call.

Design. The grid is ``(R, cdiv(T, block_q))``: step ``(r, i)`` owns query rows
``query_start[r] + i * block_q ...`` of request ``r`` (at most ``block_q`` of them) and
does nothing when ``r >= num_seqs`` or the request has fewer queries. All metadata
(``kv_lens``, the flattened ``block_tables``, ``query_start``, ``query_lens``,
``num_seqs`` and the layer) is scalar-prefetched into SMEM, so the page table drives the KV
DMAs. The cache is the model's whole stacked cache ``[L, B, S, 2K, H]``: pages are copied
straight out of layer ``layer``, so a model scanning its layers never copies one out.

q, the KV cache and the output stay in HBM (``pl.ANY``); each step moves fixed-size
windows by hand. q is handed over head-major as ``[N, T, H]`` so that one kv head's
query group is a contiguous ``[G * block_q, H]`` matrix (G = N // K). The step copies a
``block_q``-row window of q starting at ``min(row_lo, T - block_q)`` (clamped so the
static-size copy stays in bounds), then walks its kv range in chunks of
``pages_per_chunk`` pages: one DMA per page into a double-buffered VMEM chunk, the next
chunk's DMAs started before the current one is consumed. Only pages that hold positions
the step can attend to (causal limit, sliding window, Llama 4's attention chunk) are
fetched; every other column of the chunk buffer holds stale data and is masked out of the
scores *and* zeroed in V,
so NaN/garbage there cannot leak through ``0 * NaN``. Scores, the running max, the
normaliser and the accumulator are float32 (online softmax).

Output. The output aliases a zero-initialised ``[N, T, H]`` array, so rows no valid
request owns (gaps, padding) stay zero. A step's ``block_q`` window can overlap rows of
other requests (clamping, a short last block), so the write is read-modify-write: copy
the window in, ``jnp.where`` the step's own rows over it, copy it back. Both grid
dimensions are "arbitrary", i.e. sequential, so these read-modify-writes never race.

Horizon. With ``q_horizon`` (Gemma 3's image tokens attending to each other both ways) a
row sees up to ``max(its position, q_horizon[row])`` instead of its position, never past
the request's context. The wrapper adds two operands: a ``[T]`` table in SMEM of the
largest horizon of the ``block_q`` rows from each row on, which moves the step's last
position (the end of its kv walk) out to the furthest horizon of its rows, and the
horizons themselves as ``[1, T, 1]`` in HBM, of which the step copies its window to mask
row by row. Without it the kernel is compiled exactly as before.

Sinks (gpt-oss). With ``sinks`` [N] each query head's running max starts at its sink and
its running normaliser at 1: the softmax's denominator then holds exp(sink - m) once, a key
of that score and no value, whatever the kv walk. They reach the kernel broadcast to the
running max's [N, block_q, 1] as one VMEM block every step reads. Without them the kernel is
compiled as before.

Latent (MLA's absorbed form). With ``latent`` the cache is ``[L, B, S, H]``, one latent
vector per token (kv_lora_rank + qk_rope_head_dim lanes): one KV head that every query
head reads (K = 1, G = N), whose first ``v_head_dim`` lanes are also its value. A page is
copied once into the chunk buffer and read as both; the accumulator and the output have
``v_head_dim`` lanes. The scores are one product over all H lanes.

Known costs: the grid has R * cdiv(T, block_q) steps and most of them are empty for a
large batch (each costs only the SMEM reads and a branch); the output window is copied
in and out once per non-empty step.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .cache import from_cache, is_fp8_cache
from .validation import (
    stacked_and_checked,
    validate_options,
    validate_q_horizon,
    validate_sinks,
)


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start: jax.Array,
    query_lens: jax.Array,
    num_seqs,
    *,
    layer=None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int = 32,
    pages_per_chunk: int = 8,
    interpret: bool | pltpu.InterpretParams = False,
    fp8_dtype=None,
    q_horizon: jax.Array | None = None,
    latent: bool = False,
    v_head_dim: int | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Attention of a flat ragged batch of queries over a paged KV cache (Pallas TPU).

    q [T, N, H]; kv_cache [B, S, 2K, H] (K at head 2k, V at head 2k+1), or the stacked
    cache [L, B, S, 2K, H] with ``layer`` (an int or an int32 scalar, traced or not) picking
    the layer to read in place; kv_lens, query_start, query_lens [R] int32; block_tables
    [R, P] int32; num_seqs int32 scalar or [1]. Returns [T, N, H] in q's dtype, zero on rows
    no valid request owns. ``interpret=True`` runs the kernel in TPU interpret mode (CPU); an
    ``pltpu.InterpretParams`` is passed through as is. A float8 cache (``FP8_DTYPES``, or its
    bytes with ``fp8_dtype``: cache.py) is read into q's dtype. ``q_horizon`` [T] int32
    (optional): the last key position each query row sees when past its own (an image's
    span, seen both ways), as in `ragged_paged_attention_reference`; None is causal.
    ``latent`` (MLA): kv_cache is the latent cache [L, B, S, H] (or [B, S, H]) whose first
    ``v_head_dim`` lanes are the values; the result is [T, N, v_head_dim]. ``sinks`` [N]
    (optional): each query head's sink logit, as in the reference. ``chunk_size`` C
    (optional): chunked local attention (Llama 4), a query at position p sees keys from
    floor(p / C) * C, as in the reference; only the pages from there are read.
    """
    metadata = (kv_lens, block_tables, query_start, query_lens, num_seqs)
    kv_cache, layer = stacked_and_checked(
        q, kv_cache, layer, metadata, fp8_dtype, latent, v_head_dim
    )
    validate_options(sm_scale, sliding_window, soft_cap, chunk_size=chunk_size)
    validate_sinks(sinks, q.shape[1], latent)
    validate_q_horizon(q_horizon, q.shape[0])
    if block_q < 1 or pages_per_chunk < 1:
        raise ValueError(f"block_q={block_q} and pages_per_chunk={pages_per_chunk} must be >= 1")
    t, n, h = q.shape
    hv = v_head_dim or h
    r, p = block_tables.shape
    bq = min(block_q, t)
    ppc = min(pages_per_chunk, p)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(h)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    horizon = q_horizon is not None

    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        attention_chunk=chunk_size,
        soft_cap=soft_cap,
        pages_per_seq=p,
        fp8_dtype=fp8_dtype,
        horizon=horizon,
        latent=latent,
        sinks=sinks is not None,
    )
    prefetch = [
        kv_lens,
        block_tables.reshape(-1),  # 1-D in SMEM: no padding of a 2-D table
        query_start,
        query_lens,
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        jnp.asarray(layer, jnp.int32).reshape(1),
    ]
    inputs = [jnp.swapaxes(q, 0, 1), kv_cache]  # [N, T, H], [L, B, S, 2K, H] or [L, B, S, H]
    scratch = [
        pltpu.VMEM((n, bq, h), q.dtype),  # q window
        pltpu.VMEM((n, bq, hv), q.dtype),  # output window
        pltpu.VMEM((2, ppc, *kv_cache.shape[2:]), kv_cache.dtype),  # kv chunks, double-buffered
        pltpu.VMEM((n, bq, hv), jnp.float32),  # accumulator
        pltpu.VMEM((n, bq, 1), jnp.float32),  # running max
        pltpu.VMEM((n, bq, 1), jnp.float32),  # running normaliser
        pltpu.SemaphoreType.DMA((2, ppc)),  # one per page slot
        pltpu.SemaphoreType.DMA((2 + horizon,)),  # q window, output window[, horizon window]
    ]
    if horizon:
        prefetch.append(_horizon_ahead(q_horizon, bq))  # [T]
        inputs.append(q_horizon.reshape(1, t, 1))
        scratch.append(pltpu.VMEM((1, bq, 1), jnp.int32))  # horizon window
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)] * len(inputs)
    if sinks is not None:  # the running max's first value, one block every step reads
        inputs.append(jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (n, bq, 1)))
        in_specs.append(pl.BlockSpec((n, bq, 1), lambda *_: (0, 0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(r, pl.cdiv(t, bq)),
        in_specs=[*in_specs, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, t, hv), q.dtype),
        grid_spec=grid_spec,
        input_output_aliases={len(prefetch) + len(inputs): 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*prefetch, *inputs, jnp.zeros((n, t, hv), q.dtype))  # the zeros are aliased to the output
    return jnp.swapaxes(out, 0, 1)  # [T, N, Hv]


def _horizon_ahead(q_horizon: jax.Array, bq: int) -> jax.Array:
    """[T] int32: the largest horizon of rows t .. t + bq - 1 (those within T). At a step's
    first row it is that of the step's rows, exactly when they are bq; a request's last step
    may own fewer and pick up other rows' horizons, which the clip to the context undoes (its
    causal limit is the context's end already)."""
    lowest = jnp.iinfo(jnp.int32).min
    padded = jnp.pad(q_horizon, (0, bq - 1), constant_values=lowest)
    return jax.lax.reduce_window(padded, lowest, jax.lax.max, (bq,), (1,), "VALID")


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,
    block_tables_ref,
    query_start_ref,
    query_lens_ref,
    num_seqs_ref,
    layer_ref,
    *refs,
    sm_scale: float,
    sliding_window: int | None,
    attention_chunk: int | None,
    soft_cap: float | None,
    pages_per_seq: int,
    fp8_dtype,
    horizon: bool,
    latent: bool,
    sinks: bool,
):
    refs = list(refs)  # the horizon's operands are one more of each kind, last of each
    ahead_ref = refs.pop(0) if horizon else None
    q_hbm, kv_hbm = refs.pop(0), refs.pop(0)
    hz_hbm = refs.pop(0) if horizon else None
    sinks_ref = refs.pop(0) if sinks else None
    _out_init_hbm, out_hbm = refs.pop(0), refs.pop(0)
    hz_buf = refs.pop() if horizon else None
    # ahead_ref [T] (SMEM); q_hbm [N, T, H]; kv_hbm [L, B, S, 2K, H] (latent: [L, B, S, H]);
    # hz_hbm [1, T, 1]; sinks_ref [N, bq, 1] f32 (VMEM); _out_init_hbm aliased to out_hbm
    # [N, T, Hv]; hz_buf [1, bq, 1] int32.
    q_buf, o_buf, kv_buf, acc_ref, m_ref, l_ref, kv_sems, io_sems = refs
    # q_buf [N, bq, H]; o_buf [N, bq, Hv]; kv_buf [2, ppc, S, 2K, H] (latent: [2, ppc, S, H]);
    # acc_ref [N, bq, Hv] f32; m_ref, l_ref [N, bq, 1] f32; kv_sems [2, ppc]; io_sems [2]
    # (or [3], with the horizon)
    req, qblk = pl.program_id(0), pl.program_id(1)
    n, bq, h = q_buf.shape
    hv = o_buf.shape[2]
    ppc, s = kv_buf.shape[1:3]
    num_kv_heads = 1 if latent else kv_buf.shape[3] // 2
    group = n // num_kv_heads
    t = q_hbm.shape[1]
    chunk = ppc * s
    # A float8 cache's pages are read into the queries' dtype (scale 1).
    fp8 = is_fp8_cache(kv_buf.dtype, fp8_dtype)
    compute_dtype = q_buf.dtype if fp8 else jnp.promote_types(q_buf.dtype, kv_buf.dtype)

    kv_len = kv_lens_ref[req]
    q_len = query_lens_ref[req]
    q0 = query_start_ref[req]
    row_lo = q0 + qblk * bq  # first row of q this step owns
    row_hi = jnp.minimum(q0 + q_len, row_lo + bq)  # one past its last row
    window = jnp.minimum(row_lo, t - bq)  # first row of the static-size window
    ctx = kv_len - q_len  # kv positions before the request's first query
    last_pos = ctx + (row_hi - q0) - 1  # furthest position any owned row attends to
    if horizon:  # out to the furthest horizon of its rows (row_lo < T on a step that runs)
        ahead = ahead_ref[jnp.minimum(row_lo, t - 1)]
        last_pos = jnp.maximum(last_pos, jnp.minimum(ahead, kv_len - 1))
    first_pos = ctx + (row_lo - q0)
    lo_pos = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    if attention_chunk is not None:  # the first row's chunk starts the keys any row sees
        lo_pos = jnp.maximum(lo_pos, first_pos // attention_chunk * attention_chunk)

    @pl.when((req < num_seqs_ref[0]) & (row_lo < q0 + q_len))
    def _step():
        q_copy = pltpu.make_async_copy(q_hbm.at[:, pl.ds(window, bq)], q_buf, io_sems.at[0])
        o_read = pltpu.make_async_copy(out_hbm.at[:, pl.ds(window, bq)], o_buf, io_sems.at[1])
        q_copy.start()
        o_read.start()
        if horizon:
            hz_copy = pltpu.make_async_copy(hz_hbm.at[:, pl.ds(window, bq)], hz_buf, io_sems.at[2])
            hz_copy.start()

        def page_copy(c, slot, j):
            page_idx = jnp.minimum(c * ppc + j, pages_per_seq - 1)
            page = block_tables_ref[req * pages_per_seq + page_idx]
            src = kv_hbm.at[layer_ref[0], page]
            return pltpu.make_async_copy(src, kv_buf.at[slot, j], kv_sems.at[slot, j])

        def page_needed(c, j):
            first = (c * ppc + j) * s
            return (first <= last_pos) & (first + s > lo_pos) & (c * ppc + j < pages_per_seq)

        def for_chunk_pages(c, slot, action):
            for j in range(ppc):
                pl.when(page_needed(c, j))(lambda j=j: action(page_copy(c, slot, j)))

        c_start = lo_pos // chunk
        c_end = last_pos // chunk + 1
        for_chunk_pages(c_start, 0, lambda cp: cp.start())
        if sinks:  # the sink seen first: a key of its score and no value
            m_ref[...] = sinks_ref[...]
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        else:
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        # Query positions of the window's rows; rows the step does not own get
        # arbitrary positions and are dropped at the write.
        q_pos = ctx - q0 + window + jax.lax.broadcasted_iota(jnp.int32, (1, bq, 1), 1)
        sees_to = q_pos  # [1, bq, 1]: each row's last key position
        if horizon:
            hz_copy.wait()
            sees_to = jnp.maximum(q_pos, hz_buf[...])
        q_copy.wait()

        def chunk_body(c, carry):
            slot = jax.lax.rem(c - c_start, 2)

            @pl.when(c + 1 < c_end)
            def _prefetch():
                for_chunk_pages(c + 1, 1 - slot, lambda cp: cp.start())

            for_chunk_pages(c, slot, lambda cp: cp.wait())
            kv_pos = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, 1, chunk), 2)
            col_ok = (kv_pos >= lo_pos) & (kv_pos <= last_pos)  # [1, 1, C]
            mask = col_ok & (kv_pos <= sees_to)  # [1, bq, C]
            if sliding_window is not None:
                mask &= kv_pos > q_pos - sliding_window
            if attention_chunk is not None:
                mask &= kv_pos >= q_pos // attention_chunk * attention_chunk
            v_pos = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
            v_ok = (v_pos >= lo_pos) & (v_pos <= last_pos)  # [C, 1]
            for kh in range(num_kv_heads):
                heads = slice(kh * group, (kh + 1) * group)
                if latent:  # one vector: the key, and in its first Hv lanes the value
                    k = kv_buf[slot].reshape(chunk, h)  # [C, H]
                    k = from_cache(k, compute_dtype, fp8_dtype) if fp8 else k
                    v = k[:, :hv]  # [C, Hv]
                else:
                    k = kv_buf[slot, :, :, 2 * kh, :].reshape(chunk, h)  # [C, H]
                    v = kv_buf[slot, :, :, 2 * kh + 1, :].reshape(chunk, h)  # [C, H]
                    if fp8:
                        k = from_cache(k, compute_dtype, fp8_dtype)
                        v = from_cache(v, compute_dtype, fp8_dtype)
                v = jnp.where(v_ok, v, jnp.zeros_like(v))
                qg = q_buf[heads].reshape(group * bq, h)  # [G*bq, H]
                scores = jax.lax.dot_general(
                    qg.astype(compute_dtype),
                    k.astype(compute_dtype),
                    (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )  # [G*bq, C]
                scores = scores * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                scores = jnp.where(mask, scores.reshape(group, bq, chunk), -jnp.inf)

                m_prev = m_ref[heads]  # [G, bq, 1]
                m_new = jnp.maximum(m_prev, scores.max(axis=-1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked rows
                probs = jnp.exp(scores - m_safe)  # [G, bq, C]
                alpha = jnp.exp(m_prev - m_safe)  # [G, bq, 1]
                l_ref[heads] = alpha * l_ref[heads] + probs.sum(axis=-1, keepdims=True)
                pv = jnp.dot(
                    probs.reshape(group * bq, chunk).astype(v.dtype),
                    v,
                    preferred_element_type=jnp.float32,
                )  # [G*bq, Hv]
                acc_ref[heads] = alpha * acc_ref[heads] + pv.reshape(group, bq, hv)
                m_ref[heads] = m_new
            return carry

        jax.lax.fori_loop(c_start, c_end, chunk_body, 0)

        denom = l_ref[...]
        out = acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)  # [N, bq, Hv]
        rows = window + jax.lax.broadcasted_iota(jnp.int32, (1, bq, 1), 1)
        owned = (rows >= row_lo) & (rows < row_hi)
        o_read.wait()
        o_buf[...] = jnp.where(owned, out.astype(o_buf.dtype), o_buf[...])
        o_write = pltpu.make_async_copy(o_buf, out_hbm.at[:, pl.ds(window, bq)], io_sems.at[1])
        o_write.start()
        o_write.wait()

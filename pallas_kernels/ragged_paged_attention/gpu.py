"""Ragged paged attention for GPUs: the kit's contract as a Pallas kernel on Triton.

Design. A query tile is ``block_m`` rows of one kv head's query group: the wrapper lays q
out as ``[K, T * G, H]`` (row ``t * G + g`` is token t's head ``k * G + g``), so a tile of
``block_m // G`` consecutive tokens of one request, with all G heads that share kv head
k, is one contiguous ``[block_m, H]`` load and one matrix product per KV tile: GQA reads
each K/V page once per query group, not once per head. Rows past ``(block_m // G) * G``
(G need not be a power of two) and past the request's last token are masked.

The grid is ``(query tiles, K, kv splits)``. Query tiles are counted per request
(``ceil(query_len / tokens_per_tile)``); the wrapper turns the ragged metadata into a
``tile -> (request, first token)`` table of static length ``ceil(T / tokens_per_tile) + R``
(an upper bound on the tiles any batch of T tokens over R requests needs), and tiles past
the batch's own count return at once. Each program walks its request's KV in tiles of
``pages_per_tile`` pages: the page ids come from the block table and the pages are
gathered straight out of layer ``layer`` of the stacked cache ``[L, B, S, 2K, H]``, so a
model scanning its layers never copies one out. Only tiles holding positions the rows can
attend to (causal limit, sliding window, Llama 4's attention chunk) are read. Scores, the
running max and normaliser
and the accumulator are float32 (online softmax); positions the rows cannot see are masked
out of the scores and zeroed in V, so NaN or stale data in unused slots cannot leak.

Horizon. With ``q_horizon`` (Gemma 3's image tokens attending to each other both ways) a
row sees up to ``max(its position, q_horizon[token])`` instead of its position, never past
the request's context: the wrapper lays the horizons out as q's rows (``[T * G]``), a tile
loads its ``block_m`` of them beside its queries, and its KV walk (and the split of it)
runs to the furthest of them. Without it the kernel is compiled exactly as before.

Sinks. With ``sinks`` (gpt-oss's learned logit per query head) each head's softmax has one
more term in its denominator, a key of score ``sinks[h]`` (neither scaled nor capped) and
value zero. The wrapper lays the sinks out as a tile's rows (``[K, block_m]``: row m of kv
head k is query head ``k * G + m % G``, the same for every tile), and a program starts its
online softmax as if it had seen that key: running max the sink, normaliser 1. Under a KV
split only part 0 starts so, so the sink is counted once and the merge below is unchanged.
A row that sees no key outputs zero. Without sinks the kernel is compiled exactly as before.

Split KV (flash decoding). With few query tiles (a small decode batch), ``K`` programs
would leave most of the GPU idle while each walks a long context. ``num_kv_splits`` > 1
cuts each request's KV range into that many contiguous parts, one program each; every
part writes its normalised output and log-sum-exp, and a small jnp epilogue merges them.

Output. Rows no valid request owns stay zero (the output aliases a zero array). Each
program writes only its own rows, so programs never race.

Latent (MLA's absorbed form). With ``latent`` the cache is ``[L, B, S, H]``, one latent
vector per token: one KV head (K = 1, G = N) whose first ``v_head_dim`` lanes are also its
value. H (576 for DeepSeek-V3: 512 + 64) is not a power of two, so the queries and keys are
loaded as two parts, the value lanes and the rotary rest, and a score is the sum of their
two products; the values are the keys' first part, loaded once.

Triton needs power-of-two tile shapes: the head dim (each part of a latent), the block size
and the tiles are checked before lowering. The Triton lowering runs on any CUDA GPU and, with
``interpret=True``, on the CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .cache import from_cache, is_fp8_cache
from .validation import stacked_and_checked, validate_options, validate_q_horizon, validate_sinks


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def unsupported_shape(head_dim: int, block_size: int, v_head_dim: int | None = None) -> str | None:
    """Why the GPU kernel cannot take a model's head dim and KV block size, or None. With
    `v_head_dim` (a latent cache of `head_dim` lanes) the two parts it loads apart, the
    value lanes and the rest, must each be a power of two of at least 16."""
    if v_head_dim is not None:
        rest = head_dim - v_head_dim
        if min(v_head_dim, rest) < 16 or not (_pow2(v_head_dim) and _pow2(rest)):
            return (
                "the GPU kernel needs a latent's value lanes and its rotary lanes each a "
                f"power of two of at least 16, got {v_head_dim} + {rest}"
            )
    elif not _pow2(head_dim) or head_dim < 16:
        return f"the GPU kernel needs a power-of-two head dim of at least 16, got {head_dim}"
    if not _pow2(block_size):
        return f"the GPU kernel needs a power-of-two block size, got {block_size}"
    return None


def default_tiling(
    t: int, r: int, n: int, k: int, s: int, batch_invariant: bool = False
) -> tuple[int, int, int]:
    """(block_m, pages_per_tile, num_kv_splits) for a batch of T tokens over R requests.

    Decode-shaped batches (T <= 2R) get the smallest tile Triton's matrix units take (16
    rows, or G rounded up) so padded rows cost little; prefill-shaped ones 64 rows. KV
    tiles hold 64 positions. Splits give a small batch about 256 programs, at most 16.
    `batch_invariant`: one tiling whatever the batch (the decode tile, no split), so that a
    row's sums never depend on the rows beside it (vLLM's num_splits=1 in that mode).
    """
    group = n // k
    pages_per_tile = max(1, 64 // s)
    if batch_invariant:
        return max(16, pl.next_power_of_2(group)), pages_per_tile, 1
    block_m = max(16 if t <= 2 * r else 64, pl.next_power_of_2(group))
    tiles = pl.cdiv(t, block_m // group) + r
    splits = 1
    while splits < 16 and tiles * k * splits * 2 <= 256:
        splits *= 2
    return block_m, pages_per_tile, splits


def ragged_paged_attention_gpu(
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
    block_m: int | None = None,
    pages_per_tile: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    fp8_dtype=None,
    q_horizon: jax.Array | None = None,
    batch_invariant: bool = False,
    latent: bool = False,
    v_head_dim: int | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Attention of a flat ragged batch of queries over a paged KV cache (Pallas GPU).

    Arguments as `ragged_paged_attention`: q [T, N, H]; kv_cache [B, S, 2K, H], or the
    stacked [L, B, S, 2K, H] with ``layer``; kv_lens, query_start, query_lens [R] int32;
    block_tables [R, P] int32; num_seqs an int32 scalar or [1]. Tiling left as None follows
    `default_tiling`. Returns [T, N, H] in q's dtype, zero on rows no valid request owns. A
    float8 cache (``FP8_DTYPES``, or its bytes with ``fp8_dtype``) is read into q's dtype.
    ``q_horizon`` [T] int32 (optional): the last key position each query row sees when past
    its own (an image's span, seen both ways), as in `ragged_paged_attention_reference`.
    ``batch_invariant``: the tiling of `default_tiling`'s batch-invariant mode. ``latent``
    (MLA): kv_cache is the latent cache [L, B, S, H] (or [B, S, H]) whose first
    ``v_head_dim`` lanes are the values; the result is [T, N, v_head_dim]. ``sinks`` [N]
    float (optional, not with ``latent``): attention sinks, one logit per query head that
    joins its softmax's denominator as a key of value zero. ``chunk_size`` C (optional):
    chunked local attention, a query at position p sees keys from floor(p / C) * C.
    """
    metadata = (kv_lens, block_tables, query_start, query_lens, num_seqs)
    kv_cache, layer = stacked_and_checked(
        q, kv_cache, layer, metadata, fp8_dtype, latent, v_head_dim
    )
    validate_options(sm_scale, sliding_window, soft_cap, chunk_size=chunk_size)
    validate_q_horizon(q_horizon, q.shape[0])
    validate_sinks(sinks, q.shape[1], latent)
    t, n, h = q.shape
    s, hv = kv_cache.shape[2], v_head_dim or h
    k = 1 if latent else kv_cache.shape[3] // 2
    group = n // k
    r, p = block_tables.shape
    auto = default_tiling(t, r, n, k, s, batch_invariant)
    block_m = auto[0] if block_m is None else block_m
    pages_per_tile = auto[1] if pages_per_tile is None else pages_per_tile
    num_kv_splits = auto[2] if num_kv_splits is None else num_kv_splits
    reason = unsupported_shape(h, s, v_head_dim if latent else None)
    if reason:
        raise ValueError(reason)
    for name, value in (("block_m", block_m), ("pages_per_tile", pages_per_tile)):
        if not _pow2(value):
            raise ValueError(f"the GPU kernel needs a power-of-two {name}, got {value}")
    if block_m < max(16, group):
        raise ValueError(f"block_m={block_m} must be >= 16 and >= the query group G={group}")
    if pages_per_tile * s < 16:
        raise ValueError(f"pages_per_tile * block size must be >= 16, got {pages_per_tile * s}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(h)

    tokens_per_tile = block_m // group
    num_tiles = pl.cdiv(t, tokens_per_tile) + r
    tile_req, tile_tok = _tile_table(query_lens, num_seqs, tokens_per_tile, num_tiles)

    # [K, T*G, H] with block_m rows of padding, so every tile's window is in bounds.
    qg = jnp.swapaxes(q.reshape(t, k, group, h), 0, 1).reshape(k, t * group, h)
    rows = t * group + block_m
    qg = jnp.pad(qg, ((0, 0), (0, block_m), (0, 0)))
    split = num_kv_splits > 1
    horizon = q_horizon is not None
    out_dtype = jnp.float32 if split else q.dtype
    out_shape = [jax.ShapeDtypeStruct((num_kv_splits, k, rows, hv), out_dtype)]
    inits = [jnp.zeros((num_kv_splits, k, rows, hv), out_dtype)]
    if split:
        out_shape.append(jax.ShapeDtypeStruct((num_kv_splits, k, rows), jnp.float32))
        inits.append(jnp.full((num_kv_splits, k, rows), -jnp.inf, jnp.float32))

    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        attention_chunk=chunk_size,
        soft_cap=soft_cap,
        group=group,
        block_m=block_m,
        pages_per_seq=p,
        pages_per_tile=pages_per_tile,
        num_requests=r,
        split=split,
        fp8_dtype=fp8_dtype,
        horizon=horizon,
        latent=latent,
        sinks=sinks is not None,
    )
    inputs = [
        tile_req,
        tile_tok,
        kv_lens,
        block_tables.reshape(-1),
        query_start,
        query_lens,
        jnp.asarray(layer, jnp.int32).reshape(1),
        qg,
        kv_cache,
    ]
    if horizon:  # [T*G] as q's rows (row t * G + g: token t), padded like them
        inputs.append(jnp.pad(jnp.repeat(q_horizon, group), (0, block_m)))
    if sinks is not None:  # [K, block_m]: row m of kv head k is query head k * G + m % G
        rows_head = jnp.arange(block_m) % group
        inputs.append(sinks.astype(jnp.float32).reshape(k, group)[:, rows_head])
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles, k, num_kv_splits),
        input_output_aliases={len(inputs) + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*inputs, *inits)
    if split:
        o, lse = outs  # [splits, K, rows, Hv], [splits, K, rows]
        top = jnp.max(lse, axis=0)
        weight = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # [splits, K, rows]
        total = weight.sum(axis=0)
        out = (weight[..., None] * o).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    else:
        out = outs[0][0]
    out = out[:, : t * group].astype(q.dtype).reshape(k, t, group, hv)
    return jnp.swapaxes(out, 0, 1).reshape(t, n, hv)


def _tile_table(query_lens, num_seqs, tokens_per_tile, num_tiles):
    """For each of ``num_tiles`` query tiles: the request it belongs to (R when the batch
    needs fewer tiles) and the request's first token in it, both int32 [num_tiles]."""
    r = query_lens.shape[0]
    valid = jnp.arange(r) < jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0]
    per_req = jnp.where(valid, pl.cdiv(query_lens, tokens_per_tile), 0)
    ends = jnp.cumsum(per_req)  # [R]
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(ends, tiles, side="right").astype(jnp.int32)  # R past the end
    first_tile = (ends - per_req)[jnp.minimum(req, r - 1)]
    return req, ((tiles - first_tile) * tokens_per_tile).astype(jnp.int32)


def _kernel(
    tile_req_ref,  # [num_tiles]
    tile_tok_ref,  # [num_tiles]
    kv_lens_ref,  # [R]
    block_tables_ref,  # [R * P]
    query_start_ref,  # [R]
    query_lens_ref,  # [R]
    layer_ref,  # [1]
    q_ref,  # [K, rows, H]
    kv_ref,  # [L, B, S, 2K, H] (latent: [L, B, S, H])
    *refs,  # [hz_ref [rows]], [sinks_ref [K, M]], the output inits, their aliases: o_ref, lse
    sm_scale: float,
    sliding_window: int | None,
    attention_chunk: int | None,
    soft_cap: float | None,
    group: int,
    block_m: int,
    pages_per_seq: int,
    pages_per_tile: int,
    num_requests: int,
    split: bool,
    fp8_dtype,
    horizon: bool,
    latent: bool,
    sinks: bool,
):
    if horizon:
        hz_ref, *refs = refs
    if sinks:
        sinks_ref, *refs = refs
    if split:
        _o_init, _lse_init, o_ref, lse_ref = refs  # lse_ref [splits, K, rows]
    else:
        _o_init, o_ref = refs
    tile, kh, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_blocks = kv_ref.shape[1]
    num_parts = pl.num_programs(2)
    h, hv = q_ref.shape[2], o_ref.shape[3]
    # The lanes of q and the keys loaded apart, (first, count) each: a latent's value lanes
    # and its rotary rest, or the whole head.
    parts = ((0, hv), (hv, h - hv)) if latent else ((0, h),)
    s = kv_ref.shape[2]
    tile_kv = pages_per_tile * s
    req = tile_req_ref[tile]

    @pl.when(req < num_requests)
    def _tile():
        tok0 = tile_tok_ref[tile]  # the request's first token in this tile
        q_len = query_lens_ref[req]
        kv_len = kv_lens_ref[req]
        row0 = (query_start_ref[req] + tok0) * group
        n_tok = jnp.minimum(block_m // group, q_len - tok0)
        m = jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
        row_ok = m < n_tok * group  # [M]
        q_pos = kv_len - q_len + tok0 + m // group  # [M]
        last_pos = kv_len - q_len + tok0 + n_tok - 1
        sees_to = q_pos  # [M]: each row's last key position
        if horizon:
            lowest = jnp.iinfo(jnp.int32).min
            hz = plgpu.load(hz_ref.at[pl.ds(row0, block_m)], mask=row_ok, other=lowest)  # [M]
            sees_to = jnp.maximum(q_pos, hz)
            last_pos = jnp.maximum(last_pos, jnp.minimum(jnp.max(hz), kv_len - 1))
        first_pos = 0
        if sliding_window is not None:
            first_pos = jnp.maximum(kv_len - q_len + tok0 - sliding_window + 1, 0)
        if attention_chunk is not None:  # the tile's first token's chunk
            chunk0 = (kv_len - q_len + tok0) // attention_chunk * attention_chunk
            first_pos = jnp.maximum(first_pos, chunk0)

        tile_lo = first_pos // tile_kv
        tile_hi = last_pos // tile_kv + 1
        per_part = pl.cdiv(tile_hi - tile_lo, num_parts)
        lo = tile_lo + part * per_part
        hi = jnp.minimum(lo + per_part, tile_hi)

        qs = [
            plgpu.load(
                q_ref.at[kh, pl.ds(row0, block_m), pl.ds(a, w)], mask=row_ok[:, None], other=0.0
            )
            for a, w in parts
        ]  # [M, w] each
        fp8 = is_fp8_cache(kv_ref.dtype, fp8_dtype)
        kv_dtype = q_ref.dtype if fp8 else kv_ref.dtype
        precision = jax.lax.Precision.HIGHEST if kv_dtype == jnp.float32 else None

        def body(c, carry):
            acc, m_i, l_i = carry
            page_idx = c * pages_per_tile + jax.lax.broadcasted_iota(
                jnp.int32, (pages_per_tile,), 0
            )
            page_ok = page_idx * s <= last_pos
            pages = plgpu.load(
                block_tables_ref.at[
                    pl.ds(req * pages_per_seq + c * pages_per_tile, pages_per_tile)
                ],
                mask=page_ok,
                other=0,
            )
            # Pages past the context read block 0; ids are clipped so no table entry can
            # point the gather outside the cache.
            pages = jnp.clip(jnp.where(page_ok, pages, 0), 0, num_blocks - 1)
            # Each of the tile's positions as (page, slot), gathered with one index per
            # element: [TK, 1] pages and slots against [1, H] lanes.
            tok_page = jnp.broadcast_to(pages[:, None], (pages_per_tile, s)).reshape(tile_kv)
            tok_slot = jax.lax.broadcasted_iota(jnp.int32, (tile_kv,), 0) % s
            at = (layer_ref[0], tok_page[:, None], tok_slot[:, None])

            def lanes(a, w):  # [1, w]: lanes a .. a + w - 1
                return a + jax.lax.broadcasted_iota(jnp.int32, (1, w), 1)

            head = () if latent else (2 * kh,)
            keys = [plgpu.load(kv_ref.at[(*at, *head, lanes(a, w))]) for a, w in parts]
            if fp8:  # a float8 cache's pages in the queries' dtype (scale 1)
                keys = [from_cache(x, q_ref.dtype, fp8_dtype) for x in keys]
            if latent:  # the value is the latent's first Hv lanes: the first part
                values = keys[0]  # [TK, Hv]
            else:
                values = plgpu.load(kv_ref.at[(*at, 2 * kh + 1, lanes(0, h))])  # [TK, H]
                if fp8:
                    values = from_cache(values, q_ref.dtype, fp8_dtype)
            kv_pos = c * tile_kv + jax.lax.broadcasted_iota(jnp.int32, (tile_kv,), 0)
            seen = (kv_pos >= first_pos) & (kv_pos <= last_pos)  # [TK]
            values = jnp.where(seen[:, None], values, jnp.zeros_like(values))

            scores = sum(
                jax.lax.dot_general(
                    q.astype(key.dtype),
                    key,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                for q, key in zip(qs, keys, strict=True)
            )  # [M, TK]
            scores = scores * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            mask = seen[None, :] & (kv_pos[None, :] <= sees_to[:, None])
            if sliding_window is not None:
                mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            if attention_chunk is not None:
                mask &= kv_pos[None, :] >= q_pos[:, None] // attention_chunk * attention_chunk
            scores = jnp.where(mask, scores, -jnp.inf)
            m_new = jnp.maximum(m_i, scores.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            probs = jnp.exp(scores - m_safe[:, None])
            alpha = jnp.exp(m_i - m_safe)
            l_new = alpha * l_i + probs.sum(axis=1)
            pv = jax.lax.dot_general(
                probs.astype(values.dtype),
                values,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )  # [M, Hv]
            return alpha[:, None] * acc + pv, m_new, l_new

        init = (
            jnp.zeros((block_m, hv), jnp.float32),
            jnp.full((block_m,), -jnp.inf, jnp.float32),
            jnp.zeros((block_m,), jnp.float32),
        )
        if sinks:  # as if each row had seen its sink's key (value zero); in one part only
            sink = plgpu.load(sinks_ref.at[kh, pl.ds(0, block_m)])  # [M]
            first = part == 0
            init = (
                init[0],
                jnp.where(first, sink, init[1]),
                jnp.where(first, jnp.ones_like(init[2]), init[2]),
            )
        acc, m_i, l_i = jax.lax.fori_loop(lo, hi, body, init)
        out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
        plgpu.store(
            o_ref.at[part, kh, pl.ds(row0, block_m), :],
            out.astype(o_ref.dtype),
            mask=row_ok[:, None],
        )
        if split:
            lse = jnp.where(l_i == 0.0, -jnp.inf, m_i + jnp.log(jnp.where(l_i == 0.0, 1.0, l_i)))
            plgpu.store(lse_ref.at[part, kh, pl.ds(row0, block_m)], lse, mask=row_ok)

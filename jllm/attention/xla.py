"""The XLA attention backend: paged attention in plain JAX ops, for any platform.

Decode rows are tiles of one query; prefill chunks are tiles of C queries that each belong to
one request. Each tile gathers its request's pages in chunks with a dynamic trip count, so no
bucket depends on sequence length, and folds them in with an online softmax. Rows are sorted
longest first (decode rows by context length, prefill tiles by causal horizon) and split into
bands with a trip count each, so a short context does not loop to the longest one in the
batch. With a sliding window (`FlatBatch.window`) a band's loop also starts late, at the
first chunk any of its rows sees, so the chunks before it are never gathered; and the values
of keys no query of a tile sees are zeroed, so the pages a band still gathers before a row's
window (freed, perhaps reused by another request, or the null block) never reach the result.
Chunked local attention (`FlatBatch.chunk_size`) starts the loops and zeroes the values
likewise, at the start of each row's chunk.

It implements every attention option (`AttentionOptions`): attention sinks start each query
head's online softmax as if it had already seen one key of score sinks[h] and value zero
(running max sinks[h], denominator 1). The paged cache [L, B, S, 2K, H] holds keys and values
of one head size H, so a layer whose values are narrower (`v_head_dim`, MLA expanded to heads:
keys 192, values 128) stores them padded with zeros to H, the key head size, and the tiles
read only their first v_head_dim lanes; the cache of a layer whose values are wider holds
H = v_head_dim, and its queries and keys are padded with zeros (scores unchanged).

A latent layer (MLA's absorbed form, `options.latent`) has the cache [L, B, S, H] of one
latent per token: its tiles gather each page once, as the key of one KV head that every query
head shares (K = 1, G = N) and, in its first v_head_dim lanes, as the value. Every other
option crosses with it unchanged (the masks do not see the layout). As for every layout, the
step's `FlatBatch.kv_token_bytes` must be the cache's bytes per token and layer (a latent
cache's H * itemsize): `build_xla` reckons the bands' chunks from it and the tiles their
chunk size from the cache, and the two must agree.

It is the CPU's fallback (`cpu_kernel` is the default there) and what a platform without a
kernel for a layer's options runs.

Glossary: T tokens, R requests, N query heads, K kv heads, G = N / K, H head dim, B blocks,
S block size, P pages per request, Tt tiles, C tile size, L keys in a chunk.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jllm.attention.base import (
    AttentionBackend,
    latent_inputs,
    write_step_kv,
    write_step_latent,
)
from jllm.attention.metadata import FlatBatch
from jllm.attention.options import OPTION_NAMES, AttentionOptions
from pallas_kernels.ragged_paged_attention import from_cache

# Prefill rows start on, and fill, tiles of this many queries (the backend's `prefill_tile`):
# each tile is one request's, so a tile attends as one block of queries.
TILE = 16

# The XLA path gathers the KV cache in chunks small enough to stay near the CPU's caches: the
# chunk shrinks as the rows grow. Measured on the 2-core CPU with SmolLM2 (per layer, 64
# decode rows: 18.5 ms with 256-token chunks, 4-5 ms with 32-64; W1 decode with bands ran
# best at 8 MB per iteration). Prefill tiles reuse each gathered token for all their
# queries; since they are sorted by causal horizon, smaller chunks waste fewer masked keys:
# 2048-token prefill steps of 16 x 128-token prompts took 2.8 s at 16 MB, 2.4 s at 8 MB,
# 2.2 s at 4 MB and 2.6 s at 1 MB (4 x 512: 3.1, 2.9, 2.9, 4.0 s).
MAX_KV_CHUNK_TOKENS = 256
DECODE_KV_CHUNK_BYTES = 8 << 20
PREFILL_KV_CHUNK_BYTES = 4 << 20


# Every row of a loop runs to the longest context among them, so a short context beside a long
# one wastes its gathers. The host sorts the rows (decode rows by context length, prefill
# tiles by causal horizon: the position of their last query), longest first, and the rows
# are split into bands of at least MIN_KV_BAND_ROWS rows, at most MAX_KV_BANDS of them, each
# with its own trip count. In a chat-like load (inputs 16-512, outputs 4-256 tokens) on the
# 2-core CPU, decode steps of 128 rows went from 0.93 s to 0.58 s and the load ran 1.4x
# faster. More bands cost compile time (a loop each, in every layer).
MAX_KV_BANDS = 4
MIN_KV_BAND_ROWS = 8


def kv_bands(rows: int) -> int:
    """Bands for `rows` rows: a power of two that divides them."""
    bands = MAX_KV_BANDS
    while bands > 1 and (rows % bands or rows // bands < MIN_KV_BAND_ROWS):
        bands //= 2
    return bands


def max_kv_chunk_pages(block_size: int) -> int:
    """Block tables are padded to a multiple of this (every chunk size divides it)."""
    return max(1, MAX_KV_CHUNK_TOKENS // block_size)


def kv_chunk_pages(block_size: int, rows: int, kv_token_bytes: int, queries_per_row: int) -> int:
    """Pages per loop iteration when `rows` rows of `queries_per_row` queries each gather
    their own KV."""
    budget = DECODE_KV_CHUNK_BYTES if queries_per_row == 1 else PREFILL_KV_CHUNK_BYTES
    tokens = min(MAX_KV_CHUNK_TOKENS, budget // max(1, rows * kv_token_bytes))
    pages = max(1, tokens // block_size)
    return 1 << (pages.bit_length() - 1)  # a power of two, so it divides the table width


def band_chunks(
    kv_ends: np.ndarray, kv_starts: np.ndarray, block_size: int, kv_token_bytes: int, queries: int
) -> tuple[np.ndarray, np.ndarray]:
    """The KV chunks each band of rows (sorted longest first) loops over, from the keys each
    row needs (`kv_starts` .. `kv_ends` - 1, [rows]): ([bands] first chunk, [bands] end).
    A row that needs no keys (padding) does not move its band's first chunk."""
    bands = kv_bands(len(kv_ends))
    rows = len(kv_ends) // bands
    chunk = kv_chunk_pages(block_size, rows, kv_token_bytes, queries) * block_size
    if not len(kv_ends):
        return np.zeros(1, np.int32), np.zeros(1, np.int32)
    ends = kv_ends.reshape(bands, rows).astype(np.int64)
    end = -(-ends.max(axis=1) // chunk)
    starts = kv_starts.reshape(bands, rows).astype(np.int64)
    starts = np.where(ends > 0, starts, np.iinfo(np.int64).max)
    first = np.minimum(starts.min(axis=1) // chunk, end)
    return first.astype(np.int32), end.astype(np.int32)


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "slot_mapping",
        "decode_block_table",
        "decode_kv_lens",
        "tile_block_table",
        "tile_kv_lens",
        "tile_q_pos",
        "tile_order",
        "tile_inverse",
        "decode_chunks",
        "tile_chunks",
        "decode_first",
        "tile_first",
        "tile_q_horizon",
    ],
    meta_fields=["kv_fp8"],
)
@dataclasses.dataclass
class XlaMetadata:
    slot_mapping: jax.Array  # [T]
    decode_block_table: jax.Array  # [Rd, P]
    decode_kv_lens: jax.Array  # [Rd] context length including the new token; 0 for padding
    # The tile_* arrays are sorted by causal horizon (longest first) for the bands:
    tile_block_table: jax.Array  # [Tt, P] the block table of each tile's request
    tile_kv_lens: jax.Array  # [Tt]
    tile_q_pos: jax.Array  # [Tt, C]
    tile_order: jax.Array  # [Tt] the flat batch's tile at each sorted position
    tile_inverse: jax.Array  # [Tt] the sorted position of each of the flat batch's tiles
    decode_chunks: jax.Array  # [kv_bands(Rd)] KV chunks each band of decode rows needs
    tile_chunks: jax.Array  # [kv_bands(Tt)] KV chunks each band of prefill tiles needs
    # The first chunk each band needs: the earliest key in its rows' sliding windows or local
    # chunks (0 without)
    decode_first: jax.Array  # [kv_bands(Rd)]
    tile_first: jax.Array  # [kv_bands(Tt)]
    kv_fp8: str | None = None  # the float8 format whose bytes (uint8) the cache holds
    # [Tt, C] the last key each query sees (FlatBatch.q_horizon), None: causal (q_pos)
    tile_q_horizon: jax.Array | None = None


def build_xla(b: FlatBatch) -> XlaMetadata:
    Rd = b.num_decode_rows
    Tt, C = b.tile_q_pos.shape
    S, kv_bytes = b.block_size, b.kv_token_bytes
    dec_kv = b.kv_lens[:Rd]
    # A prefill tile needs the keys up to its last query (causal), not its request's whole
    # context; the bands take tiles in that order, longest first.
    horizon = None
    if b.q_horizon is not None:  # rows of several tokens follow the Rd decode rows in tiles
        horizon = b.q_horizon[Rd:].reshape(Tt, C)
        horizon = np.where(b.tile_q_pos >= 0, np.maximum(horizon, b.tile_q_pos), -1)
    tile_need = (b.tile_q_pos if horizon is None else horizon).max(axis=1, initial=-1) + 1
    order = np.argsort(-tile_need, kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(Tt, dtype=np.int32)
    rows = b.tile_row[order]
    # A window or a local chunk starts each row's keys at the first its first query sees (a
    # decode row's query sits at kv_len - 1); padding rows need no keys, whatever their start.
    dec_q = dec_kv.astype(np.int64) - 1
    first_q = np.where(b.tile_q_pos >= 0, b.tile_q_pos, np.iinfo(np.int32).max).min(axis=1)
    first_q = first_q.astype(np.int64)
    dec_start, tile_start = np.zeros(Rd, np.int64), np.zeros(Tt, np.int64)
    if b.window is not None:
        dec_start = np.maximum(dec_q - b.window + 1, dec_start)
        tile_start = np.maximum(first_q - b.window + 1, tile_start)
    if b.chunk_size is not None:
        dec_start = np.maximum(dec_q // b.chunk_size * b.chunk_size, dec_start)
        tile_start = np.maximum(first_q // b.chunk_size * b.chunk_size, tile_start)
    decode_first, decode_chunks = band_chunks(dec_kv, dec_start, S, kv_bytes, 1)
    tile_first, tile_chunks = band_chunks(tile_need[order], tile_start[order], S, kv_bytes, C)
    return XlaMetadata(
        slot_mapping=b.slot_mapping,
        decode_block_table=b.block_tables[:Rd],
        decode_kv_lens=dec_kv,
        tile_block_table=b.block_tables[rows],
        tile_kv_lens=b.kv_lens[rows],
        tile_q_pos=b.tile_q_pos[order],
        tile_order=order,
        tile_inverse=inverse,
        decode_chunks=decode_chunks,
        tile_chunks=tile_chunks,
        decode_first=decode_first,
        tile_first=tile_first,
        kv_fp8=b.kv_fp8,
        tile_q_horizon=None if horizon is None else horizon[order].astype(np.int32),
    )


def tile_attention(
    q,
    kv_cache,
    layer,
    block_table,
    kv_lens,
    q_pos,
    num_chunks,
    sm_scale,
    fp8_dtype=None,
    window: int | None = None,
    soft_cap: float | None = None,
    first_chunk=0,
    q_horizon=None,
    chunk_size: int | None = None,
    sinks=None,
    v_head_dim: int | None = None,
    latent: bool = False,
):
    """Attention for tiles of C queries that each belong to one request.

    q [Tt, C, N, H], block_table [Tt, P], kv_lens [Tt], q_pos [Tt, C] -> [Tt, C, N, Hv]
    (Hv = v_head_dim, the first lanes of the cache's values; H without). With `latent` the
    cache is [L, B, S, H], one vector per token: the key of one KV head, and its first Hv
    lanes the value.
    Scores are q . k * sm_scale, then soft_cap * tanh(score / soft_cap) when soft_cap is set;
    a query at position p sees keys at positions (p - window, p] when window is set, and at
    [floor(p / chunk_size) * chunk_size, p] when chunk_size is set, up to its `q_horizon`
    [Tt, C] instead of p when given (an image token in a model whose image tokens attend to
    each other in both directions). `sinks` [N]: each query head's sink logit, one more term
    exp(sinks[h] - m) in its softmax denominator. The loop
    gathers chunks first_chunk .. num_chunks - 1 of L keys: with a window or chunked local
    attention, `build_xla` starts it at the first chunk any tile sees. The pages it gathers
    before a tile's window or local chunk (or past its context) may hold anything, NaN
    included: their keys score -inf and, with a window or chunk_size, their values are
    zeroed, since 0 * NaN would be NaN.
    """
    Tt, C, N, H = q.shape
    S = kv_cache.shape[2]
    K = 1 if latent else kv_cache.shape[3] // 2
    G = N // K
    Hv = v_head_dim or H
    token_bytes = math.prod(kv_cache.shape[3:]) * kv_cache.dtype.itemsize
    pages = kv_chunk_pages(S, Tt, token_bytes, C)
    L = pages * S
    qg = (q.astype(jnp.float32) * sm_scale).reshape(Tt, C, K, G, H)
    local = window is not None or chunk_size is not None

    def body(c, carry):
        m, denom, acc = carry  # [Tt, K, G, C], [Tt, K, G, C], [Tt, K, G, C, Hv]
        page_ids = jax.lax.dynamic_slice_in_dim(block_table, c * pages, pages, axis=1)
        kv = from_cache(kv_cache[layer, page_ids], jnp.float32, fp8_dtype)
        if latent:  # one vector per token: the key, and the value in its first lanes
            k = kv.reshape(Tt, L, 1, H)
            v = k[..., :Hv]
        else:
            kv = kv.reshape(Tt, L, K, 2, H)
            k, v = kv[:, :, :, 0], kv[:, :, :, 1, :Hv]  # [Tt, L, K, H], [Tt, L, K, Hv]
        s = jnp.einsum("TCKGH,TLKH->TKGCL", qg, k)  # [Tt, K, G, C, L]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = c * L + jnp.arange(L)  # [L]
        last = q_pos if q_horizon is None else q_horizon
        mask = (k_pos[None, None, :] <= last[:, :, None]) & (
            k_pos[None, None, :] < kv_lens[:, None, None]
        )  # [Tt, C, L]
        if window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
        if chunk_size is not None:
            mask &= k_pos[None, None, :] >= (q_pos[:, :, None] // chunk_size) * chunk_size
        if local:
            v = jnp.where(mask.any(axis=1)[:, :, None, None], v, 0.0)
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # [Tt, K, G, C, L]
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("TKGCL,TLKH->TKGCH", p, v)
        return m_new, denom, acc

    if sinks is None:  # no key seen yet
        m0, denom0 = jnp.full((Tt, K, G, C), -jnp.inf, jnp.float32), 0.0
    else:  # the sink seen first: a key of score sinks[h] and value zero
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(K, G, 1), (Tt, K, G, C))
        denom0 = 1.0
    init = (
        m0,
        jnp.full((Tt, K, G, C), denom0, jnp.float32),
        jnp.zeros((Tt, K, G, C, Hv), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first_chunk, num_chunks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [Tt, K, G, C, Hv]
    return out.transpose(0, 3, 1, 2, 4).reshape(Tt, C, N, Hv).astype(q.dtype)


def banded_attention(
    q,
    kv_cache,
    layer,
    block_table,
    kv_lens,
    q_pos,
    first_chunks,
    end_chunks,
    q_horizon=None,
    **options,
):
    """`tile_attention` over consecutive bands of rows, each looping over its own chunks
    (`first_chunks` .. `end_chunks` - 1, [bands]); `options`: tile_attention's sm_scale,
    fp8_dtype, window, soft_cap, chunk_size, sinks, v_head_dim and latent."""
    bands = end_chunks.shape[0]
    rows = q.shape[0] // bands

    def band(a, b):
        return None if a is None else a[b * rows : (b + 1) * rows]

    outs = [
        tile_attention(
            q[b * rows : (b + 1) * rows],
            kv_cache,
            layer,
            block_table[b * rows : (b + 1) * rows],
            kv_lens[b * rows : (b + 1) * rows],
            q_pos[b * rows : (b + 1) * rows],
            end_chunks[b],
            first_chunk=first_chunks[b],
            q_horizon=band(q_horizon, b),
            **options,
        )
        for b in range(bands)
    ]
    return outs[0] if bands == 1 else jnp.concatenate(outs, axis=0)


@dataclasses.dataclass(frozen=True)
class XlaBackend(AttentionBackend):
    name: str = "xla"
    supported = frozenset(OPTION_NAMES)
    prefill_tile = TILE

    def build_metadata(self, flat: FlatBatch) -> XlaMetadata:
        return build_xla(flat)

    def attend(self, q, k, v, kv_cache, layer, md, options: AttentionOptions, sinks=None):
        self.check(options)
        _, N, H = q.shape
        Hv = options.v_head_dim or H
        options.check_sinks(sinks, N)
        if options.latent:
            latent = latent_inputs(q, k, v, kv_cache, options)
            kv_cache, fp8 = write_step_latent(kv_cache, layer, latent, md)
            Hc = H
        else:
            if v.shape[-1] != Hv:
                raise ValueError(f"v has head size {v.shape[-1]}, the layer's options say {Hv}")
            Hc = kv_cache.shape[-1]  # keys and values share the cache's head axis
            if Hc != max(H, Hv):
                raise ValueError(
                    f"the KV cache's head size is {Hc}; keys of {H} and values of {Hv} need "
                    f"{max(H, Hv)}"
                )
            q, k, v = (_pad_lanes(x, Hc) for x in (q, k, v))
            kv_cache, fp8 = write_step_kv(kv_cache, layer, k, v, md)
        kw = dict(
            latent=options.latent,
            sm_scale=options.scale,
            window=options.window,
            soft_cap=options.soft_cap,
            chunk_size=options.chunk_size,
            sinks=sinks,
            v_head_dim=Hv,
            fp8_dtype=fp8,
        )
        Rd = md.decode_kv_lens.shape[0]
        Tt, C = md.tile_q_pos.shape
        parts = []
        if Rd:
            dec = banded_attention(
                q[:Rd, None],
                kv_cache,
                layer,
                md.decode_block_table,
                md.decode_kv_lens,
                (md.decode_kv_lens - 1)[:, None],
                md.decode_first,
                md.decode_chunks,
                **kw,
            )
            parts.append(dec.reshape(Rd, N, Hv))
        if Tt:
            pre = banded_attention(
                q[Rd:].reshape(Tt, C, N, Hc)[md.tile_order],
                kv_cache,
                layer,
                md.tile_block_table,
                md.tile_kv_lens,
                md.tile_q_pos,
                md.tile_first,
                md.tile_chunks,
                q_horizon=md.tile_q_horizon,
                **kw,
            )
            parts.append(pre[md.tile_inverse].reshape(Tt * C, N, Hv))
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        return out, kv_cache


def _pad_lanes(x, width: int):
    """x [..., h] padded with zeros to [..., width]."""
    pad = width - x.shape[-1]
    return x if not pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])

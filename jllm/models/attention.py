"""Paged attention over the flat batch, with two backends.

The flat batch puts the decode tokens first (one per request, rows 0..Rd-1), then the prefill
chunks, each request's run starting on a multiple of the tile size C so that the prefill
segment reshapes to tiles [Tt, C] that each belong to one request.

- `xla`: the CPU path. Decodes are tiles of size 1. Each tile gathers its request's pages in
  chunks with a dynamic trip count (the longest context in the batch), so no bucket depends
  on sequence length, and folds them in with an online softmax.
- `cpu_kernel`: the CPU default, the C++ flavour of the ragged paged attention kit
  (`pallas_kernels/ragged_paged_attention/cpu.py`), reading the stacked cache in place.
- `pallas` / `pallas_interpret`: the ragged paged attention kernel from `pallas_kernels/`
  over the same flat batch, described by query_start / query_lens / kv_lens / block_tables.

Both write the new K/V into the cache first (padding tokens write to an out-of-range slot
that is dropped), so every query sees its own chunk and any block shared in the same step.

Glossary: T tokens, R requests, N query heads, K kv heads, G = N / K, H head dim, B blocks,
S block size, P pages per request, Tt tiles, C tile size, L keys in a chunk.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_cpu_sharded,
    ragged_paged_attention_sharded,
)
from sharding import MODEL_AXIS

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
        "query_start",
        "query_lens",
        "kv_lens",
        "block_tables",
        "num_seqs",
    ],
    meta_fields=["tile_size"],
)
@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: jax.Array  # [T] flat cache slot of each token; B*S for padding
    decode_block_table: jax.Array  # [Rd, P]
    decode_kv_lens: jax.Array  # [Rd] context length including the new token; 0 for padding
    tile_block_table: jax.Array  # [Tt, P] the block table of each tile's request
    tile_kv_lens: jax.Array  # [Tt]
    tile_q_pos: jax.Array  # [Tt, C] absolute position of each query; -1 for padding
    # The tile_* arrays above are sorted by causal horizon (longest first) for the bands:
    tile_order: jax.Array  # [Tt] the flat batch's tile at each sorted position
    tile_inverse: jax.Array  # [Tt] the sorted position of each of the flat batch's tiles
    decode_chunks: jax.Array  # [kv_bands(Rd)] KV chunks each band of decode rows needs
    tile_chunks: jax.Array  # [kv_bands(Tt)] KV chunks each band of prefill tiles needs
    # The same batch as the ragged kernel sees it: decode requests then prefill requests.
    query_start: jax.Array  # [R]
    query_lens: jax.Array  # [R]
    kv_lens: jax.Array  # [R]
    block_tables: jax.Array  # [R, P]
    num_seqs: jax.Array  # [1]
    tile_size: int


def write_kv(kv_cache, layer, k, v, slot_mapping):
    """Scatter new K/V [T, K, H] into layer `layer` of the cache [L, B, S, 2K, H], K and V
    interleaved. Indexing the stacked cache directly keeps the update in place."""
    NL, B, S, K2, H = kv_cache.shape
    T, K, _ = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(T, K2, H).astype(kv_cache.dtype)
    flat = kv_cache.reshape(NL, B * S, K2, H).at[layer, slot_mapping].set(kv, mode="drop")
    return flat.reshape(NL, B, S, K2, H)


def tile_attention(q, kv_cache, layer, block_table, kv_lens, q_pos, num_chunks, sm_scale):
    """Attention for tiles of C queries that each belong to one request.

    q [Tt, C, N, H], block_table [Tt, P], kv_lens [Tt], q_pos [Tt, C] -> [Tt, C, N, H].
    """
    Tt, C, N, H = q.shape
    _, B, S, K2, _ = kv_cache.shape
    K = K2 // 2
    G = N // K
    pages = kv_chunk_pages(S, Tt, K2 * H * kv_cache.dtype.itemsize, C)
    L = pages * S
    qg = (q.astype(jnp.float32) * sm_scale).reshape(Tt, C, K, G, H)

    def body(c, carry):
        m, denom, acc = carry  # [Tt, K, G, C], [Tt, K, G, C], [Tt, K, G, C, H]
        page_ids = jax.lax.dynamic_slice_in_dim(block_table, c * pages, pages, axis=1)
        kv = kv_cache[layer, page_ids].reshape(Tt, L, K, 2, H).astype(jnp.float32)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]  # [Tt, L, K, H]
        s = jnp.einsum("TCKGH,TLKH->TKGCL", qg, k)  # [Tt, K, G, C, L]
        k_pos = c * L + jnp.arange(L)  # [L]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < kv_lens[:, None, None]
        )  # [Tt, C, L]
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # [Tt, K, G, C, L]
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("TKGCL,TLKH->TKGCH", p, v)
        return m_new, denom, acc

    init = (
        jnp.full((Tt, K, G, C), -jnp.inf, jnp.float32),
        jnp.zeros((Tt, K, G, C), jnp.float32),
        jnp.zeros((Tt, K, G, C, H), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [Tt, K, G, C, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(Tt, C, N, H).astype(q.dtype)


def banded_attention(q, kv_cache, layer, block_table, kv_lens, q_pos, band_chunks, sm_scale):
    """`tile_attention` over consecutive bands of rows, each looping over its own chunks."""
    bands = band_chunks.shape[0]
    rows = q.shape[0] // bands
    outs = [
        tile_attention(
            q[b * rows : (b + 1) * rows],
            kv_cache,
            layer,
            block_table[b * rows : (b + 1) * rows],
            kv_lens[b * rows : (b + 1) * rows],
            q_pos[b * rows : (b + 1) * rows],
            band_chunks[b],
            sm_scale,
        )
        for b in range(bands)
    ]
    return outs[0] if bands == 1 else jnp.concatenate(outs, axis=0)


def paged_attention(q, k, v, kv_cache, layer, md: AttentionMetadata, backend: str):
    """q [T, N, H], k/v [T, K, H] -> (out [T, N, H], updated kv_cache [L, B, S, 2K, H])."""
    kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
    T, N, H = q.shape
    sm_scale = H**-0.5
    mesh = jax.sharding.get_abstract_mesh()
    sharded = not mesh.empty and mesh.shape.get(MODEL_AXIS, 1) > 1
    if backend == "cpu_kernel":
        args = (md.kv_lens, md.block_tables, md.query_start, md.query_lens, md.num_seqs)
        q = q.astype(kv_cache.dtype)
        if sharded:
            out = ragged_paged_attention_cpu_sharded(
                mesh, MODEL_AXIS, q, kv_cache, layer, *args, sm_scale=sm_scale
            )
        else:
            out = ragged_paged_attention_cpu(q, kv_cache, *args, layer=layer, sm_scale=sm_scale)
        return out, kv_cache
    if backend != "xla":
        # The whole stacked cache and the layer: the kernel reads the layer's pages in place
        # (`kv_cache[layer]` here would copy the layer per layer per step).
        args = (
            q,
            kv_cache,
            md.kv_lens,
            md.block_tables,
            md.query_start,
            md.query_lens,
            md.num_seqs,
        )
        options = dict(layer=layer, sm_scale=sm_scale, interpret=backend == "pallas_interpret")
        # Under tensor parallelism (the runner traces inside `jax.set_mesh`), each device
        # runs the kernel on its own heads.
        if sharded:
            out = ragged_paged_attention_sharded(mesh, MODEL_AXIS, *args, **options)
        else:
            out = ragged_paged_attention(*args, **options)
        return out, kv_cache
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
            md.decode_chunks,
            sm_scale,
        )
        parts.append(dec.reshape(Rd, N, H))
    if Tt:
        pre = banded_attention(
            q[Rd:].reshape(Tt, C, N, H)[md.tile_order],
            kv_cache,
            layer,
            md.tile_block_table,
            md.tile_kv_lens,
            md.tile_q_pos,
            md.tile_chunks,
            sm_scale,
        )
        parts.append(pre[md.tile_inverse].reshape(Tt * C, N, H))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    return out, kv_cache

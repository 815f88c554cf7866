"""Paged attention over the flat batch, with two backends.

The flat batch puts the decode tokens first (one query per row, rows 0..Rd-1; a verification
row's tokens are consecutive decode rows when they fit), then the rows of several tokens
(prefill chunks, and verification rows past the decode rows), each request's run starting
on a multiple of the tile size C so that this segment reshapes to tiles [Tt, C] that each
belong to one request. Each backend reads its own metadata
(`models/attention_metadata.py`).

- `xla`: the CPU path. Decodes are tiles of size 1. Each tile gathers its request's pages in
  chunks with a dynamic trip count (the longest context in the batch), so no bucket depends
  on sequence length, and folds them in with an online softmax.
- `cpu_kernel`: the CPU default, the C++ flavour of the ragged paged attention kit
  (`pallas_kernels/ragged_paged_attention/cpu.py`), reading the stacked cache in place.
- `pallas` / `pallas_interpret`: the ragged paged attention kernel from `pallas_kernels/`
  over the same flat batch, described by query_start / query_lens / kv_lens / block_tables.
- `pallas_gpu` / `pallas_gpu_interpret`: the kit's GPU flavour (Pallas on Triton), the same
  contract and metadata.

Both write the new K/V into the cache first (padding tokens write to an out-of-range slot
that is dropped), so every query sees its own chunk and any block shared in the same step.
A float8 cache (`kv_cache_dtype="fp8"`) takes them converted with saturation, and every
backend reads its pages into the compute dtype; on the CPU it holds the float8 bytes as uint8
(`md.kv_fp8` names the format: XLA's CPU backend updates float8 arrays element by element).

Glossary: T tokens, R requests, N query heads, K kv heads, G = N / K, H head dim, B blocks,
S block size, P pages per request, Tt tiles, C tile size, L keys in a chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jllm.models.attention_metadata import RaggedMetadata, XlaMetadata, kv_chunk_pages
from pallas_kernels.ragged_paged_attention import (
    from_cache,
    is_fp8_cache,
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_cpu_sharded,
    ragged_paged_attention_gpu,
    ragged_paged_attention_sharded,
    to_cache,
)
from sharding import MODEL_AXIS


def write_kv(kv_cache, layer, k, v, slot_mapping, fp8_dtype=None):
    """Scatter new K/V [T, K, H] into layer `layer` of the cache [L, B, S, 2K, H], K and V
    interleaved. Indexing the stacked cache directly keeps the update in place."""
    NL, B, S, K2, H = kv_cache.shape
    T, K, _ = k.shape
    kv = to_cache(jnp.stack([k, v], axis=2).reshape(T, K2, H), kv_cache.dtype, fp8_dtype)
    flat = kv_cache.reshape(NL, B * S, K2, H).at[layer, slot_mapping].set(kv, mode="drop")
    return flat.reshape(NL, B, S, K2, H)


def tile_attention(
    q, kv_cache, layer, block_table, kv_lens, q_pos, num_chunks, sm_scale, fp8_dtype=None
):
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
        kv = from_cache(kv_cache[layer, page_ids], jnp.float32, fp8_dtype)
        kv = kv.reshape(Tt, L, K, 2, H)
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


def banded_attention(
    q, kv_cache, layer, block_table, kv_lens, q_pos, band_chunks, sm_scale, fp8_dtype=None
):
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
            fp8_dtype,
        )
        for b in range(bands)
    ]
    return outs[0] if bands == 1 else jnp.concatenate(outs, axis=0)


def paged_attention(q, k, v, kv_cache, layer, md, backend: str):
    """q [T, N, H], k/v [T, K, H] -> (out [T, N, H], updated kv_cache [L, B, S, 2K, H]).
    `md` is the backend's metadata: `RaggedMetadata` or `XlaMetadata`."""
    fp8 = None if md.kv_fp8 is None else jnp.dtype(md.kv_fp8)  # a cache of float8 bytes
    kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping, fp8)
    T, N, H = q.shape
    sm_scale = H**-0.5
    mesh = jax.sharding.get_abstract_mesh()
    sharded = not mesh.empty and mesh.shape.get(MODEL_AXIS, 1) > 1
    if backend == "cpu_kernel":
        assert isinstance(md, RaggedMetadata), type(md)
        args = (md.kv_lens, md.block_tables, md.query_start, md.query_lens, md.num_seqs)
        if not is_fp8_cache(kv_cache.dtype, fp8):  # q in the cache's float dtype
            q = q.astype(kv_cache.dtype)
        options = dict(sm_scale=sm_scale, fp8_dtype=fp8)
        if sharded:
            out = ragged_paged_attention_cpu_sharded(
                mesh, MODEL_AXIS, q, kv_cache, layer, *args, **options
            )
        else:
            out = ragged_paged_attention_cpu(q, kv_cache, *args, layer=layer, **options)
        return out, kv_cache
    if backend != "xla":
        assert isinstance(md, RaggedMetadata), type(md)
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
        gpu = backend.startswith("pallas_gpu")
        kernel = ragged_paged_attention_gpu if gpu else ragged_paged_attention
        options = dict(
            layer=layer,
            sm_scale=sm_scale,
            interpret=backend.endswith("_interpret"),
            fp8_dtype=fp8,
        )
        # Under tensor parallelism (the runner traces inside `jax.set_mesh`), each device
        # runs the kernel on its own heads.
        if sharded:
            out = ragged_paged_attention_sharded(mesh, MODEL_AXIS, *args, kernel=kernel, **options)
        else:
            out = kernel(*args, **options)
        return out, kv_cache
    assert isinstance(md, XlaMetadata), type(md)
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
            fp8,
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
            fp8,
        )
        parts.append(pre[md.tile_inverse].reshape(Tt * C, N, H))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    return out, kv_cache

"""Attention metadata: one class and one numpy builder per attention backend.

The step builder (`runner/inputs.py`) describes the flat batch once (`FlatBatch`: where each
row's tokens sit, its context length and its block table); each backend's builder turns that
into only the arrays its kernel reads, so the step ships nothing a backend ignores.

- `RaggedMetadata` (`cpu_kernel` and the `pallas*` backends): the ragged paged attention
  kit's view: per request row its query start and length, context length and block table.
- `XlaMetadata` (`xla`): decode rows and prefill tiles, sorted longest first into bands, each
  band with its own KV-chunk trip count (see the constants below).

Both carry `slot_mapping`, the flat cache slot every token's K/V is written to.
Glossary: T tokens, R request rows (Rd decode rows, then prefill/verification rows), Tt
tiles, C tile size, P pages per block table, S block size.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np

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


def band_chunks(kv_lens: np.ndarray, block_size: int, kv_token_bytes: int, queries: int):
    """[bands] KV chunks each band of rows (sorted longest first) loops over."""
    bands = kv_bands(len(kv_lens))
    rows = len(kv_lens) // bands
    chunk = kv_chunk_pages(block_size, rows, kv_token_bytes, queries) * block_size
    longest = kv_lens.reshape(bands, rows).max(axis=1) if len(kv_lens) else np.zeros(1)
    return (-(-longest // chunk)).astype(np.int32)


@dataclasses.dataclass
class FlatBatch:
    """One step's flat batch, backend-neutral (numpy)."""

    slot_mapping: np.ndarray  # [T] flat cache slot of each token; B*S for padding
    query_start: np.ndarray  # [R] first token of each row
    query_lens: np.ndarray  # [R]
    kv_lens: np.ndarray  # [R] context length including the row's new tokens; 0: padding
    block_tables: np.ndarray  # [R, P]
    tile_row: np.ndarray  # [Tt] the row each prefill tile belongs to
    tile_q_pos: np.ndarray  # [Tt, C] absolute position of each query; -1 for padding
    num_decode_rows: int  # Rd
    block_size: int
    kv_token_bytes: int
    kv_fp8: str | None = None  # the float8 format whose bytes (uint8) the cache holds


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "slot_mapping",
        "kv_lens",
        "block_tables",
        "query_start",
        "query_lens",
        "num_seqs",
    ],
    meta_fields=["kv_fp8"],
)
@dataclasses.dataclass
class RaggedMetadata:
    slot_mapping: jax.Array  # [T]
    kv_lens: jax.Array  # [R]
    block_tables: jax.Array  # [R, P]
    query_start: jax.Array  # [R]
    query_lens: jax.Array  # [R]
    num_seqs: jax.Array  # [1]
    kv_fp8: str | None = None  # the float8 format whose bytes (uint8) the cache holds


def build_ragged(b: FlatBatch) -> RaggedMetadata:
    R = len(b.kv_lens)
    return RaggedMetadata(
        b.slot_mapping,
        b.kv_lens,
        b.block_tables,
        b.query_start,
        b.query_lens,
        np.array([R], np.int32),
        b.kv_fp8,
    )


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
    kv_fp8: str | None = None  # the float8 format whose bytes (uint8) the cache holds


def build_xla(b: FlatBatch) -> XlaMetadata:
    Rd = b.num_decode_rows
    Tt, C = b.tile_q_pos.shape
    S, kv_bytes = b.block_size, b.kv_token_bytes
    dec_kv = b.kv_lens[:Rd]
    # A prefill tile needs the keys up to its last query (causal), not its request's whole
    # context; the bands take tiles in that order, longest first.
    tile_need = b.tile_q_pos.max(axis=1, initial=-1) + 1
    order = np.argsort(-tile_need, kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(Tt, dtype=np.int32)
    rows = b.tile_row[order]
    return XlaMetadata(
        slot_mapping=b.slot_mapping,
        decode_block_table=b.block_tables[:Rd],
        decode_kv_lens=dec_kv,
        tile_block_table=b.block_tables[rows],
        tile_kv_lens=b.kv_lens[rows],
        tile_q_pos=b.tile_q_pos[order],
        tile_order=order,
        tile_inverse=inverse,
        decode_chunks=band_chunks(dec_kv, S, kv_bytes, 1),
        tile_chunks=band_chunks(tile_need[order], S, kv_bytes, C),
        kv_fp8=b.kv_fp8,
    )


BUILDERS = {
    "xla": build_xla,
    "cpu_kernel": build_ragged,
    "pallas": build_ragged,
    "pallas_interpret": build_ragged,
    "pallas_gpu": build_ragged,
    "pallas_gpu_interpret": build_ragged,
}

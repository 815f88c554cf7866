"""The flat batch as every attention backend sees it, and the ragged kernels' metadata.

The step builder (`runner/inputs.py`) describes the flat batch once (`FlatBatch`: where each
row's tokens sit, its context length and its block table); each backend's
`build_metadata` turns that into only the arrays its kernel reads, so the step ships nothing
a backend ignores.

- `RaggedMetadata` (`cpu_kernel` and the `pallas*` backends): the ragged paged attention
  kit's view: per request row its query start and length, context length and block table.
- `XlaMetadata` (`xla.py`): decode rows and prefill tiles, sorted longest first into bands,
  each band looping over the KV chunks its rows need (from their sliding window's or local
  chunk's start).

Both carry `slot_mapping`, the flat cache slot every token's K/V is written to.
Glossary: T tokens, R request rows (Rd decode rows, then prefill/verification rows), Tt
tiles, C tile size, P pages per block table, S block size.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np


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
    # The sliding window of the KV-cache group this batch is for: the XLA path reads only the
    # pages inside it (the ragged kernels take the window from the layer).
    window: int | None = None
    # Likewise its chunked local attention's chunk size (a query at p sees keys from
    # floor(p / chunk_size) * chunk_size): the XLA path reads only the pages of each row's chunk.
    chunk_size: int | None = None
    # [T] the last key position each token sees, for a model whose image tokens attend to
    # each other in both directions (an image token's is its image's last token, any other
    # token's its own position); None: causal.
    q_horizon: np.ndarray | None = None


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "slot_mapping",
        "kv_lens",
        "block_tables",
        "query_start",
        "query_lens",
        "num_seqs",
        "q_horizon",
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
    q_horizon: jax.Array | None = None  # [T] (FlatBatch.q_horizon), None: causal


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
        b.q_horizon,
    )

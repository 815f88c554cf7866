"""The flat batch of a step as the attention backends read it (`FlatBatch`,
`jllm/attention/metadata.py`): all padding for a forward key, decode rows filled, and one
copy per KV-cache group with that group's slots, block tables and sliding window, turned
into the backend's metadata (a group of per-request state gets a `StateMetadata` instead,
jllm/models/state.py). Used by the step builder and the draft model's steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllm.attention.metadata import FlatBatch
from jllm.models.state import build_state_metadata
from jllm.runner.buckets import BatchLayout
from jllm.runner.input_batch import InputBatch, token_slots


def padded_flat_batch(layout: BatchLayout, key: tuple) -> FlatBatch:
    """A forward key's flat batch, all padding: tokens write to the dropped slot B*S,
    rows have no queries and kv_len 0, tile positions are -1. Builders fill it in place."""
    S, C = layout.block_size, layout.tile_size
    T, R, Rd, Tt = layout.dims(key)
    return FlatBatch(
        slot_mapping=np.full(T, layout.num_blocks * S, np.int32),
        query_start=np.zeros(R, np.int32),
        query_lens=np.zeros(R, np.int32),
        kv_lens=np.zeros(R, np.int32),
        block_tables=np.zeros((R, layout.max_pages), np.int32),
        tile_row=np.zeros(Tt, np.int32),
        tile_q_pos=np.full((Tt, C), -1, np.int32),
        num_decode_rows=Rd,
        block_size=S,
        kv_token_bytes=layout.kv_token_bytes,
        kv_fp8=layout.kv_fp8,
        q_horizon=np.zeros(T, np.int32) if layout.image_spans else None,
    )


def fill_decode_rows(flat: FlatBatch, pos: np.ndarray) -> None:
    """The first len(pos) rows as decode rows: one query each at `pos`, seeing positions
    0..pos."""
    n = len(pos)
    flat.query_start[:n] = np.arange(n)
    flat.query_lens[:n] = 1
    flat.kv_lens[:n] = pos + 1


def in_group(
    flat: FlatBatch, table: np.ndarray, tok_row, positions, req_row, fields=()
) -> FlatBatch:
    """The flat batch as one KV-cache group sees it, from the group's block tables `table`
    [rows, P] (`InputBatch.block_table[g]`): each token's slot (from its input-batch row
    `tok_row` [T] and position; -1: padding, which keeps the dropped slot), each request
    row's block table (`req_row` [R]: its input-batch row; -1: padding, an empty table) and
    the group's `fields` (BatchLayout.group_fields: its token bytes, window or local chunk;
    a windowed or chunked group's table holds freed or null blocks before what its queries
    read, which the backends never read)."""
    has = req_row >= 0
    slots = token_slots(table, tok_row, positions, flat.block_size, flat.slot_mapping)
    tables = np.where(has[:, None], table[np.where(has, req_row, 0)], 0).astype(np.int32)
    return dataclasses.replace(flat, slot_mapping=slots, block_tables=tables, **dict(fields))


def group_metadata(
    backend, flat: FlatBatch, batch: InputBatch, groups, tok_row, positions, req_row, fields=()
):
    """Each KV-cache group's metadata in `groups`, as a tuple (`fields`: every group's step
    fields, by group index: BatchLayout.group_fields): the backend's attention metadata, or
    for a group of per-request state (its fields say `state`) its StateMetadata
    (models/state.py), which no backend reads."""
    out = []
    for g in groups:
        own = fields[g] if g < len(fields) else ()
        if dict(own).get("state"):
            table = batch.block_table[g]
            out.append(
                build_state_metadata(flat.query_start, flat.query_lens, table, positions, req_row)
            )
            continue
        group = in_group(flat, batch.block_table[g], tok_row, positions, req_row, own)
        out.append(backend.build_metadata(group))
    return tuple(out)

"""Build one step's device inputs from a `SchedulerOutput`, in numpy, padded to buckets.

Layout of the flat batch (see `jllm/models/attention.py`): Rd decode rows (one token per
request), then the prefill chunks, each starting on a tile boundary. Requests are ordered
the same way (decodes, then prefills) for the ragged kernel's metadata and for the rows
that are sampled. Everything is padded: tokens write to the dropped slot B*S, requests have
kv_len 0 and sample rows that the host ignores.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np

from jllm.engine.kv_cache_manager import cdiv
from jllm.engine.scheduler import ScheduledRequest, SchedulerOutput
from jllm.models.attention import (
    AttentionMetadata,
    kv_bands,
    kv_chunk_pages,
    max_kv_chunk_pages,
)
from jllm.runner.sampler import SamplingMetadata
from jllm.sampling_params import MAX_SUPPRESS


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "token_ids",
        "positions",
        "logits_indices",
        "penalty_token_rows",
        "attn",
    ],
    meta_fields=[],
)
@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # [T]
    positions: jax.Array  # [T]
    logits_indices: jax.Array  # [Rs] flat index of each sampled row's last token
    # [T] penalty-state row that counts each token (sampled since its sequence was
    # admitted, see runner/penalty_state.py); out of range: none
    penalty_token_rows: jax.Array
    attn: AttentionMetadata


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}.")


def pow2_buckets(limit: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


@dataclasses.dataclass
class BatchLayout:
    """Static facts the input builder needs from the runner."""

    block_size: int
    num_blocks: int
    tile_size: int
    max_pages: int  # block table width, a multiple of the largest KV chunk in pages
    kv_token_bytes: int  # one token's K and V in one layer
    decode_buckets: list[int]  # Rd
    tile_buckets: list[int]  # Tt
    sample_buckets: list[int]  # Rs

    @staticmethod
    def create(
        block_size,
        num_blocks,
        tile_size,
        max_model_len,
        max_num_seqs,
        budget,
        kv_token_bytes,
        min_rows=1,
    ):
        """`min_rows`: the smallest decode and sample bucket (see `min_dot_rows`)."""
        chunk_pages = max_kv_chunk_pages(block_size)
        max_pages = cdiv(cdiv(max_model_len, block_size), chunk_pages) * chunk_pages
        return BatchLayout(
            block_size=block_size,
            num_blocks=num_blocks,
            tile_size=tile_size,
            max_pages=max_pages,
            kv_token_bytes=kv_token_bytes,
            decode_buckets=[0] + pow2_buckets(max_num_seqs, min_rows),
            tile_buckets=[0] + pow2_buckets(cdiv(budget, tile_size)),
            sample_buckets=pow2_buckets(max_num_seqs, min_rows),
        )

    def sample_rows(self, rd: int, tt: int) -> int:
        return bucket(min(rd + tt, self.sample_buckets[-1]), self.sample_buckets)

    def shapes(self):
        """Every (Rd, Tt) pair a step can have."""
        return [(d, t) for d in self.decode_buckets for t in self.tile_buckets if d or t]


def build_step_inputs(
    out: SchedulerOutput,
    layout: BatchLayout,
    penalty_rows: dict[str, int],
    penalty_start: dict[str, int],
    num_rows: int,
    shape: tuple[int, int] | None = None,
):
    """Returns (StepInputs in numpy, scheduled requests in batch order, each one's sample
    row or None, the number of sample rows). `penalty_rows` / `penalty_start`: each penalty
    sequence's row and the position from which its tokens count. `shape` forces the
    (Rd, Tt) bucket (warm-up)."""
    S, C = layout.block_size, layout.tile_size
    # Decode rows longest context first, so that the attention's bands group similar lengths
    # (prefill tiles are sorted on their own below).
    decodes = sorted(
        (s for s in out.scheduled if s.num_new_tokens == 1), key=lambda s: -s.num_computed_tokens
    )
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    n_tiles = sum(cdiv(s.num_new_tokens, C) for s in prefills)
    if shape is None:
        Rd = bucket(len(decodes), layout.decode_buckets)
        Tt = bucket(n_tiles, layout.tile_buckets)
    else:
        Rd, Tt = shape
    Rs = layout.sample_rows(Rd, Tt)
    T = Rd + Tt * C
    R = Rd + Tt
    P = layout.max_pages
    pad_slot = layout.num_blocks * S

    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, pad_slot, np.int32)
    pen_rows = np.full(T, num_rows, np.int32)
    logits_indices = np.zeros(Rs, np.int32)
    query_start = np.zeros(R, np.int32)
    query_lens = np.zeros(R, np.int32)
    kv_lens = np.zeros(R, np.int32)
    block_tables = np.zeros((R, P), np.int32)
    tile_bt = np.zeros((Tt, P), np.int32)
    tile_kv = np.zeros(Tt, np.int32)
    tile_pos = np.full((Tt, C), -1, np.int32)

    ordered: list[ScheduledRequest] = decodes + prefills
    sample_row: list[int | None] = []
    n_sampled = 0
    start, tile = Rd, 0
    for i, s in enumerate(ordered):
        req, n, nc = s.request, s.num_new_tokens, s.num_computed_tokens
        row = i if i < len(decodes) else Rd + (i - len(decodes))
        blocks = np.asarray(s.block_ids, np.int32)
        block_tables[row, : len(blocks)] = blocks
        begin = i if i < len(decodes) else start
        pos = np.arange(nc, nc + n, dtype=np.int32)
        token_ids[begin : begin + n] = req.all_token_ids[nc : nc + n]
        positions[begin : begin + n] = pos
        slot_mapping[begin : begin + n] = blocks[pos // S] * S + pos % S
        query_start[row], query_lens[row], kv_lens[row] = begin, n, nc + n
        prow = penalty_rows.get(req.request_id)
        if prow is not None:
            counted = pos >= penalty_start[req.request_id]
            pen_rows[begin : begin + n] = np.where(counted, prow, num_rows)
        if i >= len(decodes):
            k = cdiv(n, C)
            tile_bt[tile : tile + k] = block_tables[row]
            tile_kv[tile : tile + k] = nc + n
            padded = np.full(k * C, -1, np.int32)
            padded[:n] = pos
            tile_pos[tile : tile + k] = padded.reshape(k, C)
            tile += k
            start += k * C
        if s.samples:
            logits_indices[n_sampled] = begin + n - 1
            sample_row.append(n_sampled)
            n_sampled += 1
        else:
            sample_row.append(None)

    dec_kv = kv_lens[:Rd]
    # A prefill tile needs the keys up to its last query (causal), not its request's whole
    # context; the attention's bands take tiles in that order, longest first.
    tile_need = tile_pos.max(axis=1, initial=-1) + 1
    tile_order = np.argsort(-tile_need, kind="stable").astype(np.int32)
    tile_inverse = np.empty_like(tile_order)
    tile_inverse[tile_order] = np.arange(Tt, dtype=np.int32)
    attn = AttentionMetadata(
        slot_mapping=slot_mapping,
        decode_block_table=block_tables[:Rd],
        decode_kv_lens=dec_kv,
        tile_block_table=tile_bt[tile_order],
        tile_kv_lens=tile_kv[tile_order],
        tile_q_pos=tile_pos[tile_order],
        tile_order=tile_order,
        tile_inverse=tile_inverse,
        decode_chunks=band_chunks(dec_kv, S, layout.kv_token_bytes, 1),
        tile_chunks=band_chunks(tile_need[tile_order], S, layout.kv_token_bytes, C),
        query_start=query_start,
        query_lens=query_lens,
        kv_lens=kv_lens,
        block_tables=block_tables,
        num_seqs=np.array([R], np.int32),
        tile_size=C,
    )
    inputs = StepInputs(
        token_ids=token_ids,
        positions=positions,
        logits_indices=logits_indices,
        penalty_token_rows=pen_rows,
        attn=attn,
    )
    return inputs, ordered, sample_row, Rs


def band_chunks(kv_lens: np.ndarray, block_size: int, kv_token_bytes: int, queries: int):
    """[bands] KV chunks each band of rows (sorted longest first) loops over."""
    bands = kv_bands(len(kv_lens))
    rows = len(kv_lens) // bands
    chunk = kv_chunk_pages(block_size, rows, kv_token_bytes, queries) * block_size
    longest = kv_lens.reshape(bands, rows).max(axis=1) if len(kv_lens) else np.zeros(1)
    return (-(-longest // chunk)).astype(np.int32)


def build_sampling_metadata(ordered, sample_row, Rs, penalty_rows, max_logprobs):
    V_NONE = np.iinfo(np.int32).max
    temperature = np.zeros(Rs, np.float32)
    top_p = np.ones(Rs, np.float32)
    top_k = np.zeros(Rs, np.int32)
    min_p = np.zeros(Rs, np.float32)
    seed_lo = np.zeros(Rs, np.uint32)
    seed_hi = np.zeros(Rs, np.uint32)
    counter = np.zeros(Rs, np.int32)
    presence = np.zeros(Rs, np.float32)
    frequency = np.zeros(Rs, np.float32)
    repetition = np.ones(Rs, np.float32)
    prows = np.zeros(Rs, np.int32)
    suppress = np.full((Rs, MAX_SUPPRESS), V_NONE, np.int32)
    want_logprobs = np.zeros(Rs, bool)
    for s, r in zip(ordered, sample_row, strict=True):
        if r is None:
            continue
        req = s.request
        p = req.sampling_params
        temperature[r], top_p[r], top_k[r], min_p[r] = p.temperature, p.top_p, p.top_k, p.min_p
        seed_lo[r], seed_hi[r] = req.seed & 0xFFFFFFFF, (req.seed >> 32) & 0xFFFFFFFF
        counter[r] = req.num_output_tokens
        if p.has_penalties:
            presence[r], frequency[r] = p.presence_penalty, p.frequency_penalty
            repetition[r] = p.repetition_penalty
            prows[r] = penalty_rows[req.request_id]
        if req.num_output_tokens < p.min_tokens:
            ids = sorted(p.all_stop_token_ids | {req.eos_token_id} - {None})
            suppress[r, : len(ids)] = ids
        want_logprobs[r] = p.logprobs is not None
    return SamplingMetadata(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed_lo=seed_lo,
        seed_hi=seed_hi,
        counter=counter,
        presence=presence,
        frequency=frequency,
        repetition=repetition,
        penalty_rows=prows,
        suppress=suppress,
        want_logprobs=want_logprobs,
    )

"""The step-input builder's ordering for the attention bands (pure numpy, no device)."""

from __future__ import annotations

import numpy as np

from jllm.engine.request import Request
from jllm.engine.scheduler import ScheduledRequest, SchedulerOutput
from jllm.models.attention import kv_bands, kv_chunk_pages
from jllm.runner.inputs import BatchLayout, build_step_inputs
from jllm.sampling_params import SamplingParams

S, C = 4, 4  # block size, tile size
LAYOUT = BatchLayout.create(
    block_size=S,
    num_blocks=512,
    tile_size=C,
    max_model_len=256,
    max_num_seqs=64,
    budget=512,
    kv_token_bytes=1 << 12,
)


def scheduled(i, computed, new, total):
    req = Request(f"r{i}", list(range(1, total + 1)), SamplingParams(), None, seed=i)
    blocks = list(range(1 + 64 * i, 1 + 64 * i + -(-(computed + new) // S)))
    return ScheduledRequest(req, computed, new, blocks)


def test_rows_sorted_for_bands_and_trip_counts_cover_each_row():
    rng = np.random.default_rng(0)
    out = SchedulerOutput()
    for i in range(20):  # decodes with contexts 5..200
        ctx = int(rng.integers(5, 200))
        out.scheduled.append(scheduled(i, ctx - 1, 1, ctx))
    for i, (done, new) in enumerate([(0, 37), (40, 60), (0, 9), (100, 28)], start=20):
        out.scheduled.append(scheduled(i, done, new, done + new))
    inputs, ordered, _, _ = build_step_inputs(out, LAYOUT, {}, {}, 65)
    md = inputs.attn

    # Decode rows: longest context first; every band loops far enough for each of its rows.
    rd = md.decode_kv_lens.shape[0]
    assert list(md.decode_kv_lens) == sorted(md.decode_kv_lens, reverse=True)
    bands = kv_bands(rd)
    assert md.decode_chunks.shape == (bands,)
    chunk = kv_chunk_pages(S, rd // bands, LAYOUT.kv_token_bytes, 1) * S
    for b, rows in enumerate(md.decode_kv_lens.reshape(bands, -1)):
        assert md.decode_chunks[b] == -(-rows.max() // chunk)

    # Prefill tiles: sorted by causal horizon, and the permutation maps back to the flat
    # batch, where each request's tiles hold its positions in order.
    horizon = md.tile_q_pos.max(axis=1) + 1
    assert list(horizon) == sorted(horizon, reverse=True)
    flat_pos = md.tile_q_pos[md.tile_inverse]
    assert np.array_equal(md.tile_q_pos, flat_pos[md.tile_order])
    prefills = [s for s in ordered if s.num_new_tokens > 1]
    for j, s in enumerate(prefills):  # request rows: decodes (padded to rd), then prefills
        first = (md.query_start[rd + j] - rd) // C
        pos = flat_pos[first : first + -(-s.num_new_tokens // C)].reshape(-1)
        expect = np.arange(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
        assert np.array_equal(pos[: s.num_new_tokens], expect)
        assert (pos[s.num_new_tokens :] == -1).all()
    tt = horizon.shape[0]
    tbands = kv_bands(tt)
    tchunk = kv_chunk_pages(S, tt // tbands, LAYOUT.kv_token_bytes, C) * S
    for b, rows in enumerate(horizon.reshape(tbands, -1)):
        assert md.tile_chunks[b] == -(-rows.max() // tchunk)

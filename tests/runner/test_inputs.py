"""The step-input builder over the persistent input batch: ordering for the attention bands,
rows gathered from the batch, and a verification row's sample rows (pure numpy)."""

from __future__ import annotations

import numpy as np

from jllm.attention import get_backend
from jllm.attention.metadata import build_ragged
from jllm.attention.xla import build_xla, kv_bands, kv_chunk_pages
from jllm.runner.buckets import BatchLayout, bucket
from jllm.runner.input_batch import NO_TOKEN, InputBatch
from jllm.runner.inputs import build_step
from jllm.sampling_params import SamplingParams
from jllm.scheduler_output import NewRequestData, SchedulerOutput

S, C = 4, 4  # block size, tile size
LAYOUT = BatchLayout.create(
    block_size=S,
    num_blocks=512,
    tile_size=C,
    max_model_len=256,
    max_num_seqs=64,
    budget=512,
    kv_token_bytes=1 << 12,
    num_spec_tokens=3,
)


def schedule(out, batch, i, computed, new, total, params=None, drafts=()):
    """Admit request i (prompt 1..total) to `batch` and schedule `new` tokens of it."""
    blocks = list(range(1 + 64 * i, 1 + 64 * i + -(-(computed + new) // S)))
    rid = f"r{i}"
    params = params or SamplingParams()
    batch.add(
        NewRequestData(rid, list(range(1, total + 1)), [], params, i, None, (blocks,), computed)
    )
    out.num_scheduled_tokens[rid] = new
    if drafts:
        out.scheduled_spec_decode_tokens[rid] = list(drafts)


def test_rows_sorted_for_bands_and_trip_counts_cover_each_row():
    rng = np.random.default_rng(0)
    out, batch = SchedulerOutput(), InputBatch(64, 256, LAYOUT.max_pages)
    for i in range(20):  # decodes with contexts 5..200
        ctx = int(rng.integers(5, 200))
        schedule(out, batch, i, ctx - 1, 1, ctx)
    chunks = [(0, 37), (40, 60), (0, 9), (100, 28)]
    for i, (done, new) in enumerate(chunks, start=20):
        schedule(out, batch, i, done, new, done + new)
    inputs, _, _, _, _, _ = build_step(batch, out, LAYOUT, get_backend("xla"))
    md = inputs.attn[0]

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
    first = 0
    for done, new in chunks:  # the flat batch's tiles, request by request
        pos = flat_pos[first : first + -(-new // C)].reshape(-1)
        assert np.array_equal(pos[:new], np.arange(done, done + new))
        assert (pos[new:] == -1).all()
        first += -(-new // C)
    tt = horizon.shape[0]
    tbands = kv_bands(tt)
    tchunk = kv_chunk_pages(S, tt // tbands, LAYOUT.kv_token_bytes, C) * S
    for b, rows in enumerate(horizon.reshape(tbands, -1)):
        assert md.tile_chunks[b] == -(-rows.max() // tchunk)


def test_ragged_and_xla_metadata_describe_the_same_batch():
    """Each backend's builder ships only its own fields; both place every token alike."""
    out, batch = SchedulerOutput(), InputBatch(64, 256, LAYOUT.max_pages)
    schedule(out, batch, 0, 30, 1, 31)
    schedule(out, batch, 1, 0, 9, 9)
    ragged, _, _, shape, _, _ = build_step(batch, out, LAYOUT, get_backend("cpu_kernel"))
    xla, _, _, _, _, _ = build_step(batch, out, LAYOUT, get_backend("xla"))
    (r,), (x,) = ragged.attn, xla.attn  # one KV-cache group
    assert not hasattr(r, "tile_q_pos") and not hasattr(x, "query_start")
    np.testing.assert_array_equal(r.slot_mapping, x.slot_mapping)
    rd, tt = shape
    assert (rd, tt) == (1, 4)  # one decode row; 9 tokens in 3 tiles of 4, bucket 4
    np.testing.assert_array_equal(r.kv_lens[:2], [31, 9])
    np.testing.assert_array_equal(r.query_start[:2], [0, 1])
    np.testing.assert_array_equal(x.decode_kv_lens, [31])
    np.testing.assert_array_equal(r.block_tables[0], x.decode_block_table[0])
    # the decode's token is gathered from the batch row: position 30 holds token 31
    assert ragged.token_ids[0] == 31 and ragged.positions[0] == 30
    assert build_ragged is not build_xla


def test_verification_row_samples_after_each_draft():
    out, batch = SchedulerOutput(), InputBatch(64, 256, LAYOUT.max_pages)
    params = SamplingParams(temperature=1.0, seed=5, min_tokens=2, stop_token_ids=[7])
    schedule(out, batch, 0, 11, 1, 12, SamplingParams(temperature=0))  # a greedy decode
    schedule(out, batch, 1, 19, 4, 20, params, drafts=[50, 51, 52])  # verify 3 drafts
    inputs, md, groups, shape, _, _ = build_step(batch, out, LAYOUT, get_backend("cpu_kernel"))
    assert [(g.req_id, g.first, g.count) for g in groups] == [("r0", 0, 1), ("r1", 1, 4)]
    # The verification row is four decode rows (no tile), longest context first.
    assert shape == (8, 0)
    at = inputs.logits_indices[1:5]  # the flat index of each of its tokens
    np.testing.assert_array_equal(at, [3, 2, 1, 0])
    assert inputs.logits_indices[0] == 4  # the plain decode, the shortest context
    np.testing.assert_array_equal(inputs.token_ids[at], [20, 50, 51, 52])
    np.testing.assert_array_equal(inputs.positions[at], [19, 20, 21, 22])
    np.testing.assert_array_equal(inputs.attn[0].query_start[at], at)
    np.testing.assert_array_equal(inputs.attn[0].query_lens[at], 1)
    np.testing.assert_array_equal(inputs.attn[0].kv_lens[at], [20, 21, 22, 23])  # causal
    assert (inputs.from_device[:5] == -1).all()
    np.testing.assert_array_equal(md.draft[:5], [-1, 50, 51, 52, -1])
    np.testing.assert_array_equal(md.group_first[:5], [0, 1, 1, 1, 1])
    np.testing.assert_array_equal(md.counter[1:5], [0, 1, 2, 3])  # its output index + j
    np.testing.assert_array_equal(md.spec_prev[3], [50, 51, NO_TOKEN])
    # min_tokens=2: the stop id is suppressed for output indices 0 and 1 only
    assert 7 in md.suppress[1] and 7 in md.suppress[2] and 7 not in md.suppress[3]
    assert md.temperature[1] == 1.0 and md.temperature[0] == 0.0


def test_verification_rows_past_the_decode_bucket_take_tiles():
    """A verification row that would not fit the largest decode bucket beside the step's
    other decode rows takes tiles, as a prefill chunk does."""
    layout = BatchLayout.create(S, 512, C, 256, 4, 64, 1 << 12, num_spec_tokens=3)
    out, batch = SchedulerOutput(), InputBatch(4, 256, layout.max_pages)
    schedule(out, batch, 0, 11, 1, 12)
    schedule(out, batch, 1, 19, 4, 20, drafts=[50, 51, 52])  # 1 + 4 > 4 decode rows
    inputs, _, groups, shape, _, _ = build_step(batch, out, layout, get_backend("cpu_kernel"))
    assert shape == (1, 1)
    start = inputs.attn[0].query_start[1]
    assert inputs.attn[0].query_lens[1] == 4 and start == 1
    np.testing.assert_array_equal(inputs.token_ids[start : start + 4], [20, 50, 51, 52])
    np.testing.assert_array_equal(inputs.logits_indices[1:5], range(start, start + 4))
    assert [(g.req_id, g.first, g.count) for g in groups] == [("r0", 0, 1), ("r1", 1, 4)]


def test_each_kv_cache_group_reads_its_own_block_tables():
    """With two KV-cache groups (a model's and a draft's) every token's slot and every row's
    block table come from its group's table; the rest of the metadata is the same."""
    out, batch = SchedulerOutput(), InputBatch(64, 256, LAYOUT.max_pages, num_kv_groups=2)
    for i, (computed, new, total) in enumerate([(30, 1, 31), (0, 9, 9)]):
        n = -(-(computed + new) // S)
        blocks = (
            list(range(1 + 64 * i, 1 + 64 * i + n)),
            list(range(300 + 64 * i, 300 + 64 * i + n)),
        )
        prompt = list(range(1, total + 1))
        batch.add(NewRequestData(f"r{i}", prompt, [], SamplingParams(), i, None, blocks, computed))
        out.num_scheduled_tokens[f"r{i}"] = new
    inputs, _, _, _, _, _ = build_step(batch, out, LAYOUT, get_backend("cpu_kernel"))
    first, second = inputs.attn
    for md, g in ((first, 0), (second, 1)):
        table = batch.block_table[g]
        np.testing.assert_array_equal(md.block_tables[:2], table[[0, 1]])
        assert (md.block_tables[2:] == 0).all()
        # the decode at position 30, then the 9 prompt tokens of row 1 (a tile of 4 later)
        assert md.slot_mapping[0] == table[0, 30 // S] * S + 30 % S
        start = md.query_start[1]
        np.testing.assert_array_equal(
            md.slot_mapping[start : start + 9], table[1, np.arange(9) // S] * S + np.arange(9) % S
        )
        live = np.zeros(len(md.slot_mapping), bool)
        live[0], live[start : start + 9] = True, True
        assert (md.slot_mapping[~live] == LAYOUT.num_blocks * S).all()  # the dropped slot
    assert not set(first.slot_mapping[:1]) & set(second.slot_mapping[:1])  # own blocks
    for name in ("kv_lens", "query_start", "query_lens"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))


def test_packed_rows_sit_back_to_back():
    """For the ragged kernels (no prefill tile) rows of several tokens are packed after the
    decodes, on one axis: a decode and three 3-token chunks are 10 tokens, key (T=16,),
    with min(16, max_num_seqs) request rows."""
    layout = BatchLayout.create(S, 512, 1, 256, 64, 512, 1 << 12, tiles=False)
    out, batch = SchedulerOutput(), InputBatch(64, 256, layout.max_pages)
    schedule(out, batch, 0, 30, 1, 31)  # a decode
    for i in (1, 2, 3):
        schedule(out, batch, i, 0, 3, 3)
    inputs, _, groups, shape, _, _ = build_step(batch, out, layout, get_backend("cpu_kernel"))
    (md,) = inputs.attn
    assert shape == (16,) and layout.dims(shape) == (16, 16, 0, 0)
    assert len(md.kv_lens) == 16 and len(inputs.token_ids) == 16
    np.testing.assert_array_equal(md.query_start[:4], [0, 1, 4, 7])
    np.testing.assert_array_equal(md.query_lens[:4], [1, 3, 3, 3])
    np.testing.assert_array_equal(inputs.token_ids[1:10], [1, 2, 3] * 3)
    np.testing.assert_array_equal(inputs.positions[1:10], [0, 1, 2] * 3)
    np.testing.assert_array_equal(inputs.logits_indices[:4], [0, 3, 6, 9])
    assert (md.slot_mapping[10:] == layout.num_blocks * S).all()  # padding
    assert [g.req_id for g in groups] == ["r0", "r1", "r2", "r3"]


def test_buckets_grow_with_log_batch_and_cover_every_step():
    """Packed rows: one token axis (12 forward keys at the defaults, 256 sequences and 2048
    batched tokens, against 89 (Rd, Tt) pairs with tiles) and 9 sample-row buckets, and
    every step the limits allow has its key. With tiles, pairs whose fewest tokens exceed
    the budget are not compiled, and every reachable (decodes, tiles) mix has its pair."""
    packed = BatchLayout.create(16, 64, 1, 8192, 256, 2048, 1 << 12, tiles=False)
    assert packed.shapes() == [(1 << i,) for i in range(12)]
    assert packed.sample_buckets == [1 << i for i in range(9)]
    assert packed.dims((8,)) == (8, 8, 0, 0) and packed.dims((2048,)) == (2048, 256, 0, 0)
    assert len(BatchLayout.create(16, 64, 16, 8192, 256, 2048, 1 << 12).shapes()) == 89
    for tokens in range(1, 2049):
        assert (bucket(tokens, packed.token_buckets),) in packed.shapes()

    tiles = BatchLayout.create(16, 64, 16, 1024, 64, 64, 1 << 12, num_spec_tokens=2)
    keys = set(tiles.shapes())
    full = {(d, t) for d in tiles.decode_buckets for t in tiles.tile_buckets if d or t}
    # 33 decodes (the fewest in the 64 bucket) and 2 tiles are 65 tokens: never
    assert full - keys == {(64, 2), (64, 4), (32, 4)}
    for decodes in range(65):
        for n_tiles in range(5):
            if (decodes or n_tiles) and decodes + 16 * n_tiles <= 64:
                key = (bucket(decodes, tiles.decode_buckets), bucket(n_tiles, tiles.tile_buckets))
                assert key in keys, (decodes, n_tiles)
    # sample rows: up to max_num_seqs x (1 + drafts), within the budget
    assert tiles.sample_buckets[-1] == 64 == tiles.logit_rows

"""Build one step's device inputs from the persistent input batch and a `SchedulerOutput`,
in numpy, padded to buckets.

Layout of the flat batch (see `jllm/attention/`), as the attention backend asks
(`prefill_tile`):
- tiles (the XLA path): Rd decode rows (one query each, gathered from the input batch
  without a Python loop), then Tt tiles of C token slots, each row of several tokens
  (prefill chunks) on whole tiles. A verification row (the decode token then its k drafts)
  is k + 1 decode rows while they fit the largest decode bucket, else a row of several
  tokens. The key is (Rd, Tt).
- packed (the ragged kernels): the decodes, then the rows of several tokens back to back
  (verification rows among them), in T token slots and R = min(T, max_num_seqs) request
  rows. The key is (T,): one axis.
Sample rows: one per request whose row reaches its last known token, k+1 (consecutive) for a
row verifying k drafts, padded to their own bucket Rs; the forward gathers the hidden states
of `logit_rows` tokens whatever its key, and the sampler's executable takes the first Rs.
Everything is padded: tokens write to the dropped slot B*S, request rows have kv_len 0,
sample rows read the input batch's padding row and the host ignores them. The attention
backend's builder (`AttentionBackend.build_metadata`, jllm/attention/) keeps only what that
backend reads.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np

from jllm.attention import AttentionBackend
from jllm.attention.metadata import FlatBatch
from jllm.attention.xla import max_kv_chunk_pages
from jllm.runner.input_batch import NO_TOKEN, InputBatch
from jllm.runner.sampler import SamplingMetadata
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS, SchedulerOutput
from jllm.utils import cdiv


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "token_ids",
        "positions",
        "logits_indices",
        "from_device",
        "prompt_lp_indices",
        "attn",
        "lora_slots",
        "embed_index",
    ],
    meta_fields=[],
)
@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # [T]
    positions: jax.Array  # [T]
    # [logit_rows] flat index of the token each sample row follows (padding: 0)
    logits_indices: jax.Array
    # [T] the input-batch row whose last sampled token, still on the device (async
    # scheduling), this token is; -1: the token is in token_ids
    from_device: jax.Array
    # [PROMPT_LOGPROB_ROWS] flat tokens whose hidden states the forward hands on for prompt
    # logprobs (runner/prompt_logprobs.py); padding: 0
    prompt_lp_indices: jax.Array
    attn: tuple  # the backend's metadata (jllm/attention/) of each KV-cache group
    lora_slots: jax.Array  # [T] each token's LoRA slot (0: none; runner/input_batch.py)
    # [T] with images: the row of the encoder cache (flattened [slots * P, D]) whose
    # embedding replaces each token's (-1: its own); None for a text-only model
    embed_index: jax.Array | None = None


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
    """Static facts the input builder needs from the runner, and the bucket policy: which
    step shapes (keys) are compiled.

    With tiles (the XLA backend), a step's key is (Rd, Tt): Rd decode rows, then Tt tiles
    of `tile_size` token slots. Packed (the ragged kernels: C++ on the CPU, Pallas on TPU and
    GPU, which take any mix of rows at any offset), it is (T,): T token slots and
    R = min(T, max_rows) request rows, one axis that grows with log(budget). Either way the
    sampler has its own axis, the sample rows Rs, and the forward hands it the hidden states
    of `logit_rows` tokens whatever the bucket, so the two never multiply."""

    block_size: int
    num_blocks: int
    tile_size: int
    max_pages: int  # block table width, a multiple of the largest KV chunk in pages
    kv_token_bytes: int  # one token's K and V in one layer
    decode_buckets: list[int]  # Rd (tiles), and the draft model's decode steps
    tile_buckets: list[int]  # Tt (tiles)
    token_buckets: list[int]  # T (packed)
    sample_buckets: list[int]  # Rs
    max_rows: int = 1  # request rows a step holds at most (max_num_seqs)
    budget: int = 1  # tokens a step holds at most (max_num_batched_tokens)
    num_spec_tokens: int = 0  # K: drafts a row may verify
    kv_fp8: str | None = None  # the float8 format whose bytes (uint8) the cache holds
    # Whether rows of several tokens start on, and fill, tiles of `tile_size` tokens (the
    # attention backend's `prefill_tile`), or are packed back to back.
    tiles: bool = True
    # Each KV-cache group's sliding window (None: full attention), in the runner's group
    # order: a backend reads only the pages inside it.
    windows: tuple = ()
    # A vision-language model's tokens per image (0: text only), and whether an image's
    # tokens attend to each other in both directions (each token's `q_horizon`).
    image_tokens: int = 0
    image_spans: bool = False

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
        num_spec_tokens=0,
        kv_fp8=None,
        tiles=True,
    ):
        """`min_rows`: the smallest decode, token and sample bucket (see `min_dot_rows`).
        Buckets stop at what the limits can reach: a step holds at most `budget` tokens
        and `max_num_seqs` requests, each sampling at most 1 + K rows."""
        chunk_pages = max_kv_chunk_pages(block_size)
        max_pages = cdiv(cdiv(max_model_len, block_size), chunk_pages) * chunk_pages
        rows = min(max_num_seqs * (1 + num_spec_tokens), budget)
        return BatchLayout(
            block_size=block_size,
            num_blocks=num_blocks,
            tile_size=tile_size,
            max_pages=max_pages,
            kv_token_bytes=kv_token_bytes,
            decode_buckets=[0] + pow2_buckets(max_num_seqs, min_rows),
            tile_buckets=[0] + pow2_buckets(cdiv(budget, tile_size)) if tiles else [0],
            token_buckets=[] if tiles else pow2_buckets(budget, min_rows),
            sample_buckets=pow2_buckets(rows, min_rows),
            max_rows=max_num_seqs,
            budget=budget,
            num_spec_tokens=num_spec_tokens,
            kv_fp8=kv_fp8,
            tiles=tiles,
        )

    @property
    def logit_rows(self) -> int:
        """The tokens whose hidden states every forward hands the sampler: the most sample
        rows a step can have."""
        return self.sample_buckets[-1]

    def dims(self, key: tuple) -> tuple[int, int, int, int]:
        """(T tokens, R request rows, Rd decode rows, Tt tiles) of a forward key."""
        if self.tiles:
            rd, tt = key
            return rd + tt * self.tile_size, rd + tt, rd, tt
        (t,) = key
        return t, min(t, self.max_rows), 0, 0

    def decode_key(self, rd: int) -> tuple:
        """The key of a step of `rd` one-token rows (the draft model's steps)."""
        return (rd, 0) if self.tiles else (rd,)

    def largest(self) -> tuple:
        """The forward key with the most tokens (start-up memory profiling)."""
        if self.tiles:
            return self.decode_buckets[-1], self.tile_buckets[-1]
        return (self.token_buckets[-1],)

    def shapes(self) -> list[tuple]:
        """Every forward key a step can have at these limits. With tiles, the (Rd, Tt)
        pairs whose fewest tokens (one more decode and one more tile than the buckets
        below) fit the budget: the scheduler charges a tile its whole size."""
        if not self.tiles:
            return [(t,) for t in self.token_buckets]

        def least(buckets, b):  # the fewest of a bucket's contents: one past the one below
            return 0 if b == 0 else buckets[buckets.index(b) - 1] + 1

        d, t = self.decode_buckets, self.tile_buckets
        return [
            (rd, tt)
            for rd in d
            for tt in t
            if (rd or tt) and least(d, rd) + least(t, tt) * self.tile_size <= self.budget
        ]


@dataclasses.dataclass
class PromptLogprobRows:
    """The prompt tokens of this step whose next prompt token's logprob a request asked for
    (`runner/prompt_logprobs.py`): flat indices and the ids they predict, padded to
    PROMPT_LOGPROB_ROWS with 0, and per request the prompt position of its first target and
    how many follow."""

    indices: np.ndarray  # [PROMPT_LOGPROB_ROWS] int32 flat token index
    targets: np.ndarray  # [PROMPT_LOGPROB_ROWS] int32 the prompt token at the next position
    spans: list[tuple[str, int, int]]  # (req id, position of the first target, count)


@dataclasses.dataclass
class SampleGroup:
    """The sample rows of one request in a step: `first` .. `first + count - 1`."""

    req_id: str
    row: int  # its input-batch row
    first: int
    count: int  # 1, or 1 + k for a row verifying k drafts
    generation: int  # the row's generation: a row that changed hands is not appended to
    drafts: list[int] = dataclasses.field(default_factory=list)  # the k drafts verified


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
    flat: FlatBatch, table: np.ndarray, tok_row, positions, req_row, window=None
) -> FlatBatch:
    """The flat batch as one KV-cache group sees it, from the group's block tables `table`
    [rows, P] (`InputBatch.block_table[g]`): each token's slot (from its input-batch row
    `tok_row` [T] and position; -1: padding, which keeps the dropped slot), each request
    row's block table (`req_row` [R]: its input-batch row; -1: padding, an empty table) and
    the group's sliding window (a sliding group's table holds freed or null blocks before
    the window, which the backends never read)."""
    S = flat.block_size
    live, has = tok_row >= 0, req_row >= 0
    r, p = np.where(live, tok_row, 0), np.where(live, positions, 0)
    slots = np.where(live, table[r, p // S] * S + p % S, flat.slot_mapping).astype(np.int32)
    tables = np.where(has[:, None], table[np.where(has, req_row, 0)], 0).astype(np.int32)
    return dataclasses.replace(flat, slot_mapping=slots, block_tables=tables, window=window)


def group_metadata(
    backend, flat: FlatBatch, batch: InputBatch, groups, tok_row, positions, req_row, windows=()
):
    """The backend's attention metadata of each KV-cache group in `groups`, as a tuple
    (`windows`: every group's sliding window, by group index)."""
    return tuple(
        backend.build_metadata(
            in_group(
                flat,
                batch.block_table[g],
                tok_row,
                positions,
                req_row,
                windows[g] if g < len(windows) else None,
            )
        )
        for g in groups
    )


@dataclasses.dataclass
class _Rows:
    """Which scheduled requests take which rows of the step: the decode entries (a request
    and an offset in its row; with tiles a verification row is k + 1 decode entries),
    longest context first, then the rows of several tokens; and the forward key."""

    ids: list[str]  # scheduled request ids, in the scheduler's order
    rows: np.ndarray  # their input-batch rows
    counts: np.ndarray  # their scheduled tokens
    verify: np.ndarray  # bool: a verification row laid out as decode entries
    d_req: np.ndarray  # each decode entry's scheduled request
    d_off: np.ndarray  # its offset in that request's row
    m_idx: np.ndarray  # the scheduled requests of several tokens
    shape: tuple  # the forward key: (Rd, Tt) with tiles, (T,) packed


def _plan_rows(batch: InputBatch, out: SchedulerOutput, layout: BatchLayout, shape) -> _Rows:
    C = layout.tile_size
    ids = list(out.num_scheduled_tokens)
    rows = np.array([batch.index[r] for r in ids], np.int32)
    counts = np.array(list(out.num_scheduled_tokens.values()), np.int32)
    single = counts == 1
    # With tiles, a verification row (its last token, then its drafts) is laid out as decode
    # rows of one query each, at consecutive positions (each sees the K/V written before it
    # in the step), while they fit the largest decode bucket: in tiles its k + 1 tokens
    # would take C slots. Packed, it is a row like any other.
    spec = out.scheduled_spec_decode_tokens
    verify = np.zeros(len(ids), bool)
    if spec and shape is None and layout.tiles:
        room = layout.decode_buckets[-1] - int(single.sum())
        for i in np.flatnonzero(~single):
            n = int(counts[i])
            if n - len(spec.get(ids[i], ())) == 1 and n <= room:
                verify[i], room = True, room - n
    # Decode entries, longest context first, so that the xla backend's bands group similar
    # lengths (its tiles are sorted on their own).
    d_req = np.flatnonzero(single | verify)
    reps = np.where(verify[d_req], counts[d_req], 1)
    d_req = np.repeat(d_req, reps)
    d_off = np.arange(len(d_req)) - np.repeat(np.cumsum(reps) - reps, reps)
    order = np.argsort(-(batch.num_computed[rows[d_req]] + d_off), kind="stable")
    d_req, d_off = d_req[order], d_off[order]
    m_idx = np.flatnonzero(~(single | verify))
    if shape is None and layout.tiles:
        n_tiles = int(sum(cdiv(int(counts[i]), C) for i in m_idx))
        shape = (bucket(len(d_req), layout.decode_buckets), bucket(n_tiles, layout.tile_buckets))
    elif shape is None:  # packed: R = min(T, max_rows) rows hold every scheduled request
        shape = (bucket(int(counts.sum()), layout.token_buckets),)
    return _Rows(ids, rows, counts, verify, d_req, d_off, m_idx, shape)


@dataclasses.dataclass
class _Placed:
    """The step's per-token arrays and its sample rows, as the builders fill them."""

    token_ids: np.ndarray  # [T]
    from_device: np.ndarray  # [T] the input-batch row to read the token from on the device
    positions: np.ndarray  # [T]
    tok_row: np.ndarray  # [T] each token's input-batch row (-1: padding)
    req_row: np.ndarray  # [R] each request row's input-batch row (-1: padding)
    flat: FlatBatch
    sample_at: list[int] = dataclasses.field(default_factory=list)  # flat token per sample row
    groups: list[SampleGroup] = dataclasses.field(default_factory=list)
    flat_start: dict[str, int] = dataclasses.field(default_factory=dict)  # req -> first token

    @classmethod
    def padded(cls, layout: BatchLayout, key: tuple) -> _Placed:
        T, R, _, _ = layout.dims(key)
        return cls(
            token_ids=np.zeros(T, np.int32),
            from_device=np.full(T, -1, np.int32),
            positions=np.zeros(T, np.int32),
            tok_row=np.full(T, -1, np.int32),
            req_row=np.full(R, -1, np.int32),
            flat=padded_flat_batch(layout, key),
        )

    def sample(self, req_id, row, at, batch: InputBatch, drafts=()) -> None:
        """Request `req_id` (input-batch `row`) samples after the flat tokens `at`."""
        group = SampleGroup(
            req_id, row, len(self.sample_at), len(at), int(batch.generation[row]), list(drafts)
        )
        self.groups.append(group)
        self.sample_at.extend(at)


def _place_decodes(p: _Placed, batch: InputBatch, plan: _Rows, spec: dict) -> None:
    """Decodes: one token each, gathered from the input batch, or from the device when it
    was sampled by the step still in flight; a verification row's drafts after it."""
    d_req, d_off, verify = plan.d_req, plan.d_off, plan.verify
    nd = len(d_req)
    d_rows = plan.rows[d_req]
    pos = batch.num_computed[d_rows] + d_off
    p.tok_row[:nd] = p.req_row[:nd] = d_rows
    on_host = pos < batch.num_tokens[d_rows]
    p.token_ids[:nd] = np.where(
        on_host, batch.token_ids[d_rows, np.minimum(pos, batch.max_model_len - 1)], 0
    )
    p.from_device[:nd] = np.where(on_host | (d_off > 0), -1, d_rows)
    p.positions[:nd] = pos
    fill_decode_rows(p.flat, pos)
    known = batch.num_tokens + batch.num_pending
    verify_at: dict[int, np.ndarray] = {}  # scheduled request -> flat index of each token
    for j in np.flatnonzero(verify[d_req]):
        verify_at.setdefault(int(d_req[j]), np.zeros(plan.counts[d_req[j]], np.int64))
        verify_at[int(d_req[j])][d_off[j]] = j
    for j in np.flatnonzero((pos + 1 == known[d_rows]) & ~verify[d_req]):
        p.sample(plan.ids[d_req[j]], int(d_rows[j]), [int(j)], batch)
    for i, at in verify_at.items():
        r, rid = int(plan.rows[i]), plan.ids[i]
        p.token_ids[at[1:]] = spec[rid]
        if batch.num_computed[r] + 1 == known[r]:
            p.sample(rid, r, at.tolist(), batch, spec[rid])
    # Where each request's tokens start, for prompt logprobs (a request with prompt
    # logprobs left is never a decode of several tokens).
    p.flat_start.update({plan.ids[d_req[j]]: j for j in range(nd) if d_off[j] == 0})


def _place_rows(p: _Placed, batch: InputBatch, plan: _Rows, layout: BatchLayout, spec) -> None:
    """Rows of several tokens (prefill chunks and verification rows): each on whole tiles
    after the Rd decode rows (`layout.tiles`), or packed back to back after the decodes."""
    C = layout.tile_size
    first = layout.dims(plan.shape)[2] if layout.tiles else len(plan.d_req)
    flat, known = p.flat, batch.num_tokens + batch.num_pending
    start, tile = first, 0
    for j, i in enumerate(plan.m_idx):
        r, n, rid = int(plan.rows[i]), int(plan.counts[i]), plan.ids[i]
        nc = int(batch.num_computed[r])
        drafts = spec.get(rid, [])
        k_known = n - len(drafts)
        if nc + k_known > batch.num_tokens[r]:
            raise RuntimeError(f"{rid}: a row of several tokens needs its tokens on the host")
        row = first + j
        pos = np.arange(nc, nc + n, dtype=np.int32)
        p.token_ids[start : start + k_known] = batch.token_ids[r, nc : nc + k_known]
        p.token_ids[start + k_known : start + n] = drafts
        p.positions[start : start + n] = pos
        p.tok_row[start : start + n] = p.req_row[row] = r
        flat.query_start[row], flat.query_lens[row], flat.kv_lens[row] = start, n, nc + n
        p.flat_start[rid] = start
        if nc + k_known == known[r]:
            p.sample(rid, r, list(range(start + k_known - 1, start + n)), batch, drafts)
        if not layout.tiles:
            start += n
            continue
        k = cdiv(n, C)
        flat.tile_row[tile : tile + k] = row
        padded = np.full(k * C, -1, np.int32)
        padded[:n] = pos
        flat.tile_q_pos[tile : tile + k] = padded.reshape(k, C)
        tile += k
        start += k * C


def build_step(
    batch: InputBatch,
    out: SchedulerOutput,
    layout: BatchLayout,
    backend: AttentionBackend,
    shape: tuple | None = None,
    sample_rows: int | None = None,
):
    """Returns (StepInputs and SamplingMetadata in numpy, the sample groups, the forward
    key, the prompt-logprob rows or None). `shape` and `sample_rows` force the forward key
    and the sample-row bucket (warm-up)."""
    plan = _plan_rows(batch, out, layout, shape)
    p = _Placed.padded(layout, plan.shape)
    spec = out.scheduled_spec_decode_tokens
    _place_decodes(p, batch, plan, spec)
    _place_rows(p, batch, plan, layout, spec)

    Rs = sample_rows or bucket(max(len(p.sample_at), 1), layout.sample_buckets)
    logits_indices = np.zeros(layout.logit_rows, np.int32)
    logits_indices[: len(p.sample_at)] = p.sample_at
    md = sampling_metadata(batch, p.groups, Rs, max(1, layout.num_spec_tokens))
    for g in p.groups:
        if g.req_id in out.grammar_bitmask:
            md.masked[g.first : g.first + g.count] = True
    prompt_rows = None
    if batch.prompt_logprobs[plan.rows].any():
        prompt_rows = _prompt_logprob_rows(batch, plan.ids, plan.rows, plan.counts, p.flat_start)
    prompt_lp_indices = (
        np.zeros(PROMPT_LOGPROB_ROWS, np.int32) if prompt_rows is None else prompt_rows.indices
    )
    embed_index = place_images(p, batch, out, layout) if layout.image_tokens else None
    every_group = range(len(batch.block_table))
    attn = group_metadata(
        backend, p.flat, batch, every_group, p.tok_row, p.positions, p.req_row, layout.windows
    )
    lora_slots = np.where(p.tok_row >= 0, batch.lora_slot[p.tok_row], 0).astype(np.int32)
    inputs = StepInputs(
        p.token_ids,
        p.positions,
        logits_indices,
        p.from_device,
        prompt_lp_indices,
        attn,
        lora_slots,
        embed_index,
    )
    return inputs, md, p.groups, plan.shape, prompt_rows


def place_images(p: _Placed, batch: InputBatch, out: SchedulerOutput, layout: BatchLayout):
    """Each token's row in the encoder cache ([T], -1: none) from the slots of the images
    the step's tokens touch (`out.mm_slots`), and with bidirectional images each query's
    horizon (the flat batch's `q_horizon`: an image token's is its image's last token)."""
    P = layout.image_tokens
    index = np.full(len(p.token_ids), -1, np.int32)
    horizon = p.flat.q_horizon
    if horizon is not None:
        horizon[:] = p.positions
    for rid, images in out.mm_slots.items():
        start, r = p.flat_start[rid], batch.index[rid]
        nc, n = int(batch.num_computed[r]), int(out.num_scheduled_tokens[rid])
        pos = np.arange(nc, nc + n)
        for offset, length, slot in images:
            inside = (pos >= offset) & (pos < offset + length)
            at = start + np.flatnonzero(inside)
            index[at] = slot * P + pos[inside] - offset
            if horizon is not None:
                horizon[at] = offset + length - 1
    return index


def grammar_rows(groups: list[SampleGroup], bitmasks: dict, Rs: int, width: int):
    """The step's grammar bitmask [Rs, width] (all ones where a row has no grammar) from the
    rows the engine filled per request, or None when no request has a grammar."""
    if not bitmasks:
        return None
    out = np.full((Rs, width), -1, np.int32)
    for g in groups:
        rows = bitmasks.get(g.req_id)
        if rows is not None:
            out[g.first : g.first + g.count] = rows[: g.count]
    return out


def _prompt_logprob_rows(batch: InputBatch, ids, rows, counts, flat_start):
    """Every computed prompt token but the last predicts the next prompt token."""
    indices, targets, spans = [], [], []
    for rid, r, n in zip(ids, rows, counts, strict=True):
        if not batch.prompt_logprobs[r]:
            continue
        nc = int(batch.num_computed[r])
        end = min(nc + int(n), int(batch.num_prompt[r]) - 1)  # positions nc .. end - 1
        if end <= nc:
            continue
        indices.append(flat_start[rid] + np.arange(end - nc, dtype=np.int32))
        targets.append(batch.token_ids[r, nc + 1 : end + 1])
        spans.append((rid, nc + 1, end - nc))
    if not spans:
        return None
    n = sum(n for _, _, n in spans)
    if n > PROMPT_LOGPROB_ROWS:
        raise RuntimeError("the scheduler let more prompt-logprob tokens into a step than fit")
    padded = np.zeros((2, PROMPT_LOGPROB_ROWS), np.int32)
    padded[0, :n], padded[1, :n] = np.concatenate(indices), np.concatenate(targets)
    return PromptLogprobRows(padded[0], padded[1], spans)


def sampling_metadata(batch: InputBatch, groups: list[SampleGroup], Rs: int, K: int):
    """Every sample row's parameters, gathered from the input batch by row."""
    row = np.full(Rs, batch.pad, np.int32)
    offset = np.zeros(Rs, np.int32)  # j: the group's j-th row samples output index + j
    draft = np.full(Rs, -1, np.int32)
    group_first = np.arange(Rs, dtype=np.int32)
    spec_prev = np.full((Rs, K), NO_TOKEN, np.int32)
    n = sum(g.count for g in groups)
    row[:n] = np.repeat([g.row for g in groups], [g.count for g in groups])
    for g in groups:
        if g.count == 1:  # a decode or a prefill's last chunk: the defaults hold
            continue
        sl = slice(g.first, g.first + g.count)
        offset[sl], group_first[sl] = np.arange(g.count), g.first
        draft[g.first : g.first + len(g.drafts)] = g.drafts
        for t in range(1, g.count):
            spec_prev[g.first + t, :t] = g.drafts[:t]
    counter = batch.num_tokens[row] + batch.num_pending[row] - batch.num_prompt[row] + offset
    under_min = (counter < batch.min_tokens[row])[:, None]
    suppress = np.where(under_min, batch.suppress[row], NO_TOKEN).astype(np.int32)
    for g in groups:
        if g.row in batch.bad_words:
            _mask_bad_words(batch, g, suppress)
    return SamplingMetadata(
        temperature=batch.temperature[row],
        top_p=batch.top_p[row],
        top_k=batch.top_k[row],
        min_p=batch.min_p[row],
        seed_lo=batch.seed_lo[row],
        seed_hi=batch.seed_hi[row],
        counter=counter.astype(np.int32),
        presence=batch.presence[row],
        frequency=batch.frequency[row],
        repetition=batch.repetition[row],
        penalty_rows=batch.penalty_row[row],
        suppress=suppress,
        want_logprobs=batch.want_logprobs[row],
        bias_rows=batch.bias_row[row],
        masked=np.zeros(Rs, bool),
        processors=tuple(
            (active[row], state[row])
            for active, state in zip(batch.proc_active, batch.proc_state, strict=True)
        ),
        batch_row=row,
        draft=draft,
        group_first=group_first,
        spec_prev=spec_prev,
    )


def _mask_bad_words(batch: InputBatch, g: SampleGroup, suppress: np.ndarray) -> None:
    """vLLM's bad words of several tokens: a word's last token is masked where the output so
    far (with the drafts before the sample row) ends with the rest of the word. The masked
    ids fill the row's `suppress` slots from the end (min_tokens ids fill them from the
    start; the processor keeps both within the width)."""
    r = g.row
    if batch.num_pending[r]:
        raise RuntimeError("bad words of several tokens need the output on the host")
    words = batch.bad_words[r]
    longest = max(len(w) for w in words) - 1
    start = max(int(batch.num_prompt[r]), int(batch.num_tokens[r]) - longest)
    recent = batch.token_ids[r, start : batch.num_tokens[r]].tolist()
    for j in range(g.count):
        tail = recent + g.drafts[:j]
        banned = [w[-1] for w in words if tail[len(tail) - len(w) + 1 :] == w[:-1]]
        if banned:
            suppress[g.first + j, suppress.shape[1] - len(banned) :] = banned

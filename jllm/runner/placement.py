"""Where a step's scheduled requests go in the flat batch: rows, tokens, sample rows.

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
row verifying k drafts. Everything is padded: tokens write to the dropped slot B*S, request
rows have kv_len 0. The attention metadata of each KV-cache group is built from the placed
flat batch by `runner/flat_batch.py`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jllm import mrope
from jllm.attention.metadata import FlatBatch
from jllm.runner.buckets import BatchLayout, bucket
from jllm.runner.flat_batch import fill_decode_rows, padded_flat_batch
from jllm.runner.input_batch import InputBatch
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS, SchedulerOutput
from jllm.utils import cdiv


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


@dataclasses.dataclass
class Rows:
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


def plan_rows(batch: InputBatch, out: SchedulerOutput, layout: BatchLayout, shape) -> Rows:
    C = layout.tile_size
    ids = list(out.num_scheduled_tokens)
    rows = np.array([batch.index[r] for r in ids], np.int32)
    counts = np.array(list(out.num_scheduled_tokens.values()), np.int32)
    single = counts == 1
    # With tiles, a verification row (its last token, then its drafts) is laid out as decode
    # rows of one query each, at consecutive positions (each sees the K/V written before it
    # in the step), while they fit the largest decode bucket: in tiles its k + 1 tokens
    # would take C slots. Packed, it is a row like any other, and so it is with per-request
    # state (a linear-attention layer runs a request row's tokens in order from its state).
    spec = out.scheduled_spec_decode_tokens
    verify = np.zeros(len(ids), bool)
    if spec and shape is None and layout.tiles and not layout.has_state:
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
    return Rows(ids, rows, counts, verify, d_req, d_off, m_idx, shape)


@dataclasses.dataclass
class Placed:
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
    def padded(cls, layout: BatchLayout, key: tuple) -> Placed:
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


def place_decodes(p: Placed, batch: InputBatch, plan: Rows, spec: dict) -> None:
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


def place_rows(p: Placed, batch: InputBatch, plan: Rows, layout: BatchLayout, spec) -> None:
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


def rope_positions(p: Placed, batch: InputBatch) -> np.ndarray:
    """[3, T] int32 M-RoPE positions of the step's tokens (jllm/mrope.py): the index plus the
    row's shift past its images, recomputed from the spans where a token is not past them."""
    rows, pos = p.tok_row, p.positions
    live = rows >= 0
    out = np.broadcast_to(pos, (3, len(pos))).copy()
    out[:, live] += batch.mrope_delta[rows[live]]
    need = np.flatnonzero(live)
    need = need[pos[need] < batch.mrope_end[rows[need]]]
    for r in np.unique(rows[need]):
        at = need[rows[need] == r]
        out[:, at] = mrope.rope_positions(pos[at], batch.mrope_spans[int(r)])
    return out


def place_images(p: Placed, batch: InputBatch, out: SchedulerOutput, layout: BatchLayout):
    """Each token's row in the encoder cache ([T], -1: none) from the pages of the images
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
        for offset, length, pages in images:
            inside = (pos >= offset) & (pos < offset + length)
            at = start + np.flatnonzero(inside)
            j = pos[inside] - offset
            index[at] = np.asarray(pages, np.int32)[j // P] * P + j % P
            if horizon is not None:
                horizon[at] = offset + length - 1
    return index


def prompt_logprob_rows(batch: InputBatch, ids, rows, counts, flat_start):
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

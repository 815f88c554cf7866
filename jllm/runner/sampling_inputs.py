"""A step's sampling inputs, gathered from the input batch by sample row: the sampler's
metadata (`runner/sampler.py:SamplingMetadata`: parameters, PRNG seeds and counters,
min_tokens and bad-word suppression, draft verification), and the grammar bitmask rows.
"""

from __future__ import annotations

import numpy as np

from jllm.runner.input_batch import NO_TOKEN, InputBatch
from jllm.runner.placement import SampleGroup
from jllm.runner.sampler import SamplingMetadata


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
        want_top=batch.want_top[row],
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

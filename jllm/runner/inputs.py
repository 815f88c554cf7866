"""Build one step's device inputs from the persistent input batch and a `SchedulerOutput`,
in numpy, padded to buckets: where each request goes (`runner/placement.py`), each KV-cache
group's attention metadata (`runner/flat_batch.py`), the sampling inputs
(`runner/sampling_inputs.py`), all within the shapes of the bucket policy
(`runner/buckets.py`). The forward gathers the hidden states of `logit_rows` tokens
whatever its key, and the sampler's executable takes the first Rs.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np

from jllm.attention import AttentionBackend
from jllm.runner.buckets import BatchLayout, bucket
from jllm.runner.flat_batch import group_metadata
from jllm.runner.input_batch import InputBatch
from jllm.runner.placement import (
    Placed,
    place_decodes,
    place_images,
    place_rows,
    plan_rows,
    prompt_logprob_rows,
    rope_positions,
)
from jllm.runner.sampling_inputs import sampling_metadata
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS, SchedulerOutput


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
        "embeds",
        "embeds_mask",
        "next_tokens",
        "mrope_positions",
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
    # [T, D] float32 and [T] with enable_prompt_embeds: the embedding row each token slot
    # takes instead of its token's, where the mask is set (an embeddings prompt's
    # positions); None otherwise
    embeds: jax.Array | None = None
    embeds_mask: jax.Array | None = None
    # [T] with an MTP draft: each token's successor in its request (the next token of the
    # step, or of the prompt past the chunk; 0 where it is yet to be sampled); else None
    next_tokens: jax.Array | None = None
    # [3, T] with M-RoPE (Qwen-VL): each token's rotary positions (time, height, width), which
    # `positions` (the sequence index, what attention and the cache read) is not
    mrope_positions: jax.Array | None = None


def successors(p: Placed, batch: InputBatch) -> np.ndarray:
    """[T] int32: each placed token's successor in its request (`StepInputs.next_tokens`).
    A row's tokens sit at consecutive positions, though not always side by side (a
    verification row's tokens are decode rows, sorted by context length)."""
    out = np.zeros(len(p.token_ids), np.int32)
    placed = np.flatnonzero(p.tok_row >= 0)
    if placed.size == 0:
        return out
    row, pos = p.tok_row[placed], p.positions[placed]
    order = np.lexsort((pos, row))
    at, row, pos = placed[order], row[order], pos[order]
    follows = (row[1:] == row[:-1]) & (pos[1:] == pos[:-1] + 1)
    out[at[:-1][follows]] = p.token_ids[at[1:][follows]]
    last = np.append(~follows, True)  # each row's last token of the step
    at, row, pos = at[last], row[last], pos[last]
    known = pos + 1 < batch.num_tokens[row]  # a chunk that stops inside the prompt
    out[at[known]] = batch.token_ids[row[known], pos[known] + 1]
    return out


def build_step(
    batch: InputBatch,
    out: SchedulerOutput,
    layout: BatchLayout,
    backend: AttentionBackend,
    shape: tuple | None = None,
    sample_rows: int | None = None,
):
    """Returns (StepInputs and SamplingMetadata in numpy, the sample groups, the forward
    key, the prompt-logprob rows or None, each token's input-batch row [T] (-1: padding)).
    `shape` and `sample_rows` force the forward key and the sample-row bucket (warm-up, and
    the data shards of one step: runner/data_parallel.py)."""
    placed = place_step(batch, out, layout, shape)
    return finish_step(batch, out, layout, backend, placed, sample_rows)


def place_step(batch: InputBatch, out: SchedulerOutput, layout: BatchLayout, shape=None):
    """Where each scheduled token goes, in the forward key `shape` (None: the smallest that
    holds the step) -> (the rows' plan, the placement)."""
    plan = plan_rows(batch, out, layout, shape)
    p = Placed.padded(layout, plan.shape)
    spec = out.scheduled_spec_decode_tokens
    place_decodes(p, batch, plan, spec)
    place_rows(p, batch, plan, layout, spec)
    return plan, p


def sample_bucket(placed, layout: BatchLayout) -> int:
    """The sample-row bucket a placed step needs."""
    return bucket(max(len(placed[1].sample_at), 1), layout.sample_buckets)


def finish_step(
    batch: InputBatch,
    out: SchedulerOutput,
    layout: BatchLayout,
    backend: AttentionBackend,
    placed,
    sample_rows: int | None = None,
):
    """`build_step`'s result from a `place_step` placement, with `sample_rows` sample rows
    (None: the bucket it needs)."""
    plan, p = placed
    Rs = sample_rows or sample_bucket(placed, layout)
    logits_indices = np.zeros(layout.logit_rows, np.int32)
    logits_indices[: len(p.sample_at)] = p.sample_at
    md = sampling_metadata(batch, p.groups, Rs, max(1, layout.num_spec_tokens))
    for g in p.groups:
        if g.req_id in out.grammar_bitmask:
            md.masked[g.first : g.first + g.count] = True
    prompt_rows = None
    if batch.prompt_logprobs[plan.rows].any():
        prompt_rows = prompt_logprob_rows(batch, plan.ids, plan.rows, plan.counts, p.flat_start)
    prompt_lp_indices = (
        np.zeros(PROMPT_LOGPROB_ROWS, np.int32) if prompt_rows is None else prompt_rows.indices
    )
    embed_index = place_images(p, batch, out, layout) if layout.image_tokens else None
    embeds = embeds_mask = None
    if layout.embeds_dim:
        embeds = np.zeros((len(p.token_ids), layout.embeds_dim), np.float32)
        embeds_mask = np.zeros(len(p.token_ids), bool)
        for rid, rows in out.prompt_embeds.items():
            start = p.flat_start[rid]
            embeds[start : start + len(rows)] = rows
            embeds_mask[start : start + len(rows)] = True
    next_tokens = successors(p, batch) if layout.next_tokens else None
    every_group = range(len(batch.block_table))
    attn = group_metadata(
        backend, p.flat, batch, every_group, p.tok_row, p.positions, p.req_row, layout.group_fields
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
        embeds,
        embeds_mask,
        next_tokens,
        rope_positions(p, batch) if layout.mrope else None,
    )
    return inputs, md, p.groups, plan.shape, prompt_rows, p.tok_row

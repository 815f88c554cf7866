"""On-device sampling, in vLLM's order and with vLLM's semantics.

grammar bitmask (structured outputs) -> raw logprobs (returned when asked) -> masks and
bias: min_tokens suppression and bad words of several tokens (per-step ids),
allowed_token_ids, bad words of one token and logit_bias
(the request's fixed bias row, `runner/logit_bias.py`) -> custom logits processors
(`jllm/logits_process.py`) -> repetition / frequency / presence penalties -> greedy argmax,
or temperature -> argmax-invariant custom processors -> min_p -> top_k -> top_p -> draw.
The draw (`runner/draw.py`) is an exponential race keyed by the sequence's seed and output
index, so a seeded request produces the same text whatever else shares its batch, whatever
its bucket, prefix-cache hits, chunking or preemption.

One executable per row bucket: the passes a batch needs are chosen on device (lax.cond).

A request verifying k draft tokens has k+1 consecutive sample rows (a group), row j sampled
with output index `counter + j` after drafts 0..j-1 (which count for its penalties). A row's
token is emitted when every earlier row of its group sampled exactly its draft: for a
deterministic draft this is exact rejection sampling (accept with probability p(draft), else
a token from p without the draft), and a seeded request draws the same tokens with and
without drafts. The emitted tokens are added to the penalty counts here.

The result comes back as one int32 array [R, 4 + 2J] (one device-to-host fetch): token,
logprob (float32 bits), rank, emitted, J top ids, J top logprobs (float32 bits).

Glossary: R sample rows, V vocab, M suppressed ids per row, K drafts per group, J logprobs
returned.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jllm.runner.draw import filtered_draw, first_argmax, kept_tokens, row_keys
from jllm.sampling_params import SAMPLING_EPS


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed_lo",
        "seed_hi",
        "counter",
        "presence",
        "frequency",
        "repetition",
        "penalty_rows",
        "suppress",
        "want_logprobs",
        "want_top",
        "bias_rows",
        "masked",
        "processors",
        "batch_row",
        "draft",
        "group_first",
        "spec_prev",
    ],
    meta_fields=[],
)
@dataclasses.dataclass
class SamplingMetadata:
    temperature: jax.Array  # [R] float32
    top_p: jax.Array  # [R] float32
    top_k: jax.Array  # [R] int32, 0 = off
    min_p: jax.Array  # [R] float32
    seed_lo: jax.Array  # [R] uint32
    seed_hi: jax.Array  # [R] uint32
    counter: jax.Array  # [R] int32, index of the token being sampled
    presence: jax.Array  # [R] float32
    frequency: jax.Array  # [R] float32
    repetition: jax.Array  # [R] float32
    penalty_rows: jax.Array  # [R] int32, row in the penalty state (0: none)
    suppress: jax.Array  # [R, M] int32 token ids to mask (min_tokens), >= V for none
    want_logprobs: jax.Array  # [R] bool
    want_top: jax.Array  # [R] bool: top logprobs beyond the sampled token's (logprobs > 0)
    bias_rows: jax.Array  # [R] int32, row in the logit-bias table (0: none)
    masked: jax.Array  # [R] bool, the row has a grammar bitmask (structured outputs)
    # per custom logits processor: (active [R] bool, state [R, ...]) (jllm/logits_process.py)
    processors: tuple
    batch_row: jax.Array  # [R] int32, the input-batch row the sample row belongs to
    draft: jax.Array  # [R] int32, the draft this row verifies; -1: none (a group's last row)
    group_first: jax.Array  # [R] int32, the first row of this row's group
    spec_prev: jax.Array  # [R, K] int32, the group's drafts before this row; >= V for none


def _apply_penalties(logits, md: SamplingMetadata, counts, prompt_mask):
    c = counts[md.penalty_rows]  # [R, V] int32 occurrences in the output
    rows = jnp.arange(c.shape[0])[:, None]
    c = c.at[rows, md.spec_prev].add(1, mode="drop")  # a group's earlier drafts
    seen = (c > 0) | prompt_mask[md.penalty_rows]  # [R, V]
    rep = md.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency[:, None] * c.astype(jnp.float32)
    return logits - md.presence[:, None] * (c > 0).astype(jnp.float32)


def _apply_bitmask(logits, bitmask):
    """Structured outputs: tokens whose bit is clear in the row's packed bitmask
    [R, ceil(V / 32)] (bit j of word i: token 32 i + j) get -inf."""
    R, V = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(R, -1)[:, :V] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def emitted_rows(tokens, md: SamplingMetadata):
    """[R] bool: every earlier row of the row's group sampled its draft."""
    mismatch = (tokens != md.draft).astype(jnp.int32)
    before = jnp.cumsum(mismatch) - mismatch  # mismatches in the rows before, batch-wide
    return before == before[md.group_first]


def _as_int32(x):
    return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)


def _apply_processors(logits, md: SamplingMetadata, processors, argmax_invariant: bool):
    for proc, (active, state) in zip(processors, md.processors, strict=True):
        if proc.is_argmax_invariant() == argmax_invariant:
            logits = jax.lax.cond(
                jnp.any(active),
                lambda x, st, act, p=proc: (
                    p.apply(x, st, act, md.counter) if p.uses_output_index else p.apply(x, st, act)
                ),
                lambda x, st, act: x,
                logits,
                state,
                active,
            )
    return logits


@partial(
    jax.jit,
    static_argnames=("num_logprobs", "logits_processors", "logprobs_mode"),
    donate_argnames=("counts", "last_tokens"),
)
def sample(
    logits,
    md: SamplingMetadata,
    counts,
    prompt_mask,
    bias,
    last_tokens,
    bitmask,
    *,
    num_logprobs,
    logits_processors=(),
    logprobs_mode="raw_logprobs",
):
    """logits [R, V], the penalty state (counts, prompt_mask [P, V]), the logit-bias table
    (bias [P, V]), the grammar bitmask [R, ceil(V / 32)] (read for `md.masked` rows) ->
    (packed result [R, 4 + 2J] int32, counts with the emitted tokens,
    last_tokens [batch rows] with each row's last emitted token, for the next step to read
    on the device).

    Which passes run (penalties, sampling, top-k/top-p, logprobs) is decided on device from
    the batch with lax.cond, so one executable per row bucket serves every mix of requests.

    `logprobs_mode` (vLLM's): what the returned logprobs are: "raw_logprobs" (log-softmax of
    the model's logits, the grammar mask only), "raw_logits", or "processed_logprobs" /
    "processed_logits": after bias, processors and penalties, then for a sampled row its
    temperature with the tokens top-k, top-p and min-p drop at -inf (what it drew from).
    """
    logits = logits.astype(jnp.float32)
    R, V = logits.shape
    # The grammar mask comes first: logprobs are those of the masked logits, as in vLLM.
    logits = jax.lax.cond(
        jnp.any(md.masked), lambda x: _apply_bitmask(x, bitmask), lambda x: x, logits
    )
    rows = jnp.arange(R)[:, None]
    processed = logits.at[rows, md.suppress].set(-jnp.inf, mode="drop")
    processed = jax.lax.cond(
        jnp.any(md.bias_rows > 0), lambda x: x + bias[md.bias_rows], lambda x: x, processed
    )
    processed = _apply_processors(processed, md, logits_processors, argmax_invariant=False)
    processed = jax.lax.cond(
        jnp.any(md.penalty_rows > 0),
        lambda x: _apply_penalties(x, md, counts, prompt_mask),
        lambda x: x,
        processed,
    )
    greedy = first_argmax(processed)
    greedy_row = md.temperature < SAMPLING_EPS

    def sampled():
        temp = jnp.where(greedy_row, 1.0, md.temperature)
        scaled = processed / temp[:, None]
        scaled = _apply_processors(scaled, md, logits_processors, argmax_invariant=True)
        probs = jax.nn.softmax(scaled, axis=-1)
        keys = row_keys(md.seed_lo, md.seed_hi, md.counter)
        drawn = filtered_draw(probs, md.top_k, md.top_p, md.min_p, ~greedy_row, keys)
        return jnp.where(greedy_row, greedy, drawn)

    tokens = jax.lax.cond(jnp.all(greedy_row), lambda: greedy, sampled)

    def processed_logits():
        temp = jnp.where(greedy_row, 1.0, md.temperature)
        scaled = processed / temp[:, None]
        scaled = _apply_processors(scaled, md, logits_processors, argmax_invariant=True)
        kept = kept_tokens(jax.nn.softmax(scaled, axis=-1), md.top_k, md.top_p, md.min_p)
        return jnp.where(greedy_row[:, None], processed, jnp.where(kept, scaled, -jnp.inf))

    def logprobs():
        # What logprobs_mode reports is `values` less a per-row shift (log-softmax: the
        # row's logsumexp), so ranks and the top entries are those of `values`, and the
        # [R, V] log-softmax is never written out: one reduction instead.
        values = logits if logprobs_mode.startswith("raw") else processed_logits()
        shift = jnp.zeros((R,), jnp.float32)
        if logprobs_mode.endswith("logprobs"):
            shift = jax.nn.logsumexp(values, axis=-1)
        token_v = jnp.take_along_axis(values, tokens[:, None], axis=-1)[:, 0]  # [R]
        rank = jnp.sum(values > token_v[:, None], axis=-1).astype(jnp.int32) + 1

        def top():  # only when a row asks for more than its own token's logprob
            top_v, top_ids = jax.lax.top_k(values, num_logprobs)  # [R, J]
            return top_v - shift[:, None], top_ids.astype(jnp.int32)

        def no_top():
            return jnp.zeros((R, num_logprobs), jnp.float32), jnp.zeros(
                (R, num_logprobs), jnp.int32
            )

        top_lp, top_ids = jax.lax.cond(jnp.any(md.want_logprobs & md.want_top), top, no_top)
        return token_v - shift, rank, top_ids, top_lp

    def no_logprobs():
        return (
            jnp.zeros((R,), jnp.float32),
            jnp.zeros((R,), jnp.int32),
            jnp.zeros((R, num_logprobs), jnp.int32),
            jnp.zeros((R, num_logprobs), jnp.float32),
        )

    token_lp, rank, top_ids, top_lp = jax.lax.cond(jnp.any(md.want_logprobs), logprobs, no_logprobs)
    emitted = emitted_rows(tokens, md)
    counted = jnp.where(emitted & (md.penalty_rows > 0), md.penalty_rows, counts.shape[0])
    counts = counts.at[counted, tokens].add(1, mode="drop")
    # The group's last emitted row: emitted, and the next row is not an emitted row of it.
    next_same = jnp.concatenate([md.group_first[1:] == md.group_first[:-1], jnp.zeros(1, bool)])
    next_emitted = jnp.concatenate([emitted[1:], jnp.zeros(1, bool)]) & next_same
    last_rows = jnp.where(emitted & ~next_emitted, md.batch_row, last_tokens.shape[0])
    last_tokens = last_tokens.at[last_rows].set(tokens, mode="drop")
    columns = [tokens[:, None], token_lp[:, None], rank[:, None], emitted[:, None], top_ids]
    packed = jnp.concatenate(
        [_as_int32(c.astype(jnp.int32) if c.dtype == jnp.bool_ else c) for c in columns]
        + [_as_int32(top_lp)],
        axis=1,
    )
    # Under a mesh (the runner lowers inside `jax.set_mesh`) every process gets the whole
    # result, which process 0 reads back.
    if not jax.sharding.get_abstract_mesh().empty:
        replicated = jax.sharding.PartitionSpec()
        packed = jax.lax.with_sharding_constraint(packed, replicated)
        counts = jax.lax.with_sharding_constraint(counts, replicated)
        last_tokens = jax.lax.with_sharding_constraint(last_tokens, replicated)
    return packed, counts, last_tokens


def pooled_result(hidden, rows: int, num_logprobs: int):
    """A pooling model's step (jllm/pooling): no LM head and no sampler. The packed result
    of `sample`'s layout for `rows` rows, each emitting a placeholder token (0) that ends its
    request, then the row's hidden state [D] as float32 bits (read by `unpack_pooled`)."""
    J = num_logprobs
    states = hidden[:rows].astype(jnp.float32)
    packed = jnp.concatenate(
        [
            jnp.zeros((rows, 3), jnp.int32),
            jnp.ones((rows, 1), jnp.int32),
            jnp.zeros((rows, 2 * J), jnp.int32),
            _as_int32(states),
        ],
        axis=1,
    )
    if not jax.sharding.get_abstract_mesh().empty:
        packed = jax.lax.with_sharding_constraint(packed, jax.sharding.PartitionSpec())
    return packed


def unpack_pooled(packed: np.ndarray, num_logprobs: int) -> np.ndarray:
    """[R, D] float32: the hidden states of `pooled_result`."""
    return packed[:, 4 + 2 * num_logprobs :].view(np.float32)


def unpack_result(packed: np.ndarray, num_logprobs: int):
    """Host side of the packed result: tokens, logprobs, ranks, emitted, top ids, top lps."""
    J = num_logprobs
    return (
        packed[:, 0],
        packed[:, 1].view(np.float32),
        packed[:, 2],
        packed[:, 3] != 0,
        packed[:, 4 : 4 + J],
        packed[:, 4 + J : 4 + 2 * J].view(np.float32),
    )

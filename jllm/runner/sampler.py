"""On-device sampling, in vLLM's order and with vLLM's semantics.

raw logprobs (returned when asked) -> min_tokens suppression -> repetition / frequency /
presence penalties -> greedy argmax, or temperature -> min_p -> top_k -> top_p -> draw.
The draw (`runner/draw.py`) is an exponential race keyed by the sequence's seed and output
index, so a seeded request produces the same text whatever else shares its batch, whatever
its bucket, prefix-cache hits, chunking or preemption.

One executable per row bucket: the passes a batch needs are chosen on device (lax.cond).

Glossary: R requests, V vocab, M suppressed ids per request, J logprobs returned.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jllm.runner.draw import filtered_draw, first_argmax, row_keys
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
    suppress: jax.Array  # [R, M] int32 token ids to mask (min_tokens), V for none
    want_logprobs: jax.Array  # [R] bool


def _apply_penalties(logits, md: SamplingMetadata, counts, prompt_mask):
    c = counts[md.penalty_rows]  # [R, V] int32 occurrences in the output
    seen = (c > 0) | prompt_mask[md.penalty_rows]  # [R, V]
    rep = md.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency[:, None] * c.astype(jnp.float32)
    return logits - md.presence[:, None] * (c > 0).astype(jnp.float32)


@partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits, md: SamplingMetadata, counts, prompt_mask, *, num_logprobs):
    """logits [R, V] -> tokens [R], sampled logprob [R], rank [R], top ids/logprobs [R, J].

    Which passes run (penalties, sampling, top-k/top-p, logprobs) is decided on device from
    the batch with lax.cond, so one executable per row bucket serves every mix of requests.
    """
    logits = logits.astype(jnp.float32)
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    processed = logits.at[rows, md.suppress].set(-jnp.inf, mode="drop")
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
        probs = jax.nn.softmax(processed / temp[:, None], axis=-1)
        keys = row_keys(md.seed_lo, md.seed_hi, md.counter)
        drawn = filtered_draw(probs, md.top_k, md.top_p, md.min_p, ~greedy_row, keys)
        return jnp.where(greedy_row, greedy, drawn)

    tokens = jax.lax.cond(jnp.all(greedy_row), lambda: greedy, sampled)

    def logprobs():
        raw = jax.nn.log_softmax(logits, axis=-1)  # [R, V]
        token_lp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]  # [R]
        rank = jnp.sum(raw > token_lp[:, None], axis=-1).astype(jnp.int32) + 1
        top_lp, top_ids = jax.lax.top_k(raw, num_logprobs)  # [R, J]
        return token_lp, rank, top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        return (
            jnp.zeros((R,), jnp.float32),
            jnp.zeros((R,), jnp.int32),
            jnp.zeros((R, num_logprobs), jnp.int32),
            jnp.zeros((R, num_logprobs), jnp.float32),
        )

    out = (tokens, *jax.lax.cond(jnp.any(md.want_logprobs), logprobs, no_logprobs))
    # Under a mesh (the runner lowers inside `jax.set_mesh`) every process gets the whole
    # result, which process 0 reads back.
    if not jax.sharding.get_abstract_mesh().empty:
        out = jax.lax.with_sharding_constraint(out, jax.sharding.PartitionSpec())
    return out

"""Prompt logprobs (vLLM's `prompt_logprobs`): the raw log-softmax at prompt positions.

When a step computes prompt tokens of a request that asked for prompt logprobs, the host
lists the flat indices of those tokens (at most `PROMPT_LOGPROB_ROWS` per step: the
scheduler caps such chunks) and the id of the prompt token each one predicts (the next one:
for the last token of a chunk it is in the next chunk, which the host has). The forward
gathers the hidden states of the listed tokens into a fixed [PROMPT_LOGPROB_ROWS, D] output,
whatever the bucket, so this executable has one shape and compiles once at start-up; steps
without such requests never run it. Per listed token it returns the logprob and rank of the
target and the J most likely ids, as one int32 array [P, 2 + 2J]: target logprob (float32
bits), rank, J top ids, J top logprobs (float32 bits).

Glossary: P = PROMPT_LOGPROB_ROWS, D hidden size, V vocab, J logprobs returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.config import batch_invariant


def _as_int32(x):
    return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)


def _prompt_logprobs_step(state, hidden, targets, *, graphdef, num_logprobs, logits_sharding):
    """hidden [P, D] gathered by the forward, targets [P] -> [P, 2 + 2J]."""
    model = nnx.merge(graphdef, state)
    logits = model.compute_logits(hidden)  # [P, V] float32
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    # The sampler's formula (runner/sampler.py): a logit less its row's logsumexp, so a
    # token's prompt logprob and its sampled logprob are the same bits where the logits are.
    shift = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [P, 1]
    value = jnp.take_along_axis(logits, targets[:, None], axis=-1)  # [P, 1]
    lp = value - shift
    rank = jnp.sum(logits > value, axis=-1, keepdims=True).astype(jnp.int32) + 1
    top_v, top_ids = jax.lax.top_k(logits, num_logprobs)
    top_lp = top_v - shift
    packed = jnp.concatenate(
        [_as_int32(lp), rank, top_ids.astype(jnp.int32), _as_int32(top_lp)], axis=1
    )
    if not jax.sharding.get_abstract_mesh().empty:
        packed = jax.lax.with_sharding_constraint(packed, jax.sharding.PartitionSpec())
    return packed


# `invariant` (batch_invariant.keyed): the batch-invariant mode the step is traced in.
prompt_logprobs_step = jax.jit(
    batch_invariant.keyed(_prompt_logprobs_step),
    static_argnames=("graphdef", "num_logprobs", "logits_sharding", "invariant"),
)


def unpack(packed: np.ndarray, num_logprobs: int):
    J = num_logprobs
    return (
        packed[:, 0].view(np.float32),
        packed[:, 1],
        packed[:, 2 : 2 + J],
        packed[:, 2 + J : 2 + 2 * J].view(np.float32),
    )

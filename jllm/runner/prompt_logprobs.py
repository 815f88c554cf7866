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

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _as_int32(x):
    return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "num_logprobs", "logits_sharding"))
def prompt_logprobs_step(state, hidden, targets, *, graphdef, num_logprobs, logits_sharding):
    """hidden [P, D] gathered by the forward, targets [P] -> [P, 2 + 2J]."""
    model = nnx.merge(graphdef, state)
    logits = model.compute_logits(hidden)  # [P, V] float32
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    raw = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(raw, targets[:, None], axis=-1)  # [P, 1]
    rank = jnp.sum(raw > lp, axis=-1, keepdims=True).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(raw, num_logprobs)
    packed = jnp.concatenate(
        [_as_int32(lp), rank, top_ids.astype(jnp.int32), _as_int32(top_lp)], axis=1
    )
    if not jax.sharding.get_abstract_mesh().empty:
        packed = jax.lax.with_sharding_constraint(packed, jax.sharding.PartitionSpec())
    return packed


def unpack(packed: np.ndarray, num_logprobs: int):
    J = num_logprobs
    return (
        packed[:, 0].view(np.float32),
        packed[:, 1],
        packed[:, 2 : 2 + J],
        packed[:, 2 + J : 2 + 2 * J].view(np.float32),
    )

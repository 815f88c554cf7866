"""A request's fixed logits bias on the device: `logit_bias`, `allowed_token_ids` and the bad
words of one token, as one dense float32 row [V] per request that has any of them.

The row is built on the host and written once, when the request is admitted (new, or resumed
after a preemption), to row `r + 1` of the table for input-batch row r; row 0 stays zero for
the others, and the sampler adds `bias[row]` to the logits only when some row in the batch
has one. Masks are -inf entries: tokens outside `allowed_token_ids` and banned words. Bad
words of several tokens depend on what was just generated and are masked per step instead
(`runner/inputs.py`, through the sampler's `suppress` ids).

The write is one jitted row update (the row index is traced), compiled at start-up.
"""

from __future__ import annotations

import jax
import numpy as np

from jllm.sampling_params import SamplingParams


def bias_vector(params: SamplingParams, vocab_size: int) -> np.ndarray:
    """The [V] float32 row of a request (vLLM's order: the allowed-token mask and bad words,
    then the additive bias; -inf stays -inf)."""
    v = np.zeros(vocab_size, np.float32)
    if params.allowed_token_ids is not None:
        v[:] = -np.inf
        v[np.asarray(params.allowed_token_ids, np.int64)] = 0.0
    for word in params.bad_words_token_ids:
        if len(word) == 1:
            v[word[0]] = -np.inf
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias, np.int64)
        v[ids] += np.fromiter(params.logit_bias.values(), np.float32)
    return v


def _write(bias, row, vector):
    return bias.at[row].set(vector)


write_bias = jax.jit(_write, donate_argnames=("bias",))

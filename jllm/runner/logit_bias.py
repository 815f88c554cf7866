"""A request's fixed logits bias on the device: `logit_bias`, `allowed_token_ids` and the bad
words of one token, as one dense float32 row [V] per request that has any of them.

The row is built on the host and written once, when the request is admitted (new, or resumed
after a preemption), to row `r + 1` of the table for input-batch row r; row 0 stays zero for
the others, and the sampler adds `bias[row]` to the logits only when some row in the batch
has one. Masks are -inf entries: tokens outside `allowed_token_ids` and banned words. Bad
words of several tokens depend on what was just generated and are masked per step instead
(`runner/sampling_inputs.py`, through the sampler's `suppress` ids).

`LogitBiasTable` is the runner manager (`runner/manager.py`) that owns the table. The write
is one jitted row update (the row index is traced), compiled at start-up; on the wire a
write is its row and its vector.
"""

from __future__ import annotations

import jax
import numpy as np

from jllm.distributed.codec import expect_array, expect_indexed, expect_list
from jllm.runner.manager import RunnerManager
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


class LogitBiasTable(RunnerManager):
    """The table [rows, V] on the device and its row writes ((row, vector) each)."""

    name = "bias"

    def __init__(self, num_rows: int, vocab_size: int, sharding, rows_sharding=None) -> None:
        """`sharding`: the writes'; `rows_sharding` (default: the same) the table's (split
        by data shard under data parallelism)."""
        self.num_rows, self.vocab_size, self.sharding = num_rows, vocab_size, sharding
        rows_sharding = sharding if rows_sharding is None else rows_sharding
        self.bias = jax.device_put(np.zeros((num_rows, vocab_size), np.float32), rows_sharding)

    def _put(self, row: int, vector: np.ndarray):
        return jax.device_put((np.int32(row), vector), self.sharding)

    def _executable(self, table, row, vector):
        return table.get("logit-bias write", None, lambda: write_bias.lower(self.bias, row, vector))

    def compile_all(self, runner) -> None:
        self._executable(runner.table, *self._put(0, np.zeros(self.vocab_size, np.float32)))

    def apply(self, runner, writes) -> None:
        for row, vector in writes:
            row, vector = self._put(row, vector)
            self.bias = self._executable(runner.table, row, vector)(self.bias, row, vector)

    def encode(self, writes) -> list:
        return [[int(row), vector] for row, vector in writes]

    def decode(self, wire) -> list:
        writes = []
        for w in expect_list(wire, "the logit-bias writes"):
            row, vector = expect_indexed(w, "a logit-bias write", 1, self.num_rows)
            writes.append(
                (row, expect_array(vector, "float32", 1, "a logit bias", (self.vocab_size,)))
            )
        return writes

    def device_arrays(self, runner) -> list:
        return [self.bias]

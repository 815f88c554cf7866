"""Penalty state: per-sequence token counts and prompt masks on device, written at admission.

Each sequence with a penalty holds a row of `counts` [rows, V] (occurrences of each token in
its output) and `prompt_mask` [rows, V] (tokens of its prompt): row `r + 1` for input-batch
row r; row 0 stays empty for the others. When a sequence is admitted (new, or resumed after
preemption) its whole row is written from the host: the prompt into the mask, the output so
far into the counts. After that the sampler adds the tokens it emits (`runner/sampler.py`).
So the state never depends on which tokens a step computed: a prefix-cache hit or a chunked
prefill leaves it the same, and penalties work with prefix caching.

`PenaltyState` is the runner manager (`runner/manager.py`) that owns both arrays. The write
is one small jitted scatter per length bucket (powers of two up to the context length),
compiled with the other buckets at start-up; its wire form is the four arrays of each write.

Glossary: W tokens written, A rows reset, V vocab.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jllm.distributed.codec import MalformedMessage, expect_array, expect_list
from jllm.runner.buckets import bucket, pow2_buckets
from jllm.runner.manager import RunnerManager


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["reset_rows", "rows", "tokens", "is_output"],
    meta_fields=[],
)
@dataclasses.dataclass
class PenaltyWrite:
    reset_rows: jax.Array  # [A] rows to clear; out of range: none
    rows: jax.Array  # [W] row of each written token; out of range: none
    tokens: jax.Array  # [W]
    is_output: jax.Array  # [W] an output token (counts) or a prompt token (mask)


def _write(counts, prompt_mask, w: PenaltyWrite):
    counts = counts.at[w.reset_rows].set(0, mode="drop")
    prompt_mask = prompt_mask.at[w.reset_rows].set(False, mode="drop")
    out_rows = jnp.where(w.is_output, w.rows, counts.shape[0])
    counts = counts.at[out_rows, w.tokens].add(1, mode="drop")
    prompt_rows = jnp.where(w.is_output, counts.shape[0], w.rows)
    prompt_mask = prompt_mask.at[prompt_rows, w.tokens].set(True, mode="drop")
    return counts, prompt_mask


write_step = jax.jit(_write, donate_argnames=("counts", "prompt_mask"))


class PenaltyState(RunnerManager):
    """The penalty rows on the device, and the admission writes that fill them, in buckets
    of tokens."""

    name = "penalties"

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
        sharding,
        shards: int = 1,
        rows_sharding=None,
    ):
        """`sharding`: the writes'; `rows_sharding` (default: the same) the rows'. With
        data parallelism (`shards` > 1) each shard has its own `rows_per_shard` rows, side by
        side on the data axis; a write names rows of the whole array."""
        self.rows_per_shard = max_num_seqs + 1
        self.num_rows = shards * self.rows_per_shard
        self.write_buckets = pow2_buckets(max(16, max_model_len), 16)
        self.max_resets = shards * max_num_seqs
        self.sharding = sharding
        rows_sharding = sharding if rows_sharding is None else rows_sharding
        shape = (self.num_rows, vocab_size)
        self.counts = jax.device_put(np.zeros(shape, np.int32), rows_sharding)
        self.prompt_mask = jax.device_put(np.zeros(shape, np.bool_), rows_sharding)

    def admit(self, admitted) -> list[PenaltyWrite]:
        """Writes for the admitted sequences with penalties (`admitted`: (penalty row, prompt
        ids, output ids) triples), of at most the largest bucket each."""
        resets, rows, tokens, is_out = [], [], [], []
        for row, prompt, output in admitted:
            ids = [*prompt, *output]
            resets.append(row)
            rows.append(np.full(len(ids), row, np.int32))
            tokens.append(np.asarray(ids, np.int32))
            is_out.append(np.arange(len(ids)) >= len(prompt))
        if not resets:
            return []
        rows, tokens, is_out = (np.concatenate(x) for x in (rows, tokens, is_out))
        writes, biggest = [], self.write_buckets[-1]
        for lo in range(0, len(rows), biggest):
            n = min(biggest, len(rows) - lo)
            w = self.empty_write(bucket(n, self.write_buckets))
            w.rows[:n], w.tokens[:n], w.is_output[:n] = (
                x[lo : lo + n] for x in (rows, tokens, is_out)
            )
            if not writes:  # every reset before any token is written
                w.reset_rows[: len(resets)] = resets
            writes.append(w)
        return writes

    def empty_write(self, W: int) -> PenaltyWrite:
        """A write of bucket W that changes nothing (all rows out of range)."""
        return PenaltyWrite(
            np.full(self.max_resets, self.num_rows, np.int32),
            np.full(W, self.num_rows, np.int32),
            np.zeros(W, np.int32),
            np.zeros(W, bool),
        )

    def _executable(self, table, w: PenaltyWrite):
        return table.get(
            "penalty write",
            w.rows.shape[0],
            lambda: write_step.lower(self.counts, self.prompt_mask, w),
        )

    def compile_all(self, runner) -> None:
        for W in self.write_buckets:
            self._executable(runner.table, jax.device_put(self.empty_write(W), self.sharding))

    def apply(self, runner, writes: list[PenaltyWrite]) -> None:
        for w in writes:
            w = jax.device_put(w, self.sharding)
            exe = self._executable(runner.table, w)
            self.counts, self.prompt_mask = exe(self.counts, self.prompt_mask, w)

    def encode(self, writes: list[PenaltyWrite]) -> list:
        return [[w.reset_rows, w.rows, w.tokens, w.is_output] for w in writes]

    def decode(self, wire) -> list[PenaltyWrite]:
        writes = []
        for w in expect_list(wire, "the penalty writes"):
            w = expect_list(w, "a penalty write")
            if len(w) != 4:
                raise MalformedMessage("step message: a penalty write has four arrays")
            reset = expect_array(w[0], "int32", 1, "a penalty write", (self.max_resets,))
            rows = expect_array(w[1], "int32", 1, "a penalty write")
            if rows.shape[0] not in self.write_buckets:
                raise MalformedMessage(f"step message: a penalty write of {rows.shape[0]} tokens")
            tokens = expect_array(w[2], "int32", 1, "a penalty write", rows.shape)
            is_out = expect_array(w[3], "bool", 1, "a penalty write", rows.shape)
            writes.append(PenaltyWrite(reset, rows, tokens, is_out))
        return writes

    def device_arrays(self, runner) -> list:
        return [self.counts, self.prompt_mask]

"""The draft-model proposer: a smaller causal LM of the target's vocabulary drafts k tokens
per request after every step, on the device, in the target's mesh and dtype.

KV cache. The draft's layers are KV-cache groups of their own (engine/kv_cache_manager.py),
after the target's: their own cache arrays (the target's block size and block count), block
pools and block tables, allocated, hit in the prefix cache, preempted and freed with the
target's. The draft sees every token the target computes, because the target's forward runs
the draft over the same flat batch (`runner/model_runner.py`, fused into one executable),
with its groups' slots. So prefill chunks, prefix-cache hits, preemption and recompute need
nothing of their own. The scheduler allocates k slots ahead of each
step's tokens (vLLM's lookahead) for the positions the drafts are written at.

Drafting. After a step, every request that sampled has L known tokens; draft step i
(0..k-1) feeds the draft its token at position L - 1 + i (the last sampled token, then its
own drafts, read on the device) and draws the next. k small decode steps per engine step, one
executable per decode bucket, compiled at start-up. A row drafts only while its positions
stay inside its allocated blocks and the context.

The draw. A draft token for output index j is drawn from the draft's distribution with
the request's temperature, top-k, top-p and min-p and the *same* exponential-race key the
target uses for index j (seed, j): greedy requests draft the draft's argmax. The verifier
(`runner/sampler.py`) samples each row from the target with that key and keeps a row while
the ones before sampled their drafts. The emitted token for index j is the target's draw
for j whatever the draft proposed, so the output is exactly the target's distribution, and
a seeded request gives the same tokens with and without speculation. Sharing the key
couples the two draws: a draft close to the target is accepted about as often as under
Leviathan et al.'s min(1, p/q) rule (an exponential-race coupling accepts with probability
at least (1 - TV) / (1 + TV), where Leviathan's accepts 1 - TV), while p and q never have to
meet on the host. vLLM's draft proposers draft greedily (a one-hot q); at temperature 0
both are the same.

Glossary: R draft rows (requests drafting), V vocab, K draft tokens per request.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.config import batch_invariant
from jllm.models.context import StepContext
from jllm.runner.buckets import BatchLayout, bucket
from jllm.runner.draw import filtered_draw, first_argmax, row_keys
from jllm.runner.flat_batch import fill_decode_rows, group_metadata, padded_flat_batch
from jllm.runner.inputs import StepInputs
from jllm.runner.transfer import pack, unpack
from jllm.sampling_params import SAMPLING_EPS
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS

logger = logging.getLogger(__name__)


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed_lo",
        "seed_hi",
        "counter",
        "batch_row",
    ],
    meta_fields=[],
)
@dataclasses.dataclass
class DraftSampling:
    temperature: jax.Array  # [R] float32
    top_k: jax.Array  # [R] int32, 0 = off
    top_p: jax.Array  # [R] float32
    min_p: jax.Array  # [R] float32
    seed_lo: jax.Array  # [R] uint32
    seed_hi: jax.Array  # [R] uint32
    counter: jax.Array  # [R] int32, the output index the draft token is for
    batch_row: jax.Array  # [R] int32, the input-batch row (padding: the padding row)


def draft_draw(logits, md: DraftSampling):
    """[R, V] draft logits -> [R] tokens: the argmax for greedy rows, else the target's
    filtered exponential race under the target's key for the same output index."""
    logits = logits.astype(jnp.float32)
    greedy_row = md.temperature < SAMPLING_EPS
    greedy = first_argmax(logits)

    def sampled():
        temp = jnp.where(greedy_row, 1.0, md.temperature)
        probs = jax.nn.softmax(logits / temp[:, None], axis=-1)
        keys = row_keys(md.seed_lo, md.seed_hi, md.counter)
        drawn = filtered_draw(probs, md.top_k, md.top_p, md.min_p, ~greedy_row, keys)
        return jnp.where(greedy_row, greedy, drawn)

    return jax.lax.cond(jnp.all(greedy_row), lambda: greedy, sampled)


def _draft_step(state, kv_cache, src, buf, *, layout, graphdef, backend, logits_sharding):
    """One draft decode step: each row's input token is `src[row]` (the row's last sampled
    token, or the draft of the step before); returns `src` with the rows' new drafts and
    the updated draft cache."""
    batch, md = unpack(buf, layout)
    token_ids = src[batch.from_device]
    model = nnx.merge(graphdef, state)
    ctx = StepContext(batch.positions, batch.attn, backend)
    hidden, kv_cache = model(token_ids, ctx, kv_cache)
    logits = model.compute_logits(hidden[batch.logits_indices])
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    out = src.at[md.batch_row].set(draft_draw(logits, md))
    if not jax.sharding.get_abstract_mesh().empty:
        out = jax.lax.with_sharding_constraint(out, jax.sharding.PartitionSpec())
    return out, kv_cache


# `invariant` (batch_invariant.keyed): the batch-invariant mode the step is traced in.
draft_step = jax.jit(
    batch_invariant.keyed(_draft_step),
    static_argnames=("layout", "graphdef", "backend", "logits_sharding", "invariant"),
    donate_argnames=("kv_cache",),
)


def draft_inputs(
    batch, rows: np.ndarray, step: int, layout: BatchLayout, backend, Rd: int, groups, back=1
):
    """The packed inputs of draft step `step` for input-batch `rows` (each has L known
    tokens and reads its token from the device), at position L - `back` + step (1: the
    draft model's, whose step 0 reads the last token at its own position; 2: an MTP
    draft's, which reads it beside the hidden state of the position before); `groups`: the
    draft's KV-cache groups (indices into the input batch's block tables)."""
    n = len(rows)
    pos = batch.num_tokens[rows] - back + step
    positions = np.zeros(Rd, np.int32)
    positions[:n] = pos
    flat = padded_flat_batch(layout, layout.decode_key(Rd))
    fill_decode_rows(flat, pos)
    row = np.full(Rd, batch.pad, np.int32)
    row[:n] = rows
    placed = np.full(Rd, -1, np.int32)  # input-batch rows of the tokens and request rows
    placed[:n] = rows
    inputs = StepInputs(
        token_ids=np.zeros(Rd, np.int32),
        positions=positions,
        logits_indices=np.arange(Rd, dtype=np.int32),
        from_device=row,
        prompt_lp_indices=np.zeros(PROMPT_LOGPROB_ROWS, np.int32),
        attn=group_metadata(
            backend, flat, batch, groups, placed, positions, placed, layout.group_fields
        ),
        lora_slots=np.zeros(Rd, np.int32),  # the draft has no adapters
    )
    counter = np.zeros(Rd, np.int32)
    counter[:n] = batch.num_tokens[rows] - batch.num_prompt[rows] + step
    md = DraftSampling(
        temperature=batch.temperature[row],
        top_k=batch.top_k[row],
        top_p=batch.top_p[row],
        min_p=batch.min_p[row],
        seed_lo=batch.seed_lo[row],
        seed_hi=batch.seed_hi[row],
        counter=counter,
        batch_row=row,
    )
    return pack((inputs, md))


class DraftModel:
    """The draft model's weights and KV cache on the device, and its drafting steps. Owned by
    the `ModelRunner`, which runs the draft over every step's flat batch and then asks
    `propose` for the next drafts."""

    def __init__(
        self,
        graphdef,
        state,
        config,
        kv_caches,
        num_speculative_tokens: int,
        disable_by,
        *,
        token_bytes: int,
    ):
        self.graphdef = graphdef
        self.state = state
        self.config = config  # the draft's module config (kv heads as on the mesh)
        self.kv_caches = kv_caches  # each KV-cache group's spec (jllm/kv_cache_interface.py)
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by
        self.kv_cache = None  # the caches of its groups' pools, once sized
        self.token_bytes = token_bytes  # one token's K and V in one layer
        # The draft steps' BatchLayout: the target's with its own K/V bytes (the engine's).
        self.layout = None

    def attach(self, kv_cache, num_blocks: int) -> None:
        """The draft's cache, once sized (its shapes while compiling), with the target's
        block count."""
        self.kv_cache = kv_cache
        self.layout = self.layout.with_blocks(num_blocks)

    step_name = "draft step"  # the executables' name in the runner's table
    back = 1  # step 0's position is L - back (`draft_inputs`)

    def _step(self):
        return draft_step

    def _inputs(self, runner, Rd: int) -> tuple:
        """The step's device arguments between the cache and the packed buffer."""
        return (runner.last_tokens,)

    def _executable(self, runner, Rd: int, buf, layout):
        return runner.table.get(
            self.step_name,
            Rd,
            lambda: self._step().lower(
                self.state,
                self.kv_cache,
                *self._inputs(runner, Rd),
                buf,
                layout=layout,
                graphdef=self.graphdef,
                backend=runner.attention,
                logits_sharding=runner.logits_sharding,
                invariant=runner.invariant,
            ),
        )

    def groups(self, runner) -> range:
        """The draft's KV-cache groups among the runner's: the last ones."""
        total = len(runner.kv_groups)
        return range(total - len(self.kv_caches), total)

    def compile_all(self, runner) -> None:
        for Rd in self.layout.decode_buckets[1:]:
            none = np.zeros(0, np.int32)
            groups = self.groups(runner)
            buf, layout = draft_inputs(
                runner.batch, none, 0, self.layout, runner.attention, Rd, groups, self.back
            )
            self._executable(runner, Rd, jax.device_put(buf, runner.replicated), layout)

    def drafting(self, runner) -> bool:
        """False from `disable_by_batch_size` running requests on (vLLM V0's rule)."""
        off = self.disable_by_batch_size
        return off is None or len(runner.batch.index) < off

    def live_rows(self, runner, groups):
        """The groups that sampled in the step just fetched and still hold their rows,
        longest first (the xla bands), their input-batch rows, and each one's room: the
        draft steps it may run while the positions they write stay inside its blocks (the
        scheduler's lookahead) and the context."""
        batch = runner.batch
        live = [g for g in groups if batch.generation[g.row] == g.generation]
        live.sort(key=lambda g: -batch.num_tokens[g.row])
        rows = np.array([g.row for g in live], np.int32)
        blocks = batch.num_blocks[self.groups(runner).start, rows]  # each holds the context
        room = np.minimum(blocks * self.layout.block_size, batch.max_model_len)
        return live, rows, room - (batch.num_tokens[rows] - 1)

    @staticmethod
    def drafts(live, room, outs) -> dict[str, list[int]]:
        """Each live group's drafts from the draft steps' outputs (`outs`: the token arrays
        by input-batch row), as many as its room."""
        drafted = [np.asarray(o.addressable_shards[0].data) for o in outs]
        n = np.minimum(np.maximum(room, 0), len(drafted))
        return {g.req_id: [int(drafted[i][g.row]) for i in range(n[j])] for j, g in enumerate(live)}

    def propose(self, runner, groups, sampled=None) -> dict[str, list[int]]:
        """Drafts for every request that sampled in the step just fetched (`groups`, their
        tokens already appended to the input batch): up to k tokens each. (`sampled`, each
        request's emitted tokens, is the MTP proposer's.)"""
        batch = runner.batch
        live, rows, room = self.live_rows(runner, groups)
        if not live or not self.drafting(runner):
            return {}
        groups = self.groups(runner)
        src = runner.last_tokens
        outs = []
        for step in range(self.k):
            active = rows[room > step]
            if active.size == 0:
                break
            Rd = bucket(active.size, self.layout.decode_buckets)
            backend = runner.attention
            buf, layout = draft_inputs(
                batch, active, step, self.layout, backend, Rd, groups, self.back
            )
            buf = jax.device_put(buf, runner.replicated)
            exe = self._executable(runner, Rd, buf, layout)
            src, self.kv_cache = exe(self.state, self.kv_cache, src, buf)
            outs.append(src)
        return self.drafts(live, room, outs)

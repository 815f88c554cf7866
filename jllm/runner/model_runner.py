"""The model runner: the only owner of device arrays (weights, KV cache, penalty state).

It owns the persistent input batch (`runner/input_batch.py`): each engine step applies the
scheduler's deltas to it, builds the padded flat batch from it in numpy, packs the step's
inputs and its sampling metadata into two buffers sent in one host-to-device transfer, runs
the compiled forward for the batch's key (`BatchLayout`: (T,) tokens on the ragged kernels,
(Rd, Tt) with the XLA path's tiles) and the compiled sampler (LM head included) for its
sample rows, and fetches one packed array back (the sampled ids, whether each was emitted,
and logprobs when asked). It appends the tokens it
emits to its own rows: the scheduler never sends them back. Nothing here imports
`jllm.engine`.

Every device concern beside the forward and the sampler is a manager that owns its arrays
(`runner/manager.py`: penalty state, the logit-bias table, LoRA slots, the image encoder's
cache, the host KV tier's copies); a step is one `StepPlan` (`runner/step_message.py`) that
holds each manager's writes by name, which `run_step` applies before the forward, on every
process of a multi-process engine alike.

Every executable (the forward's buckets, the sampler's, the managers') is compiled ahead of
time in `compile_all` (the equivalent of vLLM's CUDA-graph capture) into one
`ExecutableTable` (`runner/executables.py`); once its guard is set a step whose bucket is
missing raises instead of compiling. `enforce_eager=True` skips the start-up pass: buckets
compile on first use.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jllm.attention import get_backend
from jllm.config import batch_invariant
from jllm.distributed.codec import MalformedMessage
from jllm.models.context import StepContext
from jllm.runner.buckets import BatchLayout, bucket
from jllm.runner.compile_cache import cache_counts
from jllm.runner.data_parallel import (
    SPLIT,
    blocks,
    data_splits,
    over_data,
    rows_sharding,
    weight_specs,
)
from jllm.runner.executables import ExecutableTable
from jllm.runner.input_batch import InputBatch, token_slots
from jllm.runner.inputs import build_step, finish_step, place_step, sample_bucket
from jllm.runner.logit_bias import LogitBiasTable, bias_vector
from jllm.runner.lora_slots import LoraSlotArrays
from jllm.runner.penalty_state import PenaltyState
from jllm.runner.prompt_logprobs import _prompt_logprobs_step, prompt_logprobs_step
from jllm.runner.prompt_logprobs import unpack as unpack_prompt_logprobs
from jllm.runner.routed_experts import split_by_request
from jllm.runner.sampled import SampledToken
from jllm.runner.sampler import pooled_result, sample, unpack_pooled, unpack_result
from jllm.runner.sampling_inputs import grammar_rows
from jllm.runner.step_message import StepPlan, from_message, to_message
from jllm.runner.transfer import Layout, pack, unpack
from jllm.sampling_params import SamplingParams
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS, ModelRunnerOutput, SchedulerOutput
from jllm.structured_output.backends import bitmask_width
from sharding import DATA_AXIS, named_sharding, replicated

logger = logging.getLogger(__name__)


def _whole(array) -> np.ndarray:
    """A step result in numpy: gathered (whole on this process's devices) or split over the
    data shards of this process alone."""
    if array.is_fully_replicated:
        return np.asarray(array.addressable_shards[0].data)
    return np.asarray(array)


def _sample_rows(md_layout: Layout) -> int:
    """Rs of a packed SamplingMetadata: its leaves all lead with the sample-row axis."""
    return md_layout.leaves[0][0][0]


def _forward(
    state,
    kv_cache,
    last_tokens,
    buf,
    images=None,
    *,
    layout,
    graphdef,
    backend,
    draft_graphdef=None,
    routes_k=0,
    routes_dtype=None,
    pooling=None,
):
    """One packed buffer in: the step's inputs. Tokens sampled by the previous step are read
    from `last_tokens` on the device. Hands on the hidden states of the tokens sample rows
    follow ([logit_rows, D], whatever the key: the sampler's executable takes the rows it
    samples) and of the tokens listed for prompt logprobs ([PROMPT_LOGPROB_ROWS, D],
    runner/prompt_logprobs.py).

    `kv_cache`: the model's caches, one per KV-cache pool (groups of one pool share its
    array: models/decoder.py; a pool of per-request state is a tuple of its state arrays,
    models/state.py). With a speculative draft model (`draft_graphdef`), `state`
    and `kv_cache` are pairs (target, draft): the draft runs over the same tokens, into its
    own caches through the same slots (spec_decode/draft_model.py). `images`: a
    vision-language model's encoder cache [slots, P, D] (runner/encoder.py), whose rows
    replace the image tokens' embeddings. With `routes_k` (enable_return_routed_experts) it
    also returns every layer's routed experts [T, L, k] as `routes_dtype`
    (runner/routed_experts.py); else None. A pooling model's MEAN or CLS `pooling` hands on,
    for each sample row, its prompt's mean or first state instead (float32; the prompt is
    whole in the step: chunked prefill and the prefix cache are off for them)."""
    batch = unpack(buf, layout)
    on_device = last_tokens[jnp.maximum(batch.from_device, 0)]
    token_ids = jnp.where(batch.from_device >= 0, on_device, batch.token_ids)
    takes_hidden = False  # an MTP draft runs after the target, over its hidden states
    if draft_graphdef is not None:
        (state, draft_state), (kv_cache, draft_cache) = state, kv_cache
        draft = nnx.merge(draft_graphdef, draft_state)
        draft_attn = batch.attn[-len(draft.kv_cache_specs(draft.cfg)) :]  # after the model's
        draft_ctx = StepContext(batch.positions, draft_attn, backend)
        takes_hidden = getattr(draft, "takes_hidden", False)
        if not takes_hidden:
            _, draft_cache = draft(token_ids, draft_ctx, draft_cache)
    model = nnx.merge(graphdef, state)
    attn = batch.attn[: len(model.kv_cache_specs(model.cfg))]
    positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
    ctx = StepContext(positions, attn, backend, lora_slots=batch.lora_slots)
    if images is not None:
        rows = images.reshape(-1, images.shape[-1])  # [pages * P, W]
        index = batch.embed_index
        gathered = rows[jnp.maximum(index, 0)]  # [T, W]: the embedding, then DeepStack's
        D = model.cfg.hidden_size
        ctx = ctx.replace(embeds=gathered[:, :D], embeds_mask=index >= 0)
        if gathered.shape[1] > D:
            deep = gathered[:, D:].reshape(gathered.shape[0], -1, D)
            ctx = ctx.replace(deep_embeds=deep.transpose(1, 0, 2))
    elif batch.embeds is not None:  # enable_prompt_embeds: embeddings prompts' rows
        ctx = ctx.replace(embeds=batch.embeds, embeds_mask=batch.embeds_mask)
    hidden, kv_cache, routes = model.forward(token_ids, ctx, kv_cache, routes_k)
    if takes_hidden:  # each token paired with its successor (spec_decode/mtp.py)
        _, draft_cache = draft.propose(batch.next_tokens, hidden, draft_ctx, draft_cache)
    if draft_graphdef is not None:
        kv_cache = (kv_cache, draft_cache)
    if routes is not None:
        routes = routes.transpose(1, 0, 2).astype(routes_dtype)  # [T, L, k]
    rows = hidden[batch.logits_indices]
    if pooling in ("MEAN", "CLS"):
        rows = prompt_pool(hidden, batch.positions, batch.logits_indices, pooling)
    if takes_hidden and not jax.sharding.get_abstract_mesh().empty:  # the MTP steps read it
        rows = jax.lax.with_sharding_constraint(rows, jax.sharding.PartitionSpec())
    return rows, kv_cache, hidden[batch.prompt_lp_indices], routes


def prompt_pool(hidden, positions, last, kind: str):
    """[R, D] float32: each sample row's prompt states pooled, `last` [R] its last token's
    index and the prompt whole in the step (its first token at last - positions[last]):
    their mean (MEAN) or the first (CLS)."""
    first = last - positions[last]
    if kind == "CLS":
        return hidden[first].astype(jnp.float32)
    t = jnp.arange(hidden.shape[0])
    mask = (t[None, :] >= first[:, None]) & (t[None, :] <= last[:, None])
    sums = jnp.einsum(
        "RT,TD->RD",
        mask.astype(jnp.float32),
        hidden.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return sums / (positions[last] + 1).astype(jnp.float32)[:, None]


# `invariant` (batch_invariant.keyed): the batch-invariant mode the step is traced in.
FORWARD_STATIC = (
    "layout",
    "graphdef",
    "backend",
    "draft_graphdef",
    "routes_k",
    "routes_dtype",
    "pooling",
    "invariant",
)
forward_step = jax.jit(
    batch_invariant.keyed(_forward), static_argnames=FORWARD_STATIC, donate_argnames=("kv_cache",)
)


def _sample_step(
    state,
    hidden,
    buf,
    counts,
    prompt_mask,
    bias,
    last_tokens,
    bitmask,
    *,
    layout,
    graphdef,
    logits_sharding,
    num_logprobs,
    logits_processors,
    logprobs_mode="raw_logprobs",
    pooling=False,
):
    """The LM head on the first Rs of the forward's [logit_rows, D] hidden states (Rs: the
    rows of the packed sampling metadata `buf`), then the sampler (runner/sampler.py). A
    pooling model's (`pooling`) runs neither: its rows' hidden states go back in the packed
    result (sampler.pooled_result)."""
    md = unpack(buf, layout)
    if pooling:
        return pooled_result(hidden, md.batch_row.shape[0], num_logprobs), counts, last_tokens
    model = nnx.merge(graphdef, state)
    # Padding sample rows belong to the input batch's padding row, the last.
    sampled = md.batch_row < last_tokens.shape[0] - 1
    logits = model.compute_logits(hidden[: sampled.shape[0]], sampled)  # [Rs, V]
    # One fixed layout for the sampler, whatever the bucket (vocab-split under TP).
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    return sample(
        logits,
        md,
        counts,
        prompt_mask,
        bias,
        last_tokens,
        bitmask,
        num_logprobs=num_logprobs,
        logits_processors=logits_processors,
        logprobs_mode=logprobs_mode,
    )


SAMPLE_STATIC = (
    "layout",
    "graphdef",
    "logits_sharding",
    "num_logprobs",
    "logits_processors",
    "logprobs_mode",
    "pooling",
    "invariant",
)
sample_step = jax.jit(
    batch_invariant.keyed(_sample_step),
    static_argnames=SAMPLE_STATIC,
    donate_argnames=("counts", "last_tokens"),
)


# ---- data parallelism: the same steps on every data shard (runner/data_parallel.py) ------
def _forward_shards(
    state,
    kv_cache,
    last_tokens,
    buf,
    images=None,
    *,
    layout,
    graphdef,
    backend,
    draft_graphdef=None,
    routes_k=0,
    routes_dtype=None,
    pooling=None,
    splits=None,
):
    """`_forward` on each data shard: `buf` [D, n], each shard's row its packed inputs;
    the cache's blocks and the last tokens split by shard; the weights whole but for
    `splits` (runner/data_parallel.data_splits). -> the shards' sample-row and
    prompt-logprob hidden states side by side, the caches (no routed experts)."""
    static = dict(layout=layout, graphdef=graphdef, backend=backend, pooling=pooling)

    def shard(state, kv_cache, last_tokens, buf):
        rows, kv_cache, prompt_hidden, _ = _forward(state, kv_cache, last_tokens, buf[0], **static)
        return rows, kv_cache, prompt_hidden

    pools = blocks(kv_cache)
    specs = (weight_specs(state, splits), pools, SPLIT, SPLIT)
    rows, kv_cache, prompt_hidden = over_data(shard, specs, (SPLIT, pools, SPLIT))(
        state, kv_cache, last_tokens, buf
    )
    return rows, kv_cache, prompt_hidden, None


forward_shards = jax.jit(
    batch_invariant.keyed(_forward_shards),
    static_argnames=(*FORWARD_STATIC, "splits"),
    donate_argnames=("kv_cache",),
)


def _sample_shards(
    state,
    hidden,
    buf,
    counts,
    prompt_mask,
    bias,
    last_tokens,
    bitmask,
    *,
    layout,
    graphdef,
    logits_sharding,
    num_logprobs,
    logits_processors,
    logprobs_mode="raw_logprobs",
    pooling=False,
    splits=None,
    gather=False,
):
    """`_sample_step` on each data shard: every argument but the weights split by shard.
    With `gather` (several processes: process 0 reads every shard's result) the packed
    result is gathered over the shards, whole on every device."""
    static = dict(
        layout=layout,
        graphdef=graphdef,
        logits_sharding=logits_sharding,
        num_logprobs=num_logprobs,
        logits_processors=logits_processors,
        logprobs_mode=logprobs_mode,
        pooling=pooling,
    )

    def shard(state, hidden, buf, *rows):
        packed, counts, last = _sample_step(state, hidden, buf[0], *rows, **static)
        if gather:
            packed = jax.lax.all_gather(packed, DATA_AXIS, tiled=True)
        return packed, counts, last

    specs = (weight_specs(state, splits), *[SPLIT] * 7)
    packed = PartitionSpec() if gather else SPLIT
    return over_data(shard, specs, (packed, SPLIT, SPLIT))(
        state, hidden, buf, counts, prompt_mask, bias, last_tokens, bitmask
    )


sample_shards = jax.jit(
    batch_invariant.keyed(_sample_shards),
    static_argnames=(*SAMPLE_STATIC, "splits", "gather"),
    donate_argnames=("counts", "last_tokens"),
)


def _prompt_lp_shards(
    state, hidden, targets, *, graphdef, num_logprobs, logits_sharding, splits=None, gather=False
):
    """`_prompt_logprobs_step` on each data shard (`gather`: as `_sample_shards`)."""
    static = dict(graphdef=graphdef, num_logprobs=num_logprobs, logits_sharding=logits_sharding)

    def shard(state, hidden, targets):
        packed = _prompt_logprobs_step(state, hidden, targets, **static)
        return jax.lax.all_gather(packed, DATA_AXIS, tiled=True) if gather else packed

    specs = (weight_specs(state, splits), SPLIT, SPLIT)
    out = PartitionSpec() if gather else SPLIT
    return over_data(shard, specs, out)(state, hidden, targets)


prompt_lp_shards = jax.jit(
    batch_invariant.keyed(_prompt_lp_shards),
    static_argnames=(
        "graphdef",
        "num_logprobs",
        "logits_sharding",
        "invariant",
        "splits",
        "gather",
    ),
)


class ModelRunner:
    def __init__(
        self,
        graphdef,
        state,
        layout: BatchLayout,
        vocab_size: int,
        max_num_seqs: int,
        max_logprobs: int,
        backend: str,
        enforce_eager: bool,
        mesh,
        kv_caches: tuple,
        logits_processors: tuple = (),
        draft=None,
        lora=None,
        encoder=None,
        logprobs_mode: str = "raw_logprobs",
        routes=None,
        invariant: bool = False,
        pooling: str | None = None,
        data_parallel_size: int = 1,
    ) -> None:
        self.graphdef = graphdef
        # Data shards (runner/data_parallel.py): each has its own input batch of
        # max_num_seqs rows and its own per-row device state; a step runs on all at once.
        self.dp = data_parallel_size
        # A pooling model's pooling type (jllm/pooling: "LAST", "MEAN", "CLS"): its steps
        # return pooled hidden states, not tokens. None: a generative model.
        self.pooling = pooling
        # The batch-invariant mode its steps are traced in (jllm/config/batch_invariant.py)
        self.invariant = invariant
        # enable_return_routed_experts: what the forward records (runner/routed_experts.py)
        self.routes = routes
        self.logprobs_mode = logprobs_mode  # what the sampler's logprobs report
        self.draft = draft  # a speculative DraftModel (spec_decode/draft_model.py), or None
        # The KV-cache groups' specs (jllm/kv_cache_interface.py): the model's, then the
        # draft model's. Every step carries each group's attention metadata.
        self.kv_groups = tuple(kv_caches) + (() if draft is None else tuple(draft.kv_caches))
        self.mesh = mesh
        self.table = ExecutableTable(mesh)
        # Step inputs and penalty state are replicated on every device of the mesh (with
        # data shards, each shard's rows on its devices).
        self.replicated = replicated(mesh)
        self.rows = self.replicated if self.dp == 1 else rows_sharding(mesh)
        self.logits_sharding = named_sharding(mesh, (None, "vocab"), (1, vocab_size))
        if self.dp > 1:  # inside the shards' shard_map: a spec of the mesh in context
            self.logits_sharding = self.logits_sharding.spec
        self.state = state
        # With data shards: the weights split over `data` (experts under expert
        # parallelism), which each shard's step takes its own part of.
        self.splits = data_splits(state) if self.dp > 1 else None
        # {parameter path: layout} of the projections the engine packed for the CPU kernel
        # (models/packing.py; set by LLMEngine): what WeightSync unpacks and packs again.
        self.packed_weights: dict = {}
        self.kv_cache = None  # attach_kv_cache, once sized
        if layout.group_fields and len(layout.group_fields) != len(self.kv_groups):
            raise ValueError(
                f"The batch layout describes {len(layout.group_fields)} KV-cache groups, the "
                f"runner has {len(self.kv_groups)}."
            )
        self.layout = layout  # frozen; a copy with the block count once the cache is sized
        self.backend = backend  # the attention_backend name
        self.attention = get_backend(backend)
        self.enforce_eager = enforce_eager
        # Forward buckets compiled at once in `compile_all`: one on the CPU (its compiler
        # already uses the cores), several where the host's cores are otherwise idle.
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        self.compile_workers = 1 if on_cpu else min(8, len(os.sched_getaffinity(0)))
        # Top logprobs every sample row returns: max_logprobs=-1 is the whole vocabulary.
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        max_len = layout.max_pages * layout.block_size
        self.logits_processors = tuple(logits_processors)  # traced into the sampler
        self.batches = [
            InputBatch(
                max_num_seqs, max_len, layout.max_pages, self.logits_processors, len(self.kv_groups)
            )
            for _ in range(self.dp)
        ]
        self.batch = self.batches[0]
        # The managers (runner/manager.py), in the order their writes run in a step: a LoRA
        # slot and the images a step reads are written before the forward; the host KV
        # tier's copies before it overwrites or reads their blocks; penalty rows (row 0
        # stays empty) and logit-bias rows before the sampler.
        self.lora = None if lora is None else LoraSlotArrays(lora, state, self.replicated)
        self.encoder = encoder  # a vision-language model's ImageEncoder (runner/encoder.py)
        self.host_kv = None  # the host KV tier's HostKVCache (runner/host_kv.py), if any
        # A linear-attention model's state snapshots (runner/state_copies.py), if any.
        self.state_copies = None
        self.penalties = PenaltyState(
            max_num_seqs, max_len, vocab_size, self.replicated, self.dp, self.rows
        )
        self.bias = LogitBiasTable(self.penalties.num_rows, vocab_size, self.replicated, self.rows)
        self.vocab_size = vocab_size
        # Grammar bitmasks (structured outputs): a step without any passes a zero array of
        # its row bucket, kept on the device, so only steps with a grammar transfer one.
        self.bitmask_width = bitmask_width(vocab_size)
        self._no_bitmask: dict[int, jax.Array] = {}
        # The last token each input-batch row sampled, where the next step reads it.
        last = np.zeros(self.dp * (max_num_seqs + 1), np.int32)
        self.last_tokens = jax.device_put(last, self.rows)
        # An MTP draft's first step reads the step's sample rows' hidden states: the last
        # forward's [logit_rows, D] (spec_decode/mtp.py).
        self.step_hidden = None
        if getattr(draft, "takes_hidden", False):
            rows = (layout.logit_rows, draft.config.hidden_size)
            hidden = np.zeros(rows, jnp.dtype(draft.dtype))
            self.step_hidden = jax.device_put(hidden, self.replicated)
        self._layouts: dict[tuple, tuple] = {}  # (key, Rs) -> packed layouts
        self.channel = None  # process 0 of a multi-process engine: a StepChannel
        self._first_step: float | None = None  # when the first step was dispatched
        self._first_logged = False

    @property
    def managers(self) -> list:
        """The managers this engine has, in the order their writes run in a step."""
        every = (
            self.lora,
            self.encoder,
            self.host_kv,
            self.state_copies,
            self.penalties,
            self.bias,
        )
        return [m for m in every if m is not None]

    @property
    def compile_guard(self) -> bool:
        """Set once every executable is compiled: a missing one raises instead."""
        return self.table.guard

    @compile_guard.setter
    def compile_guard(self, on: bool) -> None:
        self.table.guard = on

    # ---- the KV cache --------------------------------------------------------------------
    def profile_step_bytes(self, abstract_cache) -> int:
        """Device memory the largest step needs besides weights and cache: the working
        memory XLA assigns to the largest forward key, the largest sampler and the
        prompt-logprob step, compiled
        against a stand-in cache of a few blocks (the cache's size does not change it)."""
        key = self.layout.largest()
        # Not kept in the table: it is compiled against the stand-in cache.
        with jax.set_mesh(self.mesh):
            fwd = self._lower_forward(key, abstract_cache).compile()
        hidden, _, prompt_hidden, _ = fwd.out_info
        # The sampler and the prompt-logprob step do not read the cache: kept for serving.
        smp = self._sample_executable(self.layout.sample_buckets[-1], hidden)
        prompt_lp = self._prompt_lp_executable(prompt_hidden)
        # The hidden states live from one executable to the other; the rest of their
        # outputs are the cache and state they update in place.
        passed = hidden.size * hidden.dtype.itemsize
        temp = sum(exe.memory_analysis().temp_size_in_bytes for exe in (fwd, smp, prompt_lp))
        return int(temp + passed)

    def attach_kv_cache(self, kv_cache: tuple, num_blocks: int) -> None:
        """The model's caches, one per KV-cache pool, once sized (their shapes while
        compiling); `num_blocks`: the largest pool's."""
        self.kv_cache = kv_cache
        self.layout = self.layout.with_blocks(num_blocks)

    def _caches(self):
        return self.kv_cache if self.draft is None else (self.kv_cache, self.draft.kv_cache)

    def _forward_args(self, kv_cache):
        """The forward's (state, cache): pairs (target, draft) with a draft model."""
        if self.draft is None:
            return self.state, kv_cache
        return (self.state, self.draft.state), kv_cache

    # ---- compilation ---------------------------------------------------------------------
    def _warmup_step(self, key: tuple, sample_rows: int | None = None):
        """The zero inputs of forward key `key` and sampler bucket `sample_rows`, built by
        the same code as real steps: (StepInputs, SamplingMetadata) in numpy."""
        empty = InputBatch(0, 1, self.layout.max_pages, self.logits_processors, len(self.kv_groups))
        inputs, md, _, _, _, _ = build_step(
            empty, SchedulerOutput(), self.layout, self.attention, key, sample_rows
        )
        return inputs, md

    def _images(self):
        return None if self.encoder is None else self.encoder.pool

    def _abstract(self, layout: Layout):
        """The packed buffer of `layout` as an abstract replicated argument ([D, size], a
        row per data shard, with data parallelism)."""
        size = sum(int(np.prod(shape)) for shape, _ in layout.leaves)
        shape = (size,) if self.dp == 1 else (self.dp, size)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.rows)

    def _lower_forward(self, key: tuple, kv_cache):
        """`kv_cache`: the target's, or the pair (target, draft) with a draft model."""
        layout = self.step_layouts(key, self.layout.sample_buckets[0])[0]
        step = forward_step if self.dp == 1 else forward_shards
        return step.lower(
            *self._forward_args(kv_cache),
            self.last_tokens,
            self._abstract(layout),
            self._images(),
            layout=layout,
            graphdef=self.graphdef,
            backend=self.attention,
            draft_graphdef=None if self.draft is None else self.draft.graphdef,
            routes_k=0 if self.routes is None else self.routes.k,
            routes_dtype=None if self.routes is None else self.routes.dtype,
            pooling=self.pooling,
            invariant=self.invariant,
            **self._split_kw(),
        )

    def _split_kw(self) -> dict:
        """The data shards' steps' static `splits` (none with one shard)."""
        return {} if self.dp == 1 else {"splits": self.splits}

    def _gather_kw(self) -> dict:
        """Whether the data shards' results are gathered for process 0 (several
        processes: another's shard is not addressable here)."""
        return {} if self.dp == 1 else {"gather": jax.process_count() > 1}

    def forward_for(self, key: tuple):
        """The forward executable of `key`, compiled now when missing (and allowed)."""
        return self.table.get("forward", key, lambda: self._lower_forward(key, self._caches()))

    def _sampler_state(self, bitmask) -> tuple:
        """The sampler's arguments after the hidden states and metadata: the penalty state,
        the logit-bias table, the last tokens and the grammar bitmask."""
        p = self.penalties
        return p.counts, p.prompt_mask, self.bias.bias, self.last_tokens, bitmask

    def _sample_executable(self, rs: int, hidden):
        """The sampler of `rs` rows, after the forward's `hidden` states (their shape)."""

        def lower():
            layout = self.step_layouts(self.layout.shapes()[0], rs)[1]
            bitmask = jax.ShapeDtypeStruct(
                (self.dp * rs, self.bitmask_width), jnp.int32, sharding=self.rows
            )
            step = sample_step if self.dp == 1 else sample_shards
            return step.lower(
                self.state,
                hidden,
                self._abstract(layout),
                *self._sampler_state(bitmask),
                layout=layout,
                graphdef=self.graphdef,
                logits_sharding=self.logits_sharding,
                num_logprobs=self.max_logprobs,
                logits_processors=self.logits_processors,
                logprobs_mode=self.logprobs_mode,
                pooling=self.pooling is not None,
                invariant=self.invariant,
                **self._split_kw(),
                **self._gather_kw(),
            )

        return self.table.get("sampler", rs, lower)

    def _prompt_lp_executable(self, hidden):
        def lower():
            targets = jax.ShapeDtypeStruct(
                (self.dp * PROMPT_LOGPROB_ROWS,), jnp.int32, sharding=self.rows
            )
            step = prompt_logprobs_step if self.dp == 1 else prompt_lp_shards
            return step.lower(
                self.state,
                hidden,
                targets,
                graphdef=self.graphdef,
                num_logprobs=self.max_logprobs,
                logits_sharding=self.logits_sharding,
                invariant=self.invariant,
                **self._split_kw(),
                **self._gather_kw(),
            )

        return self.table.get("prompt logprobs", None, lower)

    def compile_all(self) -> None:
        """Compile every forward key and sampler bucket, and every manager's executables,
        before serving (skipped when eager).

        They compile on `compile_workers` threads (XLA releases the GIL while it compiles;
        each compile sets the mesh itself). On the CPU one at a time: a thread per core was
        slower on the 2-core CPU, 100 s against 92 s for the 89 SmolLM2 buckets, since XLA's
        CPU compiler already uses the cores. On a GPU host the cores wait for LLVM and
        ptxas of one module at a time, so several compile at once."""
        if self.enforce_eager:
            logger.info("enforce_eager=True: buckets compile on first use.")
            return
        layout, keys = self.layout, self.layout.shapes()
        if layout.tiles:
            grid = (
                f"decode rows {layout.decode_buckets} x prefill tiles of {layout.tile_size} "
                f"tokens {layout.tile_buckets}, the pairs the token budget reaches"
            )
        else:
            grid = f"tokens {layout.token_buckets}"
        logger.info(
            "Compiling %d forward buckets (%s) and %d sampler buckets (rows %s).",
            len(keys),
            grid,
            len(layout.sample_buckets),
            layout.sample_buckets,
        )
        start = time.perf_counter()
        compiled_before, loaded_before = cache_counts()
        progress = itertools.count(1)  # next() is atomic: the threads share it
        total = len(keys) + len(layout.sample_buckets)

        def done(what):
            n = next(progress)
            logger.debug("Compiled %s in %.2fs", what, time.perf_counter() - start)
            if n % 16 == 0 or n == total:
                logger.info("Compiled %d/%d buckets.", n, total)

        def forward(key):
            exe = self.forward_for(key)
            done(f"forward {key}")
            return exe

        def sampler(rs):
            self._sample_executable(rs, hidden)
            done(f"sampler (Rs={rs})")

        def run_all(fn, items):
            if self.compile_workers == 1:
                return [fn(x) for x in items]
            with ThreadPoolExecutor(self.compile_workers, "jllm-compile") as pool:
                return list(pool.map(fn, items))

        hidden, _, prompt_hidden, _ = run_all(forward, keys)[0].out_info  # shapes and shardings
        run_all(sampler, layout.sample_buckets)
        self._prompt_lp_executable(prompt_hidden)  # one shape: compiled once
        for manager in self.managers:
            manager.compile_all(self)
        if self.draft is not None:
            self.draft.compile_all(self)
        compiled, loaded = cache_counts()
        logger.info(
            "Graph compilation finished in %.1f secs (%d executables compiled, %d loaded from "
            "the compilation cache).",
            time.perf_counter() - start,
            compiled - compiled_before,
            loaded - loaded_before,
        )
        self.compile_guard = True

    # ---- the step ------------------------------------------------------------------------
    def _bitmask(self, rows: int, bitmask):
        if bitmask is not None:
            return jax.device_put(bitmask, self.rows)
        zeros = self._no_bitmask.get(rows)
        if zeros is None:
            zeros = np.zeros((self.dp * rows, self.bitmask_width), np.int32)
            zeros = self._no_bitmask[rows] = jax.device_put(zeros, self.rows)
        return zeros

    def step_layouts(self, key: tuple, rs: int) -> tuple[Layout, Layout]:
        """The packed layouts of forward key `key` and sampler bucket `rs`, built by the same
        code as real steps (every process rebuilds a plan's with it)."""
        cached = self._layouts.get((key, rs))
        if cached is None:
            inputs, md = self._warmup_step(key, rs)
            cached = self._layouts[(key, rs)] = (pack(inputs)[1], pack(md)[1])
        return cached

    def run_step(self, plan: StepPlan):
        """The device part of a step: every manager's writes (then their late parts), then
        the forward and the sampler, from the packed host inputs to the packed result, still
        on the device (JAX dispatches asynchronously); with prompt-logprob targets, also the
        packed prompt logprobs (else None), and the routed experts when recorded (else
        None). Every process of a multi-process engine runs it with the same plan."""
        written = [(m, plan.writes[m.name]) for m in self.managers]
        written = [(m, w) for m, w in written if w != m.empty()]
        for manager, writes in written:
            manager.apply(self, writes)
        for manager, writes in written:
            manager.apply_late(self, writes)
        layout, md_layout = self.step_layouts(plan.key, plan.rs)
        buf, md_buf = jax.device_put((plan.inputs, plan.sampling), self.rows)
        fwd = self.forward_for(plan.key)
        hidden, caches, prompt_hidden, routes = fwd(
            *self._forward_args(self._caches()), self.last_tokens, buf, self._images()
        )
        if self.draft is None:
            self.kv_cache = caches
        else:
            self.kv_cache, self.draft.kv_cache = caches
        if self.step_hidden is not None:
            self.step_hidden = hidden
        smp = self._sample_executable(plan.rs, hidden)
        packed, self.penalties.counts, self.last_tokens = smp(
            self.state, hidden, md_buf, *self._sampler_state(self._bitmask(plan.rs, plan.bitmask))
        )
        prompt_packed = None
        if plan.prompt_targets is not None:
            targets = jax.device_put(plan.prompt_targets, self.rows)
            prompt_lp = self._prompt_lp_executable(prompt_hidden)
            prompt_packed = prompt_lp(self.state, prompt_hidden, targets)
        return packed, prompt_packed, routes

    def follow(self, channel) -> None:
        """Processes other than 0: run the steps process 0 sends until it stops. A message
        that is not a step of this engine's schema raises MalformedMessage (the process
        stops; process 0 reports its exit)."""
        while True:
            message = channel.recv()
            if message["kind"] == "stop":
                return
            if message["kind"] != "step":
                raise MalformedMessage(f"step channel: unknown message {message['kind']!r}")
            plan = from_message(message, self.step_layouts, self.managers, self.dp)
            jax.block_until_ready(self.run_step(plan))

    def _apply(self, out: SchedulerOutput) -> tuple[dict, dict]:
        """Bring the input batch up to date with the scheduler's output; returns every
        manager's writes for the step and the requests whose admission failed ({req id:
        reason}). With data shards, each shard's output updates its own input batch, and
        its penalty and bias rows are its own run of the arrays' rows."""
        writes = {m.name: m.empty() for m in self.managers}
        admitted, bias_writes, failed = [], [], {}
        for d, (batch, shard) in enumerate(zip(self.batches, self._shards(out), strict=True)):
            base = d * self.penalties.rows_per_shard
            for rid in shard.finished_req_ids | shard.preempted_req_ids:
                batch.remove(rid)
            for new in shard.scheduled_new_reqs:
                if new.lora_slot:
                    writes[self.lora.name] += self.lora.admit(self, new.lora_slot, new.lora)
                try:
                    row = batch.add(new)
                    p = new.sampling_params
                    bias = bias_vector(p, self.vocab_size) if p.has_bias else None
                except Exception as e:  # noqa: BLE001 - fails this request only
                    failed[new.req_id] = self._admit_neutral(batch, new, e)
                    continue
                if p.has_penalties:
                    prompt = () if new.prompt_is_embeds else new.prompt_token_ids
                    admitted.append((base + row + 1, prompt, new.output_token_ids))
                if bias is not None:
                    bias_writes.append((base + row + 1, bias))
            batch.update(shard.scheduled_cached_reqs)
        writes[self.penalties.name] = self.penalties.admit(admitted)
        writes[self.bias.name] = bias_writes
        if self.encoder is not None:
            writes[self.encoder.name] = list(out.encoder_inputs)
        if self.host_kv is not None:
            writes[self.host_kv.name] = (list(out.kv_stores), list(out.kv_loads))
        if self.state_copies is not None:
            writes[self.state_copies.name] = list(out.state_copies)
        return writes, failed

    def _shards(self, out: SchedulerOutput) -> list[SchedulerOutput]:
        """Each data shard's part of a step (engine/data_parallel.py): the step itself with
        one shard."""
        return [out] if self.dp == 1 else out.shards

    @staticmethod
    def _admit_neutral(batch: InputBatch, new, error: Exception) -> str:
        """A request whose row could not be written (its sampling parameters): it still
        runs this step with greedy defaults, so its scheduled tokens fill its KV blocks as
        the scheduler expects, and the engine fails it alone with the returned reason."""
        logger.error("Request %s could not be admitted: %r", new.req_id, error)
        batch.remove(new.req_id)
        batch.add(dataclasses.replace(new, sampling_params=SamplingParams(temperature=0)))
        return f"{type(error).__name__}: {error}"

    def dispatch(self, out: SchedulerOutput):
        """Start one step on the device and return without waiting for it: a handle for
        `fetch`. The rows that sample hold a pending token until then."""
        if self._first_step is None:
            self._first_step = time.perf_counter()
        writes, failed = self._apply(out)
        if self.dp > 1:
            return self._dispatch_shards(out, writes, failed)
        inputs, md, groups, key, prompt_rows, tok_row = build_step(
            self.batch, out, self.layout, self.attention
        )
        rs = md.batch_row.shape[0]
        plan = StepPlan(
            key=key,
            rs=rs,
            inputs=pack(inputs)[0],
            sampling=pack(md)[0],
            prompt_targets=None if prompt_rows is None else prompt_rows.targets,
            bitmask=grammar_rows(groups, out.grammar_bitmask, rs, self.bitmask_width),
            writes=writes,
        )
        if self.channel is not None:  # the other processes run the same step
            self.channel.send(to_message(plan, self.managers))
        packed, prompt_packed, routes = self.run_step(plan)
        for g in groups:
            self.batch.num_pending[g.row] += 1
        if routes is not None:  # cut per request at fetch, with the rows and slots of now
            spec, positions = self.routes, inputs.positions
            table = self.batch.block_table[spec.group]
            slots = token_slots(table, tok_row, positions, spec.block_size, -1)
            rows = {self.batch.index[rid]: rid for rid in out.num_scheduled_tokens}
            routes = (routes, tok_row, positions, slots, rows)
        return packed, groups, prompt_packed, prompt_rows, failed, routes

    def _dispatch_shards(self, out, writes: dict, failed: dict):
        """`dispatch` with data shards: each shard's inputs built from its own batch in the
        largest shard's forward key and sample-row bucket, side by side in one plan."""
        shards = out.shards
        tokens = max(sum(o.num_scheduled_tokens.values()) for o in shards)
        key = (bucket(max(tokens, 1), self.layout.token_buckets),)
        placed = [
            place_step(b, o, self.layout, key) for b, o in zip(self.batches, shards, strict=True)
        ]
        rs = max(sample_bucket(p, self.layout) for p in placed)
        built = [
            finish_step(b, o, self.layout, self.attention, p, rs)
            for b, o, p in zip(self.batches, shards, placed, strict=True)
        ]
        prompts = [b[4] for b in built]
        targets = None
        if any(p is not None for p in prompts):
            none = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
            targets = np.concatenate([none if p is None else p.targets for p in prompts])
        masks = [
            grammar_rows(b[2], o.grammar_bitmask, rs, self.bitmask_width)
            for b, o in zip(built, shards, strict=True)
        ]
        bitmask = None
        if any(m is not None for m in masks):
            none = np.zeros((rs, self.bitmask_width), np.int32)
            bitmask = np.concatenate([none if m is None else m for m in masks])
        plan = StepPlan(
            key=key,
            rs=rs,
            inputs=np.stack([pack(b[0])[0] for b in built]),
            sampling=np.stack([pack(b[1])[0] for b in built]),
            prompt_targets=targets,
            bitmask=bitmask,
            writes=writes,
        )
        if self.channel is not None:  # the other processes run the same step
            self.channel.send(to_message(plan, self.managers))
        packed, prompt_packed, _ = self.run_step(plan)
        for batch, b in zip(self.batches, built, strict=True):
            for g in b[2]:
                batch.num_pending[g.row] += 1
        groups = [b[2] for b in built]
        return packed, groups, prompt_packed, prompts, failed, None

    def _fetch_rows(self, result, batch, groups, packed) -> None:
        """One input batch's sampled tokens (`packed`: its rows of the step's result)."""
        tokens, lp, rank, emitted, top_ids, top_lp = unpack_result(packed, self.max_logprobs)
        if self.pooling:
            states = unpack_pooled(packed, self.max_logprobs)
            result.pooled.update({g.req_id: states[g.first].copy() for g in groups})
        for g in groups:
            rows = range(g.first, g.first + g.count)
            n = int(emitted[g.first : g.first + g.count].sum())
            if batch.generation[g.row] == g.generation:
                batch.num_pending[g.row] -= 1
                batch.append_tokens(g.row, tokens[g.first : g.first + n])
            result.sampled[g.req_id] = [
                SampledToken(int(tokens[r]), float(lp[r]), int(rank[r]), top_ids[r], top_lp[r])
                for r in rows[:n]
            ]

    def _fetch_prompt_rows(self, result, prompt_rows, packed) -> None:
        fields = unpack_prompt_logprobs(packed, self.max_logprobs)
        at = 0
        for rid, first, n in prompt_rows.spans:
            result.prompt_logprobs[rid] = (first, *(f[at : at + n] for f in fields))
            at += n

    def _fetch_shards(self, handle) -> ModelRunnerOutput:
        packed, groups, prompt_packed, prompts, failed, _ = handle
        packed = _whole(packed)  # [D * Rs, ...]: each shard's rows in turn
        result = ModelRunnerOutput(failed=failed)
        rs = packed.shape[0] // self.dp
        for d, batch in enumerate(self.batches):
            self._fetch_rows(result, batch, groups[d], packed[d * rs : (d + 1) * rs])
        if prompt_packed is not None:
            prompt_packed = _whole(prompt_packed)
            for d, rows in enumerate(prompts):
                if rows is not None:
                    at = d * PROMPT_LOGPROB_ROWS
                    self._fetch_prompt_rows(
                        result, rows, prompt_packed[at : at + PROMPT_LOGPROB_ROWS]
                    )
        return result

    def fetch(self, handle) -> ModelRunnerOutput:
        """Wait for a dispatched step: the emitted tokens of every request that sampled,
        appended to their rows (unless a row changed hands since)."""
        if not self._first_logged:
            self._first_logged = True
            jax.block_until_ready(handle[0])
            logger.info("First step took %.2f s.", time.perf_counter() - self._first_step)
        if self.dp > 1:
            return self._fetch_shards(handle)
        packed, groups, prompt_packed, prompt_rows, failed, routes = handle
        packed = np.asarray(packed.addressable_shards[0].data)  # replicated: the whole array
        result = ModelRunnerOutput(failed=failed)
        self._fetch_rows(result, self.batch, groups, packed)
        if self.draft is not None:
            result.spec_token_ids = self.draft.propose(self, groups, result.sampled)
        if prompt_rows is not None:
            prompt_packed = np.asarray(prompt_packed.addressable_shards[0].data)
            self._fetch_prompt_rows(result, prompt_rows, prompt_packed)
        if routes is not None:
            ids, tok_row, positions, slots, rows = routes
            ids = np.asarray(ids.addressable_shards[0].data)
            result.routed_experts = split_by_request(ids, tok_row, positions, slots, rows)
        return result

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it."""
        return self.fetch(self.dispatch(out))

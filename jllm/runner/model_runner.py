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

Every bucket is compiled ahead of time in `compile_all` (the equivalent of vLLM's CUDA-graph
capture), the executables are kept in a table, and once `compile_guard` is set a step whose
bucket is missing raises instead of compiling. `enforce_eager=True` skips the start-up pass:
buckets compile on first use.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.attention import get_backend
from jllm.distributed.codec import MalformedMessage
from jllm.lora.layers import lora_paths, write_slot
from jllm.models.context import StepContext
from jllm.runner.compile_cache import cache_counts
from jllm.runner.compile_guard import CompileAfterWarmupError
from jllm.runner.input_batch import InputBatch
from jllm.runner.inputs import BatchLayout, build_step, grammar_rows
from jllm.runner.logit_bias import bias_vector, write_bias
from jllm.runner.penalty_state import PenaltyWriter, write_step
from jllm.runner.prompt_logprobs import prompt_logprobs_step
from jllm.runner.prompt_logprobs import unpack as unpack_prompt_logprobs
from jllm.runner.sampled import SampledToken
from jllm.runner.sampler import sample, unpack_result
from jllm.runner.step_message import from_message, to_message
from jllm.runner.transfer import Layout, pack, unpack
from jllm.sampling_params import SamplingParams
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS, ModelRunnerOutput, SchedulerOutput
from jllm.structured_output.backends import bitmask_width
from sharding import named_sharding, replicated

logger = logging.getLogger(__name__)


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
):
    """One packed buffer in: the step's inputs. Tokens sampled by the previous step are read
    from `last_tokens` on the device. Hands on the hidden states of the tokens sample rows
    follow ([logit_rows, D], whatever the key: the sampler's executable takes the rows it
    samples) and of the tokens listed for prompt logprobs ([PROMPT_LOGPROB_ROWS, D],
    runner/prompt_logprobs.py).

    `kv_cache`: the model's KV-cache groups (a tuple of stacked caches). With a speculative
    draft model (`draft_graphdef`), `state` and `kv_cache` are pairs (target, draft): the
    draft runs over the same tokens, into its own caches through the same slots
    (spec_decode/draft_model.py). `images`: a vision-language model's encoder cache
    [slots, P, D] (runner/encoder.py), whose rows replace the image tokens' embeddings."""
    batch = unpack(buf, layout)
    on_device = last_tokens[jnp.maximum(batch.from_device, 0)]
    token_ids = jnp.where(batch.from_device >= 0, on_device, batch.token_ids)
    if draft_graphdef is not None:
        (state, draft_state), (kv_cache, draft_cache) = state, kv_cache
        draft = nnx.merge(draft_graphdef, draft_state)
        draft_attn = batch.attn[len(kv_cache) :]  # the draft's groups follow the model's
        ctx = StepContext(batch.positions, draft_attn, backend)
        _, draft_cache = draft(token_ids, ctx, draft_cache)
    model = nnx.merge(graphdef, state)
    attn = batch.attn[: len(kv_cache)]
    ctx = StepContext(batch.positions, attn, backend, lora_slots=batch.lora_slots)
    if images is not None:
        rows = images.reshape(-1, images.shape[-1])  # [slots * P, D]
        index = batch.embed_index
        ctx = ctx.replace(embeds=rows[jnp.maximum(index, 0)], embeds_mask=index >= 0)
    hidden, kv_cache = model(token_ids, ctx, kv_cache)
    if draft_graphdef is not None:
        kv_cache = (kv_cache, draft_cache)
    return hidden[batch.logits_indices], kv_cache, hidden[batch.prompt_lp_indices]


forward_step = jax.jit(
    _forward,
    static_argnames=("layout", "graphdef", "backend", "draft_graphdef"),
    donate_argnames=("kv_cache",),
)


@partial(
    jax.jit,
    static_argnames=(
        "layout",
        "graphdef",
        "logits_sharding",
        "num_logprobs",
        "logits_processors",
    ),
    donate_argnames=("counts", "last_tokens"),
)
def sample_step(
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
):
    """The LM head on the first Rs of the forward's [logit_rows, D] hidden states (Rs: the
    rows of the packed sampling metadata `buf`), then the sampler (runner/sampler.py)."""
    md = unpack(buf, layout)
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
    )


def _without_slot_axis(array) -> jax.sharding.NamedSharding:
    """The sharding of one slot of a LoRA slot array [L, S, ...]: the array's without axis 1."""
    spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
    return jax.sharding.NamedSharding(
        array.sharding.mesh, jax.sharding.PartitionSpec(spec[0], *spec[2:])
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
    ) -> None:
        self.graphdef = graphdef
        self.host_kv = None  # the host KV tier's arrays and copies (runner/host_kv.py)
        # A vision-language model's image encoder and its cache (runner/encoder.py).
        self.encoder = encoder
        # LoRA (jllm/lora/layers.py): the slot arrays' paths in the state, and which
        # adapter (digest) each slot holds.
        self.lora = lora
        self.lora_paths = [] if lora is None else lora_paths(state)
        self.lora_owner: list[bytes | None] = [None] * (0 if lora is None else lora.max_loras)
        self._lora_exe = None
        self.draft = draft  # a speculative DraftModel (spec_decode/draft_model.py), or None
        # The KV-cache groups (a CacheSpec each, runner/kv_cache.py): the model's, then the
        # draft model's. Every step carries each group's attention metadata.
        self.kv_groups = tuple(kv_caches) + (() if draft is None else tuple(draft.kv_caches))
        self.mesh = mesh
        # Step inputs and penalty state are replicated on every device of the mesh.
        self.replicated = replicated(mesh)
        self.logits_sharding = named_sharding(mesh, (None, "vocab"), (1, vocab_size))
        self.state = state
        self.kv_cache = None  # attach_kv_cache, once sized
        self.layout = layout
        layout.windows = tuple(spec.window for spec in self.kv_groups)
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
        self.batch = InputBatch(
            max_num_seqs, max_len, layout.max_pages, self.logits_processors, len(self.kv_groups)
        )
        # Penalty state (runner/penalty_state.py): row 0 stays empty.
        self.penalties = PenaltyWriter(max_num_seqs, max_len)
        shape = (self.penalties.num_rows, vocab_size)
        self.counts = jax.device_put(np.zeros(shape, np.int32), self.replicated)
        self.prompt_mask = jax.device_put(np.zeros(shape, np.bool_), self.replicated)
        # The logit-bias table (runner/logit_bias.py), row 0 zero like the penalty state.
        self.vocab_size = vocab_size
        self.bias = jax.device_put(np.zeros(shape, np.float32), self.replicated)
        # Grammar bitmasks (structured outputs): a step without any passes a zero array of
        # its row bucket, kept on the device, so only steps with a grammar transfer one.
        self.bitmask_width = bitmask_width(vocab_size)
        self._no_bitmask: dict[int, jax.Array] = {}
        self._bias_exe = None
        self._prompt_lp_exe = None
        # The last token each input-batch row sampled, where the next step reads it.
        last = np.zeros(max_num_seqs + 1, np.int32)
        self.last_tokens = jax.device_put(last, self.replicated)
        self._forward_exe: dict[tuple, object] = {}
        self._layouts: dict[tuple, tuple] = {}  # (key, Rs) -> packed layouts (followers)
        self._sample_exe: dict[int, object] = {}
        self._write_exe: dict[int, object] = {}
        self.compile_guard = False
        self.channel = None  # process 0 of a multi-process engine: a StepChannel
        self._first_step: float | None = None  # when the first step was dispatched
        self._first_logged = False

    # ---- the KV cache --------------------------------------------------------------------
    def profile_step_bytes(self, abstract_cache) -> int:
        """Device memory the largest step needs besides weights and cache: the working
        memory XLA assigns to the largest forward key, the largest sampler and the
        prompt-logprob step, compiled
        against a stand-in cache of a few blocks (the cache's size does not change it)."""
        buf, layout = pack(self._warmup_step(self.layout.largest())[0])
        buf = jax.ShapeDtypeStruct(buf.shape, buf.dtype, sharding=self.replicated)
        fwd = self._compile_forward(abstract_cache, buf, layout)
        hidden, _, prompt_hidden = fwd.out_info
        # The sampler and the prompt-logprob step do not read the cache: kept for serving.
        smp = self._sample_executable(self.layout.sample_buckets[-1], hidden)
        prompt_lp = self._prompt_lp_executable(prompt_hidden)
        # The hidden states live from one executable to the other; the rest of their
        # outputs are the cache and state they update in place.
        passed = hidden.size * hidden.dtype.itemsize
        temp = sum(exe.memory_analysis().temp_size_in_bytes for exe in (fwd, smp, prompt_lp))
        return int(temp + passed)

    def attach_kv_cache(self, kv_cache: tuple, num_blocks: int) -> None:
        """The model's KV-cache groups' caches, once sized (their shapes while compiling)."""
        self.kv_cache = kv_cache
        self.layout.num_blocks = num_blocks

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
        inputs, md, _, _, _ = build_step(
            empty, SchedulerOutput(), self.layout, self.attention, key, sample_rows
        )
        return inputs, md

    def _images(self):
        return None if self.encoder is None else self.encoder.pool

    def _compile_forward(self, kv_cache, buf, layout: Layout):
        """`kv_cache`: the target's, or the pair (target, draft) with a draft model."""
        with jax.set_mesh(self.mesh):
            return forward_step.lower(
                *self._forward_args(kv_cache),
                self.last_tokens,
                buf,
                self._images(),
                layout=layout,
                graphdef=self.graphdef,
                backend=self.attention,
                draft_graphdef=None if self.draft is None else self.draft.graphdef,
            ).compile()

    def _sampler_state(self, bitmask) -> tuple:
        """The sampler's arguments after the hidden states and metadata: the penalty state,
        the logit-bias table, the last tokens and the grammar bitmask."""
        return self.counts, self.prompt_mask, self.bias, self.last_tokens, bitmask

    def _compile_sampler(self, rs: int, hidden, buf, layout: Layout):
        bitmask = jax.ShapeDtypeStruct(
            (rs, self.bitmask_width), jnp.int32, sharding=self.replicated
        )
        with jax.set_mesh(self.mesh):
            return sample_step.lower(
                self.state,
                hidden,
                buf,
                *self._sampler_state(bitmask),
                layout=layout,
                graphdef=self.graphdef,
                logits_sharding=self.logits_sharding,
                num_logprobs=self.max_logprobs,
                logits_processors=self.logits_processors,
            ).compile()

    def _forward_executable(self, key: tuple, buf, layout: Layout):
        exe = self._forward_exe.get(key)
        if exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError(f"forward bucket {key} not compiled")
            exe = self._forward_exe[key] = self._compile_forward(self._caches(), buf, layout)
        return exe

    def forward_for(self, key: tuple):
        """The forward executable of `key`, compiled now when missing (and allowed)."""
        buf, layout = pack(self._warmup_step(key)[0])
        return self._forward_executable(key, jax.device_put(buf, self.replicated), layout)

    def _sample_executable(self, rs: int, hidden, buf=None, layout: Layout | None = None):
        """The sampler of `rs` rows; `buf` and `layout`: its packed metadata (built here from
        zero inputs when not given)."""
        exe = self._sample_exe.get(rs)
        if exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError(f"sampler bucket (Rs={rs}) not compiled")
            if buf is None:
                buf, layout = pack(self._warmup_step(self.layout.shapes()[0], rs)[1])
                buf = jax.ShapeDtypeStruct(buf.shape, buf.dtype, sharding=self.replicated)
            exe = self._sample_exe[rs] = self._compile_sampler(rs, hidden, buf, layout)
        return exe

    def _write_executable(self, w):
        W = w.rows.shape[0]
        exe = self._write_exe.get(W)
        if exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError(f"penalty write bucket (W={W}) not compiled")
            with jax.set_mesh(self.mesh):
                lowered = write_step.lower(self.counts, self.prompt_mask, w)
            exe = self._write_exe[W] = lowered.compile()
        return exe

    def _lora_arrays(self) -> list:
        flat = dict(nnx.to_flat_state(self.state))
        return [flat[p] for p in self.lora_paths]

    def write_lora(self, slot: int, adapter) -> None:
        """Write `adapter` (a LoraAdapter, or None: zeros) into device slot `slot` (1-based)
        of every slot array, in place."""
        self.write_lora_values(slot, self.lora_values(adapter))
        self.lora_owner[slot - 1] = None if adapter is None else adapter.digest

    def lora_values(self, adapter) -> list[np.ndarray]:
        """One slot's content of every slot array for `adapter` (None: zeros), float32: what
        a LoRA slot write sends to the other processes."""
        arrays = [v.get_value() for v in self._lora_arrays()]
        values = self.lora.slot_values(self.lora_paths, adapter, arrays)
        return [np.asarray(v, np.float32) for v in values]

    def write_lora_values(self, slot: int, values: list[np.ndarray]) -> None:
        """The device part of a slot write; every process of the engine runs it with the
        same values (a follower's come in the step message, checked here)."""
        variables = self._lora_arrays()
        arrays = [v.get_value() for v in variables]
        if not 1 <= slot <= len(self.lora_owner) or [v.shape for v in values] != [
            (a.shape[0], *a.shape[2:]) for a in arrays
        ]:
            raise MalformedMessage(f"a LoRA slot write (slot {slot}) of the wrong shapes")
        values = [
            jax.device_put(v, _without_slot_axis(a)) for v, a in zip(values, arrays, strict=True)
        ]
        index = jax.device_put(np.int32(slot - 1), self.replicated)
        if self._lora_exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError("LoRA slot write not compiled")
            with jax.set_mesh(self.mesh):
                self._lora_exe = write_slot.lower(arrays, index, values).compile()
        for var, new in zip(variables, self._lora_exe(arrays, index, values), strict=True):
            var.set_value(new)

    def _bias_executable(self, row, vector):
        if self._bias_exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError("logit-bias write not compiled")
            with jax.set_mesh(self.mesh):
                self._bias_exe = write_bias.lower(self.bias, row, vector).compile()
        return self._bias_exe

    def _prompt_lp_executable(self, hidden):
        if self._prompt_lp_exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError("prompt-logprob step not compiled")
            targets = jax.ShapeDtypeStruct(
                (PROMPT_LOGPROB_ROWS,), jnp.int32, sharding=self.replicated
            )
            with jax.set_mesh(self.mesh):
                self._prompt_lp_exe = prompt_logprobs_step.lower(
                    self.state,
                    hidden,
                    targets,
                    graphdef=self.graphdef,
                    num_logprobs=self.max_logprobs,
                    logits_sharding=self.logits_sharding,
                ).compile()
        return self._prompt_lp_exe

    def compile_all(self) -> None:
        """Compile every forward key and sampler bucket before serving (skipped when eager).

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

        hidden, _, prompt_hidden = run_all(forward, keys)[0].out_info  # shapes and shardings
        run_all(sampler, layout.sample_buckets)
        self._prompt_lp_executable(prompt_hidden)  # one shape: compiled once
        for W in self.penalties.write_buckets:
            w = self.penalties.empty_write(W)
            self._write_executable(jax.device_put(w, self.replicated))
        self._bias_executable(*self._put_bias_write(0, np.zeros(self.vocab_size, np.float32)))
        if self.lora is not None:
            self.write_lora(1, None)  # compiles the slot write
        if self.draft is not None:
            self.draft.compile_all(self)
        if self.encoder is not None:
            with jax.set_mesh(self.mesh):
                self.encoder.compile_all(self.state)
            self.encoder.compile_guard = True
        if self.host_kv is not None:
            self.host_kv.compile_all(self.kv_cache)
            self.host_kv.compile_guard = True
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
    def _put_bias_write(self, row: int, vector: np.ndarray):
        return (
            jax.device_put(np.int32(row), self.replicated),
            jax.device_put(vector, self.replicated),
        )

    def _bitmask(self, rows: int, bitmask):
        if bitmask is not None:
            return jax.device_put(bitmask, self.replicated)
        zeros = self._no_bitmask.get(rows)
        if zeros is None:
            zeros = np.zeros((rows, self.bitmask_width), np.int32)
            zeros = self._no_bitmask[rows] = jax.device_put(zeros, self.replicated)
        return zeros

    def step_layouts(self, key: tuple, rs: int) -> tuple[Layout, Layout]:
        """The packed layouts of forward key `key` and sampler bucket `rs`, built by the same
        code as real steps (a follower rebuilds a step message's with it)."""
        cached = self._layouts.get((key, rs))
        if cached is None:
            inputs, md = self._warmup_step(key, rs)
            cached = self._layouts[(key, rs)] = (pack(inputs)[1], pack(md)[1])
        return cached

    def run_step(
        self,
        key,
        packed_step,
        writes=(),
        bias_writes=(),
        prompt_targets=None,
        bitmask=None,
        encoder_inputs=(),
        lora_writes=(),
    ):
        """The device part of a step, from the packed host inputs ((buf, layout) of the
        StepInputs and of the SamplingMetadata, `runner/transfer.py`) to the packed result,
        still on the device (JAX dispatches asynchronously), after the admitted rows'
        LoRA slot (`lora_writes`: (slot, values) each), penalty and logit-bias writes; with
        `prompt_targets`, also the packed prompt logprobs (else None); `bitmask`: the step's
        grammar bitmask [Rs, W], or None; `encoder_inputs`: the images to encode first
        ((slot, pixels) each). Every process of a multi-process engine runs it with the
        same inputs."""
        for slot, values in lora_writes:
            self.write_lora_values(slot, values)
        if encoder_inputs:
            with jax.set_mesh(self.mesh):
                self.encoder.run(self.state, list(encoder_inputs))
        (buf, layout), (md_buf, md_layout) = packed_step
        for w in writes:
            w = jax.device_put(w, self.replicated)
            exe = self._write_executable(w)
            self.counts, self.prompt_mask = exe(self.counts, self.prompt_mask, w)
        for row, vector in bias_writes:
            row, vector = self._put_bias_write(row, vector)
            self.bias = self._bias_executable(row, vector)(self.bias, row, vector)
        buf, md_buf = jax.device_put((buf, md_buf), self.replicated)
        fwd = self._forward_executable(key, buf, layout)
        hidden, caches, prompt_hidden = fwd(
            *self._forward_args(self._caches()), self.last_tokens, buf, self._images()
        )
        if self.draft is None:
            self.kv_cache = caches
        else:
            self.kv_cache, self.draft.kv_cache = caches
        rs = _sample_rows(md_layout)
        smp = self._sample_executable(rs, hidden, md_buf, md_layout)
        packed, self.counts, self.last_tokens = smp(
            self.state, hidden, md_buf, *self._sampler_state(self._bitmask(rs, bitmask))
        )
        prompt_packed = None
        if prompt_targets is not None:
            targets = jax.device_put(prompt_targets, self.replicated)
            prompt_lp = self._prompt_lp_executable(prompt_hidden)
            prompt_packed = prompt_lp(self.state, prompt_hidden, targets)
        return packed, prompt_packed

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
            step = from_message(message, self.step_layouts)
            jax.block_until_ready(self.run_step(*step))

    def _apply(self, out: SchedulerOutput):
        """Bring the input batch up to date with the scheduler's output; returns the penalty
        writes, the logit-bias writes and the LoRA slot writes for the admitted rows, and
        the requests whose admission failed ({req id: reason})."""
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.batch.remove(rid)
        admitted, bias_writes, failed, lora_writes = [], [], {}, []
        for new in out.scheduled_new_reqs:
            if new.lora_slot and self.lora_owner[new.lora_slot - 1] != new.lora.digest:
                lora_writes.append((new.lora_slot, self.lora_values(new.lora)))
                self.lora_owner[new.lora_slot - 1] = new.lora.digest
            try:
                row = self.batch.add(new)
                p = new.sampling_params
                bias = bias_vector(p, self.vocab_size) if p.has_bias else None
            except Exception as e:  # noqa: BLE001 - fails this request only
                failed[new.req_id] = self._admit_neutral(new, e)
                continue
            if p.has_penalties:
                admitted.append((row + 1, new.prompt_token_ids, new.output_token_ids))
            if bias is not None:
                bias_writes.append((row + 1, bias))
        self.batch.update(out.scheduled_cached_reqs)
        return self.penalties.admit(admitted), bias_writes, lora_writes, failed

    def _admit_neutral(self, new, error: Exception) -> str:
        """A request whose row could not be written (its sampling parameters): it still
        runs this step with greedy defaults, so its scheduled tokens fill its KV blocks as
        the scheduler expects, and the engine fails it alone with the returned reason."""
        logger.error("Request %s could not be admitted: %r", new.req_id, error)
        self.batch.remove(new.req_id)
        self.batch.add(dataclasses.replace(new, sampling_params=SamplingParams(temperature=0)))
        return f"{type(error).__name__}: {error}"

    def dispatch(self, out: SchedulerOutput):
        """Start one step on the device and return without waiting for it: a handle for
        `fetch`. The rows that sample hold a pending token until then."""
        if self._first_step is None:
            self._first_step = time.perf_counter()
        writes, bias_writes, lora_writes, failed = self._apply(out)
        if self.host_kv is not None and (out.kv_stores or out.kv_loads):
            self.kv_cache = self.host_kv.copy(self.kv_cache, out.kv_stores, out.kv_loads)
        inputs, md, groups, key, prompt_rows = build_step(
            self.batch, out, self.layout, self.attention
        )
        targets = None if prompt_rows is None else prompt_rows.targets
        bitmask = grammar_rows(groups, out.grammar_bitmask, len(md.masked), self.bitmask_width)
        step = pack(inputs), pack(md)
        images = out.encoder_inputs
        if self.channel is not None:  # the other processes run the same step
            (buf, _), (md_buf, _) = step
            rs = md.batch_row.shape[0]
            message = to_message(
                key, rs, buf, md_buf, writes, bias_writes, targets, bitmask, images, lora_writes
            )
            self.channel.send(message)
        packed, prompt_packed = self.run_step(
            key, step, writes, bias_writes, targets, bitmask, images, lora_writes
        )
        for g in groups:
            self.batch.num_pending[g.row] += 1
        return packed, groups, prompt_packed, prompt_rows, failed

    def fetch(self, handle) -> ModelRunnerOutput:
        """Wait for a dispatched step: the emitted tokens of every request that sampled,
        appended to their rows (unless a row changed hands since)."""
        packed, groups, prompt_packed, prompt_rows, failed = handle
        packed = np.asarray(packed.addressable_shards[0].data)  # replicated: the whole array
        if not self._first_logged:
            self._first_logged = True
            logger.info("First step took %.2f s.", time.perf_counter() - self._first_step)
        tokens, lp, rank, emitted, top_ids, top_lp = unpack_result(packed, self.max_logprobs)
        result = ModelRunnerOutput(failed=failed)
        batch = self.batch
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
        if self.draft is not None:
            result.spec_token_ids = self.draft.propose(self, groups)
        if prompt_rows is not None:
            fields = unpack_prompt_logprobs(
                np.asarray(prompt_packed.addressable_shards[0].data), self.max_logprobs
            )
            at = 0
            for rid, first, n in prompt_rows.spans:
                result.prompt_logprobs[rid] = (first, *(f[at : at + n] for f in fields))
                at += n
        return result

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it."""
        return self.fetch(self.dispatch(out))

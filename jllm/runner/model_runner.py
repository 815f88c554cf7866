"""The model runner: the only owner of device arrays (weights, KV cache, penalty state).

Each engine step it builds the padded flat batch in numpy, hands it to the device in one
transfer, runs the compiled forward for the batch's (Rd, Tt) bucket and the compiled sampler
for its row bucket, and brings back only the sampled ids and requested logprobs.

Every bucket is compiled ahead of time in `compile_all` (the equivalent of vLLM's CUDA-graph
capture), the executables are kept in a table, and once `compile_guard` is set a step whose
bucket is missing raises instead of compiling. `enforce_eager=True` skips the start-up pass:
buckets compile on first use.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.engine.scheduler import SchedulerOutput
from jllm.runner.inputs import (
    BatchLayout,
    StepInputs,
    build_sampling_metadata,
    build_step_inputs,
)
from jllm.runner.penalty_state import PenaltyRows, write_step
from jllm.runner.sampled import SampledToken
from jllm.runner.sampler import sample
from sharding import named_sharding, replicated

logger = logging.getLogger(__name__)


class CompileAfterWarmupError(RuntimeError):
    pass


def _forward(state, kv_cache, counts, batch: StepInputs, *, graphdef, backend, logits_sharding):
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(batch.token_ids, batch.positions, kv_cache, batch.attn, backend)
    logits = model.compute_logits(hidden[batch.logits_indices])  # [Rs, V]
    # One fixed layout for the sampler, whatever the bucket (vocab-split under TP).
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    # Penalty state: count the tokens sampled since each sequence's admission.
    counts = counts.at[batch.penalty_token_rows, batch.token_ids].add(1, mode="drop")
    return logits, kv_cache, counts


forward_step = jax.jit(
    _forward,
    static_argnames=("graphdef", "backend", "logits_sharding"),
    donate_argnames=("kv_cache", "counts"),
)


class ModelRunner:
    def __init__(
        self,
        graphdef,
        state,
        kv_cache: jax.Array,
        layout: BatchLayout,
        vocab_size: int,
        max_num_seqs: int,
        max_logprobs: int,
        backend: str,
        enforce_eager: bool,
        mesh,
    ) -> None:
        self.graphdef = graphdef
        self.mesh = mesh
        # Step inputs and penalty state are replicated on every device of the mesh.
        self.replicated = replicated(mesh)
        self.logits_sharding = named_sharding(mesh, (None, "vocab"), (1, vocab_size))
        self.state = state
        self.kv_cache = kv_cache
        self.layout = layout
        self.backend = backend
        self.enforce_eager = enforce_eager
        self.max_logprobs = max_logprobs
        # Penalty state (runner/penalty_state.py): row 0 stays empty.
        self.penalties = PenaltyRows(max_num_seqs, layout.max_pages * layout.block_size)
        shape = (self.penalties.num_rows, vocab_size)
        self.counts = jax.device_put(np.zeros(shape, np.int32), self.replicated)
        self.prompt_mask = jax.device_put(np.zeros(shape, np.bool_), self.replicated)
        self._forward_exe: dict[tuple[int, int], object] = {}
        self._sample_exe: dict[int, object] = {}
        self._write_exe: dict[int, object] = {}
        self.compile_guard = False
        self.channel = None  # process 0 of a multi-process engine: a StepChannel

    # ---- compilation ---------------------------------------------------------------------
    def _abstract_inputs(self, rd: int, tt: int):
        """Zero inputs of the (Rd, Tt) bucket, built by the same code as real steps."""
        inputs, _, _, rs = build_step_inputs(
            SchedulerOutput(), self.layout, {}, {}, self.penalties.num_rows, shape=(rd, tt)
        )
        md = build_sampling_metadata([], [], rs, {}, self.max_logprobs)
        return inputs, md, rs

    def _forward_executable(self, rd: int, tt: int, inputs):
        exe = self._forward_exe.get((rd, tt))
        if exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError(f"forward bucket (Rd={rd}, Tt={tt}) not compiled")
            with jax.set_mesh(self.mesh):
                lowered = forward_step.lower(
                    self.state,
                    self.kv_cache,
                    self.counts,
                    inputs,
                    graphdef=self.graphdef,
                    backend=self.backend,
                    logits_sharding=self.logits_sharding,
                )
            exe = self._forward_exe[(rd, tt)] = lowered.compile()
        return exe

    def _sample_executable(self, rs: int, logits, md):
        exe = self._sample_exe.get(rs)
        if exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError(f"sampler bucket (R={rs}) not compiled")
            with jax.set_mesh(self.mesh):
                lowered = sample.lower(
                    logits, md, self.counts, self.prompt_mask, num_logprobs=self.max_logprobs
                )
            exe = self._sample_exe[rs] = lowered.compile()
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

    def compile_all(self) -> None:
        """Compile every forward and sampler bucket before serving (skipped when eager).

        One after another: compiling on a thread per core (XLA releases the GIL) was slower
        on the 2-core CPU, 100 s against 92 s for the 89 SmolLM2 buckets, since XLA's CPU
        compiler already uses the cores."""
        if self.enforce_eager:
            logger.info("enforce_eager=True: buckets compile on first use.")
            return
        shapes = self.layout.shapes()
        logger.info(
            "Compiling %d forward buckets (decode rows %s x prefill tiles of %d tokens %s) "
            "and %d sampler buckets.",
            len(shapes),
            self.layout.decode_buckets,
            self.layout.tile_size,
            self.layout.tile_buckets,
            len(self.layout.sample_buckets),
        )
        start = time.perf_counter()
        for i, (rd, tt) in enumerate(shapes):
            inputs, md, rs = self._abstract_inputs(rd, tt)
            t0 = time.perf_counter()
            self._forward_executable(rd, tt, jax.device_put(inputs, self.replicated))
            logger.debug("Compiled (Rd=%d, Tt=%d) in %.2fs", rd, tt, time.perf_counter() - t0)
            if rs not in self._sample_exe:
                logits = jax.ShapeDtypeStruct(
                    (rs, self._vocab()), jnp.float32, sharding=self.logits_sharding
                )
                self._sample_executable(rs, logits, jax.device_put(md, self.replicated))
            if (i + 1) % 16 == 0 or i + 1 == len(shapes):
                logger.info("Compiled %d/%d buckets.", i + 1, len(shapes))
        for W in self.penalties.write_buckets:
            w = self.penalties.empty_write(W)
            self._write_executable(jax.device_put(w, self.replicated))
        logger.info("Graph compilation finished in %.1f secs.", time.perf_counter() - start)
        self.compile_guard = True

    def _vocab(self) -> int:
        return self.counts.shape[1]

    # ---- requests ------------------------------------------------------------------------
    def free_request(self, request_id: str) -> None:
        self.penalties.free(request_id)

    # ---- the step ------------------------------------------------------------------------
    def run_step(self, inputs: StepInputs, md, writes=()):
        """The device part of a step, from host inputs to host results. Every process of a
        multi-process engine runs it with the same inputs."""
        for w in writes:
            w = jax.device_put(w, self.replicated)
            exe = self._write_executable(w)
            self.counts, self.prompt_mask = exe(self.counts, self.prompt_mask, w)
        rd = inputs.attn.decode_kv_lens.shape[0]
        tt = inputs.attn.tile_q_pos.shape[0]
        rs = md.want_logprobs.shape[0]
        inputs, md = jax.device_put((inputs, md), self.replicated)
        fwd = self._forward_executable(rd, tt, inputs)
        logits, self.kv_cache, self.counts = fwd(self.state, self.kv_cache, self.counts, inputs)
        smp = self._sample_executable(rs, logits, md)
        out = smp(logits, md, self.counts, self.prompt_mask)
        # Replicated results: this process's first shard is the whole array.
        return [np.asarray(x.addressable_shards[0].data) for x in out]

    def follow(self, channel) -> None:
        """Processes other than 0: run the steps process 0 sends until it stops."""
        while True:
            message = channel.recv()
            if message[0] == "stop":
                return
            _, inputs, md, writes = message
            self.run_step(inputs, md, writes)

    def execute(self, out: SchedulerOutput) -> list[SampledToken | None]:
        """Run one step; one entry per `out.scheduled` (None where nothing is sampled)."""
        writes = self.penalties.admit(
            (s.request.request_id, s.request.prompt_token_ids, s.request.output_token_ids)
            for s in out.scheduled
            if s.new and s.request.sampling_params.has_penalties
        )
        pen = self.penalties
        inputs, ordered, sample_row, rs = build_step_inputs(
            out, self.layout, pen.row, pen.start, pen.num_rows
        )
        md = build_sampling_metadata(ordered, sample_row, rs, pen.row, self.max_logprobs)
        if self.channel is not None:  # the other processes run the same step
            self.channel.send(("step", inputs, md, writes))
        tokens, lp, rank, top_ids, top_lp = self.run_step(inputs, md, writes)
        by_request = {}
        for s, r in zip(ordered, sample_row, strict=True):
            if r is not None:
                by_request[id(s)] = SampledToken(
                    int(tokens[r]), float(lp[r]), int(rank[r]), top_ids[r], top_lp[r]
                )
        return [by_request.get(id(s)) for s in out.scheduled]

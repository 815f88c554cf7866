"""Pipeline parallelism: the decoder's layers run as stages of consecutive layers, each on
its own devices, with the step's tokens cut into micro-batches that flow through them.

The mesh's `stage` axis (`sharding/`) splits every layer stack's leading layer axis and
every KV-cache group's rows: stage s holds its run of consecutive layers and their cache
rows, nothing else (`stage_repeats` decides the runs as vLLM does; unequal runs pad every
stage's stacks to the largest run, and a stage skips those rows: `CausalLM.stage_slots`).
The embedding, the final norm and the LM head are not split by stage (the `model` axis
still splits them under tensor parallelism).

The schedule is GPipe's, inside one compiled step: the step's T tokens are cut into M
micro-batches of T/M consecutive tokens (`num_micro_batches`), and in tick i stage s runs
micro-batch i - s through its layers, then hands its activations to stage s + 1 (one
`ppermute` of [T/M, D] per boundary per tick). M + S - 1 ticks run all M micro-batches
through all S stages; a stage idles (`lax.cond`: it computes nothing) in the S - 1 ticks
where it has no micro-batch. The last stage's outputs are summed over the stage axis once,
so every device holds the step's hidden states for the LM head.

Why micro-batches inside the step rather than several scheduler batches in flight (vLLM's
virtual engines): one program over the whole mesh is how JAX runs several devices, and it
keeps every step's bookkeeping (the scheduler, the runner's pending tokens, the multi-host
step channel) exactly as with one stage; each step still pays the pipeline's fill, (S - 1) /
(M + S - 1) of its ticks.

A micro-batch's attention needs its own metadata: each row's queries cut to the
micro-batch's tokens, and its context length cut to the last of them
(`split_ragged`), computed on the device from the step's metadata. Causality holds across
the cut: micro-batch m's keys are in the cache before m + 1 runs the same layer. The XLA
backend's tiled metadata is not cut: with it a step is one micro-batch.

Glossary: T tokens, D model dim, S stages, M micro-batches, R request rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jllm.attention.metadata import RaggedMetadata
from sharding import STAGE_AXIS

logger = logging.getLogger("jllm")


def num_stages() -> int:
    """The stage count of the mesh being traced under (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(STAGE_AXIS, 1)


def micro_batch_count(tokens: int, stages: int) -> int:
    """M for a step of `tokens` tokens over `stages` stages: as many as stages (the fewest
    that keep every stage busy once the pipeline is full) when the tokens divide evenly,
    else the largest count below that does."""
    return max(m for m in range(1, min(stages, tokens) + 1) if tokens % m == 0)


def num_micro_batches(tokens: int, stages: int, attn: tuple) -> int:
    """`micro_batch_count`, or 1 when a KV-cache group's metadata cannot be cut (the XLA
    backend's tiles)."""
    if not all(isinstance(md, RaggedMetadata) for md in attn):
        return 1
    return micro_batch_count(tokens, stages)


def split_ragged(md: RaggedMetadata, m: int, size: int) -> RaggedMetadata:
    """The metadata of tokens [m size, (m + 1) size) of the step: each row keeps the part of
    its queries inside them, and its context ends at the last of them (later queries'
    keys are not written yet). A row with no query there gets no context."""
    start = m * size
    first, end = md.query_start, md.query_start + md.query_lens
    cut_first = jnp.clip(first, start, start + size)
    cut_end = jnp.clip(end, start, start + size)
    lens = cut_end - cut_first
    kv_lens = jnp.where(lens > 0, md.kv_lens - (end - cut_end), 0)
    return dataclasses.replace(
        md,
        slot_mapping=jax.lax.dynamic_slice_in_dim(md.slot_mapping, start, size),
        kv_lens=kv_lens.astype(md.kv_lens.dtype),
        query_start=(cut_first - start).astype(md.query_start.dtype),
        query_lens=lens.astype(md.query_lens.dtype),
    )


def _token_slice(a, m, size):
    """Tokens [m size, (m + 1) size) of a per-token array ([T] or [3, T]: the last axis)."""
    return None if a is None else jax.lax.dynamic_slice_in_dim(a, m * size, size, axis=-1)


def micro_batch(ctx, m, size: int, micro: int):
    """The step context of micro-batch `m` (traced) of `micro`, `size` tokens each."""
    if micro == 1:
        return ctx
    return ctx.replace(
        positions=_token_slice(ctx.positions, m, size),
        attn=tuple(split_ragged(md, m, size) for md in ctx.attn),
        lora_slots=_token_slice(ctx.lora_slots, m, size),
        live=_token_slice(ctx.live, m, size),
    )


def run(model, x, ctx, kv_caches: tuple, stages: int, in_place):
    """The decoder's layers over `stages` stages: x [T, D] -> (x [T, D] after the last
    layer, the updated caches). `model`: the CausalLM, whose layers are one segment under
    stages (`CausalLM.segments_of`), its repeats an equal number of rows per stage;
    `in_place`: its filter of the weights the layers read from the whole stack
    (`decoder._stays_stacked`)."""
    T, D = x.shape
    micro = num_micro_batches(T, stages, ctx.attn)
    size = T // micro
    parts = model.segment_parts(0, in_place)
    width = model.segments[0].repeats // stages  # each stage's rows
    slots = None  # [pattern, stages x width]: the filled slots, when some are empty
    if model.slots is not None:
        slots = jnp.asarray([[layer is not None for layer in row] for row in model.slots])
    graphdefs = [graphdef for graphdef, _, _ in parts]
    arrays = [(stacked, state) for _, stacked, state in parts]

    def stage_step(arrays, kv_caches, x, step_ctx):
        stage = jax.lax.axis_index(STAGE_AXIS)
        parts = [(g, stacked, state) for g, (stacked, state) in zip(graphdefs, arrays, strict=True)]
        xs = x.reshape(micro, size, D)

        active = None  # the stage's own slots
        if slots is not None:
            active = jax.lax.dynamic_slice_in_dim(slots, stage * width, width, axis=1)

        def layers(h, caches, m):
            ctx_m = micro_batch(step_ctx, m, size, micro)
            return model.scan_segment(0, parts, h, ctx_m, caches, active)[:2]

        def idle(h, caches, m):
            return h, caches

        def tick(i, carry):
            h, caches, out = carry
            m = i - stage
            busy = (m >= 0) & (m < micro)
            m = jnp.clip(m, 0, micro - 1)
            h = jnp.where(stage == 0, xs[jnp.minimum(i, micro - 1)], h)
            h, caches = jax.lax.cond(busy, layers, idle, h, caches, m)
            done = busy & (stage == stages - 1)
            out = out.at[m].set(jnp.where(done, h, out[m]))
            h = jax.lax.ppermute(h, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
            return h, caches, out

        carry = (jnp.zeros((size, D), x.dtype), kv_caches, jnp.zeros_like(xs))
        _, kv_caches, out = jax.lax.fori_loop(0, micro + stages - 1, tick, carry)
        # Only the last stage's rows are nonzero: the sum hands them to every stage.
        return jax.lax.psum(out, STAGE_AXIS).reshape(T, D), kv_caches

    split = P(STAGE_AXIS)
    whole = P()
    x, kv_caches = jax.shard_map(
        stage_step,
        in_specs=(
            jax.tree.map(lambda _: split, arrays),
            jax.tree.map(lambda _: split, kv_caches),
            whole,
            jax.tree.map(lambda _: whole, ctx),
        ),
        out_specs=(whole, jax.tree.map(lambda _: split, kv_caches)),
        axis_names={STAGE_AXIS},
        check_vma=False,
    )(arrays, kv_caches, x, ctx)
    return x, kv_caches


def vllm_partition(layers: int, stages: int) -> list[int]:
    """vLLM's default split of `layers` over `stages` (`get_pp_indices`): equal runs, and the
    remainder one each to the stages before the last (which also holds the final norm)."""
    sizes = [layers // stages] * stages
    for i in range(2, layers % stages + 2):
        sizes[-i] += 1
    return sizes


def stage_layers(module, cfg) -> tuple[int, ...]:
    """The checkpoint layers each pipeline stage of decoder `module` (a CausalLM class)
    holds, for a config with `stage_repeats`."""
    stages, unit = cfg.stage_repeats, len(module.segments_of(cfg)[0].pattern)
    ends = [min(sum(stages[: s + 1]) * unit, cfg.num_layers) for s in range(len(stages))]
    return tuple(end - start for start, end in zip([0, *ends[:-1]], ends, strict=True))


def stage_repeats(module, cfg, stages: int) -> tuple[int, ...]:
    """How many repeats of its layer pattern each of `stages` stages holds, for decoder
    `module` (a CausalLM class) of config `cfg`; refuses, with the reason, a split jllm
    cannot run. The model's layers must be one pattern repeated, the last repeat perhaps cut
    short (Gemma 3's 26 layers: 5 local and 1 global, four times, then 2 local); a stage
    holds whole repeats. The split is VLLM_PP_LAYER_PARTITION's when set, else vLLM's
    default (`vllm_partition`) over the layers, or over the repeats where that would cut
    one."""
    if getattr(cfg, "vision", None) is not None:
        raise ValueError(
            "pipeline_parallel_size > 1 is not supported for vision-language models yet."
        )
    kinds = tuple(module.layer_kinds(cfg))
    layers = len(kinds)
    if stages > layers:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's {layers} layers.")
    pattern = module.segments_of(cfg)[0].pattern
    unit = len(pattern)
    repeats = -(-layers // unit)
    if (pattern * repeats)[:layers] != kinds:
        raise ValueError(
            f"pipeline_parallel_size={stages}: this model's layers are not one repeated "
            "pattern (its layer kinds change along the depth), which jllm's stages do not "
            "split yet."
        )
    if stages > repeats:
        raise ValueError(
            f"pipeline_parallel_size={stages} exceeds the {repeats} repeats of the model's "
            f"{unit}-layer pattern, which a stage holds whole."
        )
    partition = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if partition is None:
        sizes = vllm_partition(layers, stages)
        if any(n % unit for n in sizes[:-1]):
            sizes = [n * unit for n in vllm_partition(repeats, stages)]
            sizes[-1] -= repeats * unit - layers  # the cut repeat
    else:
        try:
            sizes = [int(n) for n in partition.split(",")]
        except ValueError as err:
            raise ValueError(f"Invalid VLLM_PP_LAYER_PARTITION: {partition!r}.") from err
        if len(sizes) != stages or sum(sizes) != layers or min(sizes) < 1:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={partition!r} must name {stages} stage sizes of at "
                f"least one layer that add up to the model's {layers} layers."
            )
        if any(n % unit for n in sizes[:-1]):
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={partition!r}: each stage must hold whole repeats "
                f"of the model's {unit}-layer pattern."
            )
    if len(set(sizes)) > 1:
        logger.info(
            "Hidden layers were unevenly partitioned: [%s] (VLLM_PP_LAYER_PARTITION overrides "
            "it); each stage's layer stacks are padded to the largest stage's.",
            ",".join(map(str, sizes)),
        )
    return tuple(-(-n // unit) for n in sizes)

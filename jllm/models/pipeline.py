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
    layer, the updated caches). `model`: the CausalLM, each of whose segments' stacks has
    an equal number of rows per stage (`CausalLM.segments_of`): a stage runs its rows of
    each segment in turn, the empty ones skipped;
    `in_place`: its filter of the weights the layers read from the whole stack
    (`decoder._stays_stacked`)."""
    T, D = x.shape
    micro = num_micro_batches(T, stages, ctx.attn)
    size = T // micro
    count = len(model.segments)
    parts = [model.segment_parts(k, in_place) for k in range(count)]
    widths = [seg.repeats // stages for seg in model.segments]  # each stage's rows
    # Per segment [pattern, stages x width]: the filled slots, when some are empty.
    slots = [None] * count
    if model.slots is not None:
        slots = [jnp.asarray([[n is not None for n in row] for row in t]) for t in model.slots]
    graphdefs = [[graphdef for graphdef, _, _ in p] for p in parts]
    arrays = [[(stacked, state) for _, stacked, state in p] for p in parts]

    def stage_step(arrays, kv_caches, x, step_ctx):
        stage = jax.lax.axis_index(STAGE_AXIS)
        parts = [
            [(g, stacked, state) for g, (stacked, state) in zip(gs, a, strict=True)]
            for gs, a in zip(graphdefs, arrays, strict=True)
        ]
        xs = x.reshape(micro, size, D)
        active = [  # the stage's own slots of each segment
            None if t is None else jax.lax.dynamic_slice_in_dim(t, stage * w, w, axis=1)
            for t, w in zip(slots, widths, strict=True)
        ]

        def layers(h, caches, m):
            ctx_m = micro_batch(step_ctx, m, size, micro)
            for k in range(count):
                h, caches = model.scan_segment(k, parts[k], h, ctx_m, caches, active[k])[:2]
            return h, caches

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
    holds, for a config with `stage_repeats` or `stage_segments`."""
    if cfg.stage_segments is not None:
        units = [len(seg.pattern) for seg in module.segments_of(cfg)]
        return tuple(
            sum(r * u for r, u in zip(row, units, strict=True)) for row in cfg.stage_segments
        )
    stages, unit = cfg.stage_repeats, len(module.segments_of(cfg)[0].pattern)
    ends = [min(sum(stages[: s + 1]) * unit, cfg.num_layers) for s in range(len(stages))]
    return tuple(end - start for start, end in zip([0, *ends[:-1]], ends, strict=True))


def stage_plan(module, cfg, stages: int) -> dict:
    """The config fields that split decoder `module`'s (a CausalLM class) layers of config
    `cfg` over `stages` stages: `stage_repeats` for layers that are one pattern repeated
    (`stage_repeats`), else `stage_segments`: each stage's repeats of each segment
    (`decoder.plan_segments`: DeepSeek's dense layers then its sparse ones, Qwen3-MoE's
    dense layers among the sparse), every stage holding consecutive layers, vLLM's split.
    Refuses, with the reason, a split jllm cannot run."""
    if getattr(cfg, "vision", None) is not None:
        raise ValueError(
            "pipeline_parallel_size > 1 is not supported for vision-language models yet."
        )
    kinds = tuple(module.layer_kinds(cfg))
    layers = len(kinds)
    if stages > layers:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's {layers} layers.")
    segments = module.segments_of(cfg)
    pattern = segments[0].pattern
    repeats = -(-layers // len(pattern))
    if (pattern * repeats)[:layers] == kinds:
        return {"stage_repeats": stage_repeats(module, cfg, stages)}
    return {"stage_segments": stage_segments(segments, stages)}


def _partition(layers: int, stages: int, unit: int = 1) -> list[int] | None:
    """VLLM_PP_LAYER_PARTITION's stage sizes, checked (each stage but the last whole repeats
    of a `unit`-layer pattern), or None when it is not set."""
    partition = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if partition is None:
        return None
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
    return sizes


def _log_uneven(sizes: list[int]) -> None:
    if len(set(sizes)) > 1:
        logger.info(
            "Hidden layers were unevenly partitioned: [%s] (VLLM_PP_LAYER_PARTITION overrides "
            "it); each stage's layer stacks are padded to the largest stage's.",
            ",".join(map(str, sizes)),
        )


def stage_segments(segments, stages: int) -> tuple[tuple[int, ...], ...]:
    """Per stage, its repeats of each of the model's `segments` (`decoder.plan_segments`):
    the stages hold vLLM's runs of consecutive layers (or VLLM_PP_LAYER_PARTITION's), each
    starting and ending on whole repeats of the segments it cuts."""
    layers = sum(seg.num_layers for seg in segments)
    sizes = _partition(layers, stages) or vllm_partition(layers, stages)
    plan, start = [], 0
    for size in sizes:
        end, row = start + size, []
        for seg in segments:
            first, last = max(start, seg.first), min(end, seg.first + seg.num_layers)
            count, unit = max(0, last - first), len(seg.pattern)
            if count and ((first - seg.first) % unit or count % unit):
                raise ValueError(
                    f"pipeline_parallel_size={stages}: the stages' layers {sizes} cut a "
                    f"repeat of the model's {unit}-layer pattern at layers "
                    f"{seg.first}..{seg.first + seg.num_layers - 1}; set "
                    "VLLM_PP_LAYER_PARTITION to stages of whole repeats."
                )
            row.append(count // unit)
        plan.append(tuple(row))
        start = end
    _log_uneven(sizes)
    empty = [
        stages * max(row[k] for row in plan) * len(seg.pattern) - seg.num_layers
        for k, seg in enumerate(segments)
    ]
    logger.info(
        "Pipeline stages of layers in %d segments (%s layers): each segment's stack holds as "
        "many slots per stage as its fullest stage, %s of them empty (each a copy of a "
        "layer's weights and cache rows); VLLM_PP_LAYER_PARTITION may balance them.",
        len(segments),
        ", ".join(str(seg.num_layers) for seg in segments),
        ", ".join(map(str, empty)),
    )
    return tuple(plan)


def stage_repeats(module, cfg, stages: int) -> tuple[int, ...]:
    """How many repeats of its layer pattern each of `stages` stages holds, for decoder
    `module` (a CausalLM class) of config `cfg` whose layers are one pattern repeated, the
    last repeat perhaps cut short (Gemma 3's 26 layers: 5 local and 1 global, four times,
    then 2 local); a stage holds whole repeats. The split is VLLM_PP_LAYER_PARTITION's when
    set, else vLLM's default (`vllm_partition`) over the layers, or over the repeats where
    that would cut one."""
    layers = cfg.num_layers
    unit = len(module.segments_of(cfg)[0].pattern)
    repeats = -(-layers // unit)
    if stages > repeats:
        raise ValueError(
            f"pipeline_parallel_size={stages} exceeds the {repeats} repeats of the model's "
            f"{unit}-layer pattern, which a stage holds whole."
        )
    sizes = _partition(layers, stages, unit)
    if sizes is None:
        sizes = vllm_partition(layers, stages)
        if any(n % unit for n in sizes[:-1]):
            sizes = [n * unit for n in vllm_partition(repeats, stages)]
            sizes[-1] -= repeats * unit - layers  # the cut repeat
    _log_uneven(sizes)
    return tuple(-(-n // unit) for n in sizes)

"""Every step executable lowers for TPU and for CUDA from this CPU host (no accelerator
needed): the forward with the attention kernel `auto` picks there (the Pallas TPU kernel
through Mosaic, the Pallas GPU kernel through Triton) and the sampler, on an abstract mesh
naming the target device, at TP=1 and TP=4 (and the pipelined step of two stages of TP=2):
every bucket for a tiny model, and the smallest, a middle and the largest for the shapes of
Llama-3.1-8B, DeepSeek-V2-Lite (latent attention, 64 experts), Qwen3-Next-80B-A3B (the gated
delta rule's kernels beside attention), gpt-oss-20b and Llama 4 Scout. A lowering error
fails here instead of on a user's TPU or GPU, and no CPU kernel leaks into a step traced for
another platform."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from oracle import SMALL
from transformers import AutoConfig

from jllm import LLM
from jllm.attention import get_backend
from jllm.kv_cache_interface import MambaSpec
from jllm.model_loader.loader import abstract_model
from jllm.models import registry
from jllm.runner.buckets import BatchLayout
from jllm.runner.kv_cache import CACHE_AXES, abstract_kv_cache
from jllm.runner.model_runner import ModelRunner, forward_step, sample_step
from jllm.runner.transfer import pack
from sharding import make_mesh, named_sharding, param_axes

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "gpu" / "configs"

TARGETS = {
    "tpu": (("TPU v5 lite", 1, "tpu"), "pallas", "tpu_custom_call"),
    "cuda": (("NVIDIA H100 80GB HBM3", 132, "gpu"), "pallas_gpu", "__gpu$xla.gpu.triton"),
}


def target_mesh(device, tp: int, pp: int = 1) -> jax.sharding.AbstractMesh:
    """The engine's (data, stage, model) mesh of `pp` stages of `tp` devices of the target
    kind, abstract."""
    auto = jax.sharding.AxisType.Auto
    return jax.sharding.AbstractMesh(
        (1, pp, tp),
        ("data", "stage", "model"),
        axis_types=(auto, auto, auto),
        abstract_device=jax.sharding.AbstractDevice(*device),
    )


def on(mesh):
    """Each array's shape, dtype and partitioning, on the abstract `mesh` (the engine's arrays
    name the CPU mesh)."""

    def one(a):
        spec = getattr(getattr(a, "sharding", None), "spec", None)
        sharding = None if spec is None else jax.sharding.NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return lambda tree: jax.tree.map(one, tree)


@pytest.fixture(scope="module")
def runners(llama_dir):
    """An engine per dtype and tensor-parallel size (on fake CPU devices): on this CPU a
    float32 model's products run in a C++ kernel, which a step traced for TPU or CUDA must
    not call; under TP=4 the attention kernel runs in a shard_map over the heads."""
    cases = {("bfloat16", 1), ("float32", 1), ("bfloat16", 4)}
    return {
        (dtype, tp): LLM(llama_dir, dtype=dtype, tensor_parallel_size=tp, **SMALL).llm_engine.runner
        for dtype, tp in cases
    }


def lower_every_step(
    runner, layout: BatchLayout, state, caches, mesh, platform, ends_only: bool = False
) -> int:
    """Lowers the forward of every key of `layout` and the sampler of every row bucket for
    `platform` on the abstract `mesh`, with the attention kernel `auto` picks there;
    `state` and `caches` abstract. `ends_only`: the first, middle and last forward key and
    the first and last row bucket. Returns how many executables it lowered."""
    device, backend, kernel = TARGETS[platform]
    abstract = on(mesh)
    target = copy.copy(runner)  # the runner's warm-up inputs, at the target's layout
    target.layout = layout
    lower = {"lowering_platforms": (platform,)}
    last = abstract(runner.last_tokens)
    keys, rows_buckets = layout.shapes(), layout.sample_buckets
    if ends_only:
        keys = [keys[0], keys[len(keys) // 2], keys[-1]]
        rows_buckets = [rows_buckets[0], rows_buckets[-1]]
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        for key in keys:
            buf, step_layout = pack(target._warmup_step(key)[0])
            traced = forward_step.trace(
                state,
                caches,
                last,
                abstract(buf),
                layout=step_layout,
                graphdef=runner.graphdef,
                backend=get_backend(backend),
            )
            text = traced.lower(**lower).as_text()
            # the attention kernel (once per scan of like layers), nothing else foreign
            calls = re.findall(r"custom_call @([\w$.]+)", text)
            assert calls and set(calls) == {kernel}, key
            hidden = traced.out_info[0]
        for rows in rows_buckets:
            buf, md_layout = pack(target._warmup_step(keys[0], rows)[1])
            bitmask = jax.ShapeDtypeStruct((rows, runner.bitmask_width), jnp.int32)
            sampler = sample_step.trace(
                state,
                hidden,
                abstract(buf),
                *abstract(runner._sampler_state(None)[:4]),
                bitmask,
                layout=md_layout,
                graphdef=runner.graphdef,
                logits_sharding=runner.logits_sharding.spec,
                num_logprobs=runner.max_logprobs,
                logits_processors=runner.logits_processors,
            )
            assert "custom_call @" not in sampler.lower(**lower).as_text(), rows
    return len(keys) + len(rows_buckets)


def accelerator_layout(layout: BatchLayout, max_model_len: int) -> BatchLayout:
    """The layout an engine of the same limits builds on TPU or GPU: packed rows (the Pallas
    kernels are ragged) and buckets from one row."""
    return BatchLayout.create(
        layout.block_size,
        layout.num_blocks,
        1,
        max_model_len,
        layout.max_rows,
        layout.budget,
        layout.kv_token_bytes,
        num_spec_tokens=layout.num_spec_tokens,
        tiles=False,
    )


@pytest.mark.parametrize(
    "platform,dtype,tp,pp",
    [
        ("tpu", "bfloat16", 1, 1),
        ("cuda", "bfloat16", 1, 1),
        ("cuda", "float32", 1, 1),
        ("tpu", "bfloat16", 4, 1),
        ("cuda", "bfloat16", 4, 1),
        ("tpu", "bfloat16", 2, 2),
        ("cuda", "bfloat16", 2, 2),
    ],
)
def test_every_bucket_lowers_for_the_accelerator(runners, platform, dtype, tp, pp):
    """With pp = 2 the TP=4 engine's arrays are placed on two stages of TP=2 (their layer
    axes name the stage axis): the pipelined step, its permutes and the kernel under both
    shard_maps, lowers for the target."""
    runner = runners[dtype, tp * pp]
    mesh = target_mesh(TARGETS[platform][0], tp, pp)
    layout = accelerator_layout(runner.layout, runner.layout.max_pages * runner.layout.block_size)
    state, caches = on(mesh)(runner.state), on(mesh)(runner.kv_cache)
    n = lower_every_step(runner, layout, state, caches, mesh, platform)
    assert n == len(layout.token_buckets) + len(layout.sample_buckets)


# Config-only folders (benchmarks/gpu/configs): their real shapes, every parameter abstract,
# and the tensor-parallel size each is split over besides 1 (at most its kv heads: the
# engine's repetition of fewer kv heads than devices is the loader's, not here).
CONFIG_ONLY = {
    # 32 heads over 8 kv heads of 128, a 128256-token vocabulary
    "llama-3.1-8b": 4,
    # MLA: 16 heads over a latent of 512 + 64 (the GPU kernel's two loads); 64 experts of
    # 1408 after one dense layer, YaRN, a 102400-token vocabulary
    "deepseek-v2-lite": 4,
    # gated DeltaNet (16 key, 32 value heads of 128: the delta rule's chunk and recurrent
    # kernels) three layers in four, gated attention (2 kv heads of 256), 512 experts
    "qwen3-next-80b-a3b": 2,
    # attention sinks on 64 heads over 8 kv heads of 64, 128-token windows every other layer,
    # 32 biased experts of 2880 with the clamped SwiGLU, YaRN, a 201088-token vocabulary
    "gpt-oss-20b": 4,
    # Llama 4 Scout's text model: chunked local attention (8192-token chunks) with a NoPE
    # layer in four, QK norm, 16 experts of 8192 with a shared expert on every layer, top 1
    "llama-4-scout-17b-16e": 4,
}


@pytest.fixture(scope="module", params=list(CONFIG_ONLY))
def config_only(request):
    """A model's shapes from its config alone: nothing the size of the model is allocated."""
    hf = AutoConfig.from_pretrained(CONFIGS / request.param)
    arch = registry.resolve(hf)
    cfg = arch.config(hf)
    model = abstract_model(arch, cfg, jnp.bfloat16)
    graphdef, state = nnx.split(model)
    return request.param, arch, cfg, graphdef, state


@pytest.mark.parametrize("platform", list(TARGETS))
@pytest.mark.parametrize("split", [False, True], ids=["tp1", "tp"])
def test_config_only_shapes_lower_for_the_accelerator(config_only, platform, split):
    """The real shapes at the engine's default limits (256 sequences, 2048 batched tokens),
    on TP=1 and the config's split, with the kernel `auto` picks there for the model's
    attention (the latent one for DeepSeek): the forward of 1, 64 and 2048 tokens and the
    sampler of 1 and 256 rows. Every bucket between lowers in the tiny model's test above
    (all 21 here took 20-45 s a case in the suite on a 2-core Zen 3; these five 4-9 s
    alone)."""
    name, arch, cfg, graphdef, state = config_only
    tp = CONFIG_ONLY[name] if split else 1
    device, backend, kernel = TARGETS[platform]
    mesh = target_mesh(device, tp)
    flat = dict(nnx.to_flat_state(state))
    params = nnx.from_flat_state(
        {
            path: jax.ShapeDtypeStruct(
                var.shape, var.dtype, sharding=named_sharding(mesh, param_axes(var), var.shape)
            )
            for path, var in flat.items()
        }
    )
    specs = arch.module.kv_cache_specs(cfg)
    fields = tuple(spec.step_fields(jnp.bfloat16) for spec in specs)
    kv_bytes = max(f.get("kv_token_bytes", 0) for f in fields)
    layout = BatchLayout.create(
        16, 4096, 1, 8192, 256, 2048, kv_bytes, tiles=False, group_fields=fields
    )
    runner = ModelRunner(
        graphdef, params, layout, cfg.vocab_size, 256, 20, "cpu_kernel", True, make_mesh(), specs
    )
    caches = []
    for spec in specs:  # one pool per group here
        if isinstance(spec, MambaSpec):  # per-request state, split by its heads
            caches.append(abstract_kv_cache(spec, 257, 16, jnp.bfloat16, mesh))
            continue
        for shape, dtype in spec.cache_arrays(4096, 16, jnp.bfloat16):
            axes = CACHE_AXES if len(shape) == 5 else (None,) * len(shape)  # a latent: whole
            sharding = named_sharding(mesh, axes, shape)
            caches.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    n = lower_every_step(runner, layout, params, tuple(caches), mesh, platform, ends_only=True)
    assert n == 3 + 2
    # the token axis 1 .. 2048 (its middle 64) and the sample rows 1 .. 256
    assert len(layout.shapes()) == 12 and len(layout.sample_buckets) == 9
    assert layout.shapes()[len(layout.shapes()) // 2] == (64,)

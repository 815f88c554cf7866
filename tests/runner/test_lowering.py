"""Every step executable lowers for TPU and for CUDA from this CPU host (no accelerator
needed): the forward of every bucket with the attention kernel `auto` picks there (the
Pallas TPU kernel through Mosaic, the Pallas GPU kernel through Triton), and the sampler of
every row bucket, on an abstract mesh naming the target device, at TP=1 and TP=4. A lowering error on any
bucket fails here instead of on a user's TPU or GPU, and no CPU kernel leaks into a step
traced for another platform."""

from __future__ import annotations

import re
import warnings

import jax
import pytest
from oracle import SMALL

from jllm import LLM
from jllm.attention import get_backend
from jllm.runner.model_runner import forward_step
from jllm.runner.sampler import sample

TARGETS = {
    "tpu": (("TPU v5 lite", 1, "tpu"), "pallas", "tpu_custom_call"),
    "cuda": (("NVIDIA H100 80GB HBM3", 132, "gpu"), "pallas_gpu", "__gpu$xla.gpu.triton"),
}


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


@pytest.mark.parametrize(
    "platform,dtype,tp",
    [
        ("tpu", "bfloat16", 1),
        ("cuda", "bfloat16", 1),
        ("cuda", "float32", 1),
        ("tpu", "bfloat16", 4),
        ("cuda", "bfloat16", 4),
    ],
)
def test_every_bucket_lowers_for_the_accelerator(runners, platform, dtype, tp):
    runner = runners[dtype, tp]
    device, backend, kernel = TARGETS[platform]
    auto = jax.sharding.AxisType.Auto
    mesh = jax.sharding.AbstractMesh(
        (1, tp),
        ("data", "model"),
        axis_types=(auto, auto),
        abstract_device=jax.sharding.AbstractDevice(*device),
    )
    abstract = on(mesh)
    lower = {"lowering_platforms": (platform,)}
    sampled = set()
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        for key in runner.layout.shapes():
            buf, layout, rows = runner._packed_inputs(*key)
            traced = forward_step.trace(
                abstract(runner.state),
                abstract(runner.kv_cache),
                abstract(runner.last_tokens),
                abstract(buf),
                layout=layout,
                graphdef=runner.graphdef,
                backend=get_backend(backend),
                logits_sharding=runner.logits_sharding.spec,
            )
            text = traced.lower(**lower).as_text()
            # one attention kernel (the scan's body), nothing else foreign
            assert re.findall(r"custom_call @([\w$.]+)", text) == [kernel], key
            if rows in sampled:
                continue
            sampled.add(rows)
            logits, _, md, _ = traced.out_info
            state = runner._sampler_state(abstract(runner._bitmask(rows, None)))
            sampler = sample.trace(
                logits,
                md,
                *abstract(state),
                num_logprobs=runner.max_logprobs,
                logits_processors=runner.logits_processors,
            )
            assert "custom_call @" not in sampler.lower(**lower).as_text()
    assert sampled == {runner.layout.sample_rows(*key) for key in runner.layout.shapes()}

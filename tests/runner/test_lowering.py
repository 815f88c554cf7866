"""Every step executable lowers for TPU and for CUDA from this CPU host (no accelerator
needed): the forward of every bucket with the attention kernel `auto` picks there (the
Pallas TPU kernel through Mosaic, the Pallas GPU kernel through Triton), and the sampler of
every row bucket, on an abstract mesh naming the target device. A lowering error on any
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


def abstract(tree):
    """Shapes and dtypes only: the CPU arrays' shardings name the CPU mesh."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@pytest.fixture(scope="module")
def runners(llama_dir):
    """An engine per dtype: on this CPU a float32 model's products run in a C++ kernel, which
    a step traced for TPU or CUDA must not call."""
    return {dtype: LLM(llama_dir, dtype=dtype, **SMALL).llm_engine.runner for dtype in DTYPES}


DTYPES = ("bfloat16", "float32")


@pytest.mark.parametrize(
    "platform,dtype", [("tpu", "bfloat16"), ("cuda", "bfloat16"), ("cuda", "float32")]
)
def test_every_bucket_lowers_for_the_accelerator(runners, platform, dtype):
    runner = runners[dtype]
    device, backend, kernel = TARGETS[platform]
    auto = jax.sharding.AxisType.Auto
    mesh = jax.sharding.AbstractMesh(
        (1, 1),
        ("data", "model"),
        axis_types=(auto, auto),
        abstract_device=jax.sharding.AbstractDevice(*device),
    )
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

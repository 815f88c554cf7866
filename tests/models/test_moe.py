"""Mixtures of experts: the grouped product against the dense every-expert reference, and
tiny random Mixtral, Qwen3-MoE and Qwen2-MoE models (8 experts, top-2, both routings, a dense
layer among the sparse ones, a shared expert) against transformers in float32: greedy tokens
equal and logprobs within 1e-4, chunked and from the prefix cache; TP = 2 and expert
parallelism equal to TP = 1; no compile after start-up; bad configs and checkpoints refused
before serving."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import SMALL, assert_matches, eager, generate, prompt_ids
from safetensors.numpy import load_file, save_file

from jllm import LLM, SamplingParams
from jllm.models.moe import SwigluOai, dense_ffn_reference, grouped_ffn, route, sort_by_expert
from jllm.quantization.formats import quantize_online, stack_layers
from jllm.quantization.weights import dequantize
from jllm.runner.compile_guard import count_compiles

MOE = ["mixtral", "qwen3-moe", "qwen3-moe-unnormed", "qwen2-moe"]


@pytest.mark.parametrize("method", ["tiles", "ragged"])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 8, 2), (64, 16, 4), (2048, 8, 2)])
def test_grouped_product_matches_the_dense_reference(method, T, E, k):
    """Including experts no token chose (half of them are pushed out of every top-k)."""
    rng = np.random.default_rng(T)
    D, F = 32, 48
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(E, D, F)) * 0.2, jnp.float32) for _ in "gu")
    w_down = jnp.asarray(rng.normal(size=(E, F, D)) * 0.2, jnp.float32)
    logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32).at[:, : E // 2].add(-50.0)
    weights, ids = route(logits, k, normalize=True)
    order, sizes = sort_by_expert(ids, E)
    assert int(sizes[: E // 2].sum()) == 0 and int(sizes.sum()) == T * k
    token = order // k
    y = grouped_ffn(x[token], w_gate, w_up, w_down, sizes, "silu", method)
    out = jnp.zeros((T, D)).at[token].add(y * weights.reshape(-1)[order][:, None])
    ref = dense_ffn_reference(x, weights, ids, w_gate, w_up, w_down, "silu")
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


def test_routing_normalises_as_configured():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    w, ids = route(logits, 2, normalize=False)
    np.testing.assert_allclose(w, [[0.5, 0.3]], rtol=1e-6)
    assert ids.tolist() == [[0, 1]]
    w, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(w, [[0.625, 0.375]], rtol=1e-6)


@pytest.mark.parametrize("arch", MOE)
def test_moe_families_match_transformers(tiny_models, arch):
    """Alone with chunked prefill (16-token steps), then again from the prefix cache."""
    llm = LLM(tiny_models[arch], **{**SMALL, "max_num_batched_tokens": 16})
    model = eager(tiny_models[arch])
    prompts = prompt_ids(3, 20) + prompt_ids(1, 45, seed=1)
    assert_matches(model, prompts, generate(llm, prompts))
    outs = generate(llm, prompts)
    assert all(o.num_cached_tokens >= 16 for o in outs)
    assert_matches(model, prompts, outs)


def test_moe_tensor_parallel_equals_one_device(tiny_models):
    """Each expert's intermediate axis split over 2 devices: the same tokens and logprobs."""
    prompts = prompt_ids(4, 18, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    one = generate(LLM(tiny_models["qwen3-moe"], **SMALL), prompts, params)
    two = generate(LLM(tiny_models["qwen3-moe"], **SMALL, tensor_parallel_size=2), prompts, params)
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


@pytest.mark.slow
def test_moe_compiles_nothing_after_start(tiny_models):
    llm = LLM(
        tiny_models["mixtral"],
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        disable_log_stats=True,
    )
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(5, 3, seed=1)]
    prompts.append({"prompt_token_ids": prompt_ids(1, 150, seed=2)[0]})  # chunked
    params = SamplingParams(temperature=0.8, max_tokens=9, seed=1)
    with count_compiles() as events:
        llm.generate(prompts, params, use_tqdm=False)
    assert events == []


def _edited(src: str, dst, config_changes=None, drop=None) -> str:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    if drop:
        path = dst / "model.safetensors"
        tensors = {k: v for k, v in load_file(path).items() if k != drop}
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def test_bad_moe_checkpoints_are_refused(tiny_models, tmp_path):
    missing = _edited(
        tiny_models["mixtral"],
        tmp_path / "missing",
        drop="model.layers.1.block_sparse_moe.experts.5.w3.weight",
    )
    with pytest.raises(ValueError, match=r"lacks experts \[5\] of blocks|lacks experts \[5\]"):
        LLM(missing, **SMALL)
    router = _edited(tiny_models["mixtral"], tmp_path / "router", {"scoring_func": "sigmoid"})
    with pytest.raises(ValueError, match="MoE router 'sigmoid'"):
        LLM(router, **SMALL)
    assert jax.devices()  # the failed loads left the process usable


@pytest.mark.parametrize("arch,devices", [("mixtral", 2), ("mixtral", 4), ("qwen2-moe", 2)])
def test_expert_parallel_equals_one_device(tiny_models, arch, devices):
    """Whole experts per device (4 or 2 of the 8 each), tokens replicated, partial outputs
    summed (Qwen2-MoE's shared expert split as a dense MLP beside them): the same tokens
    and logprobs as one device."""
    prompts = prompt_ids(4, 18, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    one = generate(LLM(tiny_models[arch], **SMALL), prompts, params)
    llm = LLM(tiny_models[arch], **SMALL, tensor_parallel_size=devices, enable_expert_parallel=True)
    experts = llm.llm_engine.runner.state["layers"]["mlp"]["experts"]["gate_proj"].get_value()
    assert experts.sharding.shard_shape(experts.shape)[1] == 8 // devices
    for a, b in zip(one, generate(llm, prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


def test_expert_parallel_needs_divisible_experts(tiny_models):
    with pytest.raises(ValueError, match="8 experts on 3 devices"):
        LLM(tiny_models["mixtral"], **SMALL, tensor_parallel_size=3, enable_expert_parallel=True)


@pytest.mark.parametrize("method", ["tiles", "ragged"])
@pytest.mark.parametrize("quantization", ["fp8", "tpu_int8"])
def test_grouped_product_of_quantized_experts(method, quantization):
    """Experts quantized per output channel ([E, Out, In] codes): the grouped product
    equals the dense reference on their dequantized values."""
    rng = np.random.default_rng(5)
    T, E, k, D, F = 9, 8, 2, 32, 48
    floats = [rng.normal(size=s).astype(np.float32) * 0.2 for s in ((E, D, F),) * 2]
    floats.append(rng.normal(size=(E, F, D)).astype(np.float32) * 0.2)
    quantized = [  # each expert's [Out, In] = our [In, Out] transposed
        stack_layers(
            [quantize_online(np.ascontiguousarray(w[e].T), quantization) for e in range(E)]
        )
        for w in floats
    ]
    quantized = [jax.tree.map(jnp.asarray, q) for q in quantized]
    values = [jnp.swapaxes(dequantize(q, jnp.float32), -1, -2) for q in quantized]
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(T, E)), jnp.float32), k, True)
    order, sizes = sort_by_expert(ids, E)
    token = order // k
    y = grouped_ffn(x[token], *quantized, sizes, "silu", method)
    out = jnp.zeros((T, D)).at[token].add(y * weights.reshape(-1)[order][:, None])
    ref = dense_ffn_reference(x, weights, ids, *values, "silu")
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["tiles", "ragged"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "fp8"])
def test_grouped_product_with_biases_and_the_clamped_swiglu(method, quantized):
    """gpt-oss's experts: a bias after each product, and SwigluOai (a limit the gates and
    ups reach) for act(gate) * up; float and fp8 experts, against the dense reference."""
    rng = np.random.default_rng(7)
    T, E, k, D, F = 11, 8, 4, 32, 48
    floats = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((E, D, F), (E, D, F))]
    floats.append(rng.normal(size=(E, F, D)).astype(np.float32) * 0.3)
    shapes = ((E, F), (E, F), (E, D))
    bias = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.5) for s in shapes)
    weights = [jnp.asarray(w) for w in floats]
    if quantized:  # each expert's [Out, In] = our [In, Out] transposed
        weights = [
            jax.tree.map(
                jnp.asarray,
                stack_layers(
                    [quantize_online(np.ascontiguousarray(w[e].T), "fp8") for e in range(E)]
                ),
            )
            for w in floats
        ]
    values = [jnp.swapaxes(dequantize(w, jnp.float32), -1, -2) if quantized else w for w in weights]
    act = SwigluOai(limit=0.5)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    routing, ids = route(jnp.asarray(rng.normal(size=(T, E)), jnp.float32), k, True)
    order, sizes = sort_by_expert(ids, E)
    token = order // k
    y = grouped_ffn(x[token], *weights, sizes, act, method, bias)
    out = jnp.zeros((T, D)).at[token].add(y * routing.reshape(-1)[order][:, None])
    ref = dense_ffn_reference(x, routing, ids, *values, act, bias)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    gate = jnp.einsum("TD,EDF->ETF", x, values[0]) + bias[0][:, None]
    assert float(gate.max()) > act.limit  # the clamp binds


def test_biased_experts_on_the_bf16_kernels():
    """gpt-oss's experts in bf16 on the CPU: each tile's products on the C++ kernel, reading
    the expert in place (the biases and the clamped SwiGLU between them), against the dense
    reference on the same bf16 values."""
    rng = np.random.default_rng(8)
    T, E, k, D, F = 11, 8, 4, 32, 48
    shapes = ((E, D, F), (E, D, F), (E, F, D))
    weights = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.bfloat16) for s in shapes]
    bias = tuple(
        jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32) for s in ((E, F), (E, F), (E, D))
    )
    act = SwigluOai(limit=0.5)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    routing, ids = route(jnp.asarray(rng.normal(size=(T, E)), jnp.float32), k, True)
    order, sizes = sort_by_expert(ids, E)
    token = order // k
    y = jax.jit(grouped_ffn, static_argnums=(5, 6))(x[token], *weights, sizes, act, "tiles", bias)
    assert y.dtype == jnp.bfloat16
    out = (
        jnp.zeros((T, D)).at[token].add(y.astype(jnp.float32) * routing.reshape(-1)[order][:, None])
    )
    values = [w.astype(jnp.float32) for w in weights]
    ref = dense_ffn_reference(x.astype(jnp.float32), routing, ids, *values, act, bias)
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)

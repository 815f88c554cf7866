"""Per-layer KV-cache scales for the float8 cache (model_loader/kv_scales.py, applied in
models/context.py): the cache stores k / k_scale and v / v_scale, attention reads them back
times the scale. Checked against a jnp reference per backend, end to end on a tiny Llama
whose keys and values saturate float8_e4m3fn (448) without scales, for vLLM's
quantization_param_path JSON and its checks, and for scale tensors in a checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from oracle import SMALL, mixed_step, prompt_ids, save_edited
from safetensors.torch import load_file, save_file

from jllm import LLM, SamplingParams
from jllm.attention import get_backend
from jllm.model_loader.kv_scales import (
    checkpoint_scale,
    read_kv_cache_scales,
    resolve_kv_scales,
    scale_tensor,
)
from jllm.models.context import StepContext
from pallas_kernels.ragged_paged_attention import cpu as cpu_kernel
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

E4M3 = ml_dtypes.float8_e4m3fn
# The loud model's k_proj and v_proj are the tiny Llama's times these (per layer), its q_proj
# and o_proj divided by them: the same function, with keys and values of magnitude 500-2000.
LOUD = {0: 1024.0, 1: 256.0}
PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(3, 24, seed=5)]


def fp8_round(x):
    """x as float8_e4m3fn stores it (saturating at 448, as the cache writes), in float32."""
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(E4M3).astype(np.float32)


@pytest.mark.parametrize("name", ["xla", "cpu_kernel"])
def test_scaled_attention_matches_the_dequantized_reference(name):
    """One step (decodes, a chunk after cached tokens, a fresh prefill) over a float8 cache
    with per-layer scales: the bytes written are fp8(k / k_scale), fp8(v / v_scale), and the
    output is float32 attention over the dequantized cache, fp8(x / scale) * scale."""
    from jllm.runner.buckets import BatchLayout
    from jllm.runner.inputs import build_step

    backend = get_backend(name)
    try:
        backend.prepare()
    except cpu_kernel.CpuKernelUnavailable as e:
        pytest.skip(str(e))
    S, K, G, H, B = 4, 2, 3, 16, 64
    k_scale, v_scale = 300.0, 40.0  # k ~ 900, v ~ 120: k saturates without its scale
    layout = BatchLayout.create(S, B, 4, 64, 8, 64, 2 * K * H, kv_fp8="float8_e4m3fn")
    batch, out = mixed_step(layout.max_pages, S)
    md = build_step(batch, out, layout, backend)[0].attn[0]
    ragged = build_step(batch, out, layout, get_backend("cpu_kernel"))[0].attn[0]
    slots = np.asarray(md.slot_mapping)
    T = len(slots)
    rng = np.random.default_rng(1)
    # Cached K/V as stored (already divided by the scales), K and V interleaved on heads.
    stored = fp8_round(rng.normal(size=(2, B, S, 2 * K, H)))
    cache = jnp.asarray(stored.astype(E4M3).view(np.uint8))
    q = jnp.asarray(rng.normal(size=(T, K * G, H)) / k_scale, jnp.float32)  # scores ~ 1-10
    k = jnp.asarray(3 * k_scale * rng.normal(size=(T, K, H)), jnp.float32)
    v = jnp.asarray(3 * v_scale * rng.normal(size=(T, K, H)), jnp.float32)
    ctx = StepContext(positions=jnp.zeros(T, jnp.int32), attn=(md,), backend=backend)
    ctx = ctx.at_layer(0, jnp.int32(1))
    scales = (jnp.float32(k_scale), jnp.float32(v_scale))

    @jax.jit
    def attend(q, k, v, cache, ctx):
        return ctx.attend(q, k, v, (cache,), scale=H**-0.5, kv_scales=scales)

    got, (written,) = attend(q, k, v, cache, ctx)

    real = slots < B * S  # the step's tokens, not padding
    new = np.stack([np.asarray(k) / k_scale, np.asarray(v) / v_scale], 2).reshape(T, 2 * K, H)
    expect = stored[1].reshape(B * S, 2 * K, H).copy()
    expect[slots[real]] = fp8_round(new[real])
    assert np.abs(np.asarray(k)).max() > 448 > np.abs(new).max()  # in range once scaled
    got_bytes = np.asarray(written)[1].reshape(B * S, 2 * K, H)
    np.testing.assert_array_equal(got_bytes, expect.astype(E4M3).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(written)[0], np.asarray(cache)[0])

    per_head = np.tile(np.array([k_scale, v_scale], np.float32), K)[:, None]  # [2K, 1]
    dequantized = jnp.asarray(expect.reshape(B, S, 2 * K, H) * per_head)
    ref = ragged_paged_attention_reference(
        q,
        dequantized,
        *(getattr(ragged, f) for f in ("kv_lens", "block_tables", "query_start", "query_lens")),
        ragged.num_seqs,
        sm_scale=H**-0.5,
    )
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], rtol=1e-4, atol=1e-3)


# --- end to end: a tiny Llama whose K/V overflow float8 without scales ----------------------


@pytest.fixture(scope="module")
def loud_dir(llama_dir, tmp_path_factory):
    def edit(model):
        for i, layer in enumerate(model.model.layers):
            attn, f = layer.self_attn, LOUD[i]
            attn.k_proj.weight.mul_(f)
            attn.q_proj.weight.div_(f)
            attn.v_proj.weight.mul_(f)
            attn.o_proj.weight.div_(f)

    return save_edited(llama_dir, tmp_path_factory.mktemp("loud"), edit)


def doc(scales=None, tp=1, **fields) -> dict:
    """vLLM's quantization parameter JSON: the same {layer: factor} for every rank."""
    layers = {str(i): f for i, f in (scales or {0: 0.5, 1: 0.25}).items()}
    ranks = {str(r): layers for r in range(tp)}
    out = {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": ranks}}
    return out | fields


def write_scales(path, scales: dict) -> str:
    path.write_text(json.dumps(doc(scales)))
    return str(path)


def prompt_logprobs(llm) -> np.ndarray:
    """Each prompt token's logprob given those before it, read back from the cache the
    prefill has just written; all prompts concatenated."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    values = []
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
        for token, lp in zip(prompt["prompt_token_ids"][1:], out.prompt_logprobs[1:], strict=True):
            values.append(lp[token].logprob)
    return np.asarray(values)


def scale_state(llm) -> dict[str, np.ndarray]:
    from flax import nnx

    state = nnx.to_flat_state(llm.llm_engine.runner.state)
    return {p[-1]: np.asarray(v.get_value()) for p, v in state if p[-1] in ("k_scale", "v_scale")}


@pytest.fixture(scope="module")
def runs(llama_dir, loud_dir, tmp_path_factory):
    """Prompt logprobs and the engines' float8 caches after them."""
    settings = dict(dtype="float32", **SMALL)
    out = {}

    def run(key, model, **kw):
        llm = LLM(model, **settings, **kw)
        out[key] = (prompt_logprobs(llm), llm)

    json_path = write_scales(tmp_path_factory.mktemp("scales") / "kv.json", LOUD)
    run("float", loud_dir)
    run("tiny fp8", llama_dir, kv_cache_dtype="fp8")
    run("loud fp8", loud_dir, kv_cache_dtype="fp8")
    run("loud fp8 + json", loud_dir, kv_cache_dtype="fp8", quantization_param_path=json_path)
    return out


def test_scales_keep_a_loud_model_within_float8_range(runs):
    """Unscaled, the loud model's K/V saturate at 448; with its scales the cache holds the
    tiny model's K/V exactly (the factors are powers of two), so both give the same logprobs
    and the same cache bytes, within float8's error of the float cache (3%, as
    test_fp8_kv_cache.py bounds it)."""
    float_lps = runs["float"][0]

    def error(key):
        return np.abs(runs[key][0] - float_lps).mean() / np.abs(float_lps).mean()

    scaled, tiny = runs["loud fp8 + json"], runs["tiny fp8"]
    np.testing.assert_allclose(scaled[0], tiny[0], atol=1e-4)
    caches = (scaled[1].llm_engine.runner.kv_cache, tiny[1].llm_engine.runner.kv_cache)
    for got, want in zip(*caches, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Measured: 1.2% with the scales (the tiny model's float8 error), 13% without.
    assert 0 < error("loud fp8 + json") < 0.03
    assert error("loud fp8") > 5 * error("loud fp8 + json")
    # The file's factor reached each layer's k and v scale; without scales none exist.
    np.testing.assert_array_equal(scale_state(scaled[1])["k_scale"], [1024.0, 256.0])
    np.testing.assert_array_equal(scale_state(scaled[1])["v_scale"], [1024.0, 256.0])
    assert scale_state(runs["loud fp8"][1]) == {}
    assert not runs["loud fp8"][1].llm_engine.model_config.kv_scales


def test_checkpoint_scale_tensors_load(loud_dir, runs, tmp_path):
    """k_scale / v_scale tensors in the checkpoint (layer 0 under llm-compressor's names,
    layer 1 under ModelOpt's) load as the JSON's do; with kv_cache_dtype "auto" they are
    ignored and the model has no scales."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{loud_dir}/{name}", tmp_path)
    tensors = load_file(f"{loud_dir}/model.safetensors")
    names = {
        0: ("self_attn.k_scale", "self_attn.v_scale"),
        1: ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    }
    for i, (k_name, v_name) in names.items():
        tensors[f"model.layers.{i}.{k_name}"] = torch.tensor(LOUD[i])
        tensors[f"model.layers.{i}.{v_name}"] = torch.tensor([LOUD[i]])
    save_file(tensors, f"{tmp_path}/model.safetensors")

    llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="fp8", **SMALL)
    for scales in scale_state(llm).values():
        np.testing.assert_array_equal(scales, [1024.0, 256.0])
    np.testing.assert_allclose(prompt_logprobs(llm), runs["tiny fp8"][0], atol=1e-4)

    plain = LLM(str(tmp_path), dtype="float32", **SMALL)
    assert scale_state(plain) == {}
    np.testing.assert_allclose(prompt_logprobs(plain), runs["float"][0], atol=1e-5)


def test_scale_tensor_names():
    """vLLM's names for a layer's scales; the deprecated kv_scale sets both; one number each."""
    assert scale_tensor("model.layers.3.self_attn.k_scale") == (3, ("k",))
    assert scale_tensor("model.layers.0.self_attn.v_proj.v_scale") == (0, ("v",))
    assert scale_tensor("model.layers.1.self_attn.kv_scale") == (1, ("k", "v"))
    assert scale_tensor("model.layers.1.self_attn.k_proj.weight") is None
    assert scale_tensor("model.layers.1.self_attn.k_proj.weight_scale") is None
    assert checkpoint_scale("x", np.array([0.5], np.float32)) == 0.5
    with pytest.raises(ValueError, match="holds 2 KV-cache scales.*per-head"):
        checkpoint_scale("x", np.ones(2, np.float32))
    with pytest.raises(ValueError, match="must be a positive number"):
        checkpoint_scale("x", np.float32(-1.0))


# --- vLLM's quantization parameter JSON: what is refused, and when it is ignored -----------


BAD = [
    (doc(kv_cache={"dtype": "float8_e5m2", "scaling_factor": {}}), "rather than float8_e4m3fn"),
    (doc(model_type="mistral"), "model type 'mistral', but the model is of type 'llama'"),
    (doc(model_type=None), "model type None"),
    (doc(tp=2), r"ranks \[0, 1\] \(TP size 2\).*tensor_parallel_size=1"),
    (doc({0: 0.5}), r"lacks KV cache scaling factors for layers \[1\] in TP rank 0"),
    (doc({0: 0.5, 1: 0.5, 2: 0.5}), r"layers \[2\] in TP rank 0, but the model has 2 layers"),
    (doc({0: 0.5, 1: 0.0}), "layer 1 of TP rank 0 is 0.0; a KV-cache scale must be a positive"),
    (doc({0: 0.5, 1: "big"}), "'big', not a number"),
    ({"model_type": "llama"}, "not vLLM's quantization parameter file"),
    ([1, 2], "not vLLM's quantization parameter file"),
]


@pytest.mark.parametrize("content, message", BAD, ids=[m[:24] for _, m in BAD])
def test_quantization_param_file_is_checked(tmp_path, content, message):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        read_kv_cache_scales(str(path), model_types=("llama",), num_layers=2, tp_size=1)


def test_quantization_param_file_ranks(tmp_path):
    """Under tensor parallelism every rank is needed and must agree (one scale per layer)."""
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(doc(tp=2)))
    got = read_kv_cache_scales(str(path), model_types=("llama",), num_layers=2, tp_size=2)
    assert got == {0: 0.5, 1: 0.25}
    differ = doc(tp=2)
    differ["kv_cache"]["scaling_factor"]["1"] = {"0": 0.5, "1": 0.3}
    path.write_text(json.dumps(differ))
    with pytest.raises(ValueError, match=r"rank 1's scaling factors differ .* layers \[1\]"):
        read_kv_cache_scales(str(path), model_types=("llama",), num_layers=2, tp_size=2)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        read_kv_cache_scales(str(path), model_types=("llama",), num_layers=2, tp_size=2)
    with pytest.raises(ValueError, match="cannot be read"):
        read_kv_cache_scales(
            str(tmp_path / "absent.json"), model_types=("llama",), num_layers=2, tp_size=1
        )


@pytest.mark.parametrize("cache", ["auto", "fp8_e5m2", "fp8", "fp8_e4m3"])
def test_the_file_applies_to_an_e4m3_cache_only(tmp_path, caplog, cache):
    """vLLM warned and ignored the file for a cache that is not fp8 (e4m3); so does jllm."""
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(doc()))
    args = types.SimpleNamespace(
        quantization_param_path=str(path), kv_cache_dtype=cache, tensor_parallel_size=1
    )
    source = types.SimpleNamespace(kind="gguf", hf_config=types.SimpleNamespace(model_type="llama"))
    with caplog.at_level(logging.WARNING, logger="jllm"):
        scaled, scales = resolve_kv_scales(args, source, 2)
    if cache in ("auto", "fp8_e5m2"):
        assert (scaled, scales) == (False, None)
        assert "will not be used" in caplog.text
    else:
        assert (scaled, scales) == (True, {0: 0.5, 1: 0.25})
        assert "deprecated" in caplog.text


def test_dummy_weights_take_the_file_scales(loud_dir, tmp_path):
    path = write_scales(tmp_path / "kv.json", LOUD)
    llm = LLM(
        loud_dir, load_format="dummy", kv_cache_dtype="fp8", quantization_param_path=path, **SMALL
    )
    for scales in scale_state(llm).values():
        np.testing.assert_array_equal(scales, [1024.0, 256.0])


def test_engine_refuses_a_file_for_another_model(loud_dir, tmp_path):
    path = write_scales(tmp_path / "kv.json", {0: 1.0, 1: 1.0, 2: 1.0})
    with pytest.raises(ValueError, match=r"layers \[2\] in TP rank 0"):
        LLM(loud_dir, kv_cache_dtype="fp8", quantization_param_path=path, **SMALL)

"""quantization= ("fp8", "tpu_int8", "gguf"): each format against a float reference computed
from the same quantized values by the test's own code (numpy, ml_dtypes) or gguf-py's
dequantizers, then the engine end to end against transformers or the dequantized engine."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize as gguf_dequantize
from oracle import SMALL, worst_teacher_forced_gaps
from oracle import prompt_ids as oracle_prompts
from quantized_checkpoints import online_values, reference_codes

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model
from jllm.quantization import cpu_kernel, resolve_quantization
from jllm.quantization.formats import gguf_weight, quantize_online
from jllm.quantization.weights import QuantizedWeight, dequantize, fp8_values, matmul
from jllm.runner.compile_guard import count_compiles

Q = gguf.GGMLQuantizationType
# The tiny GGUF files carry no tokenizer: token ids in, token ids out.
GGUF_ARGS = {**SMALL, "skip_tokenizer_init": True}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_gguf_blocks_kept_quantized_match_gguf_py(qtype, gguf_blocks):
    data = gguf_blocks(qtype, rows=8, blocks=2)
    w = gguf_weight(data, qtype.name)
    ref = gguf_dequantize(data, qtype).reshape(8, -1)
    assert w.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(dequantize(w, jnp.float32)), ref)
    assert w.nbytes < ref.size * 2  # below bf16: the codes stay packed
    # 0 and 3 rows take the CPU kernel (quantized_matmul.cc), 20 rows XLA's product
    for rows, kernel in ((0, True), (3, True), (20, False)):
        x = np.random.default_rng(rows).normal(size=(rows, ref.shape[1])).astype(np.float32)
        args = (jnp.asarray(x), jax.tree.map(jnp.asarray, w))
        assert (cpu_kernel.TARGET in jax.jit(matmul).lower(*args).as_text()) == kernel
        got = np.asarray(jax.jit(matmul)(*args))
        np.testing.assert_allclose(got, x @ ref.T, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_fp8_values_are_exact_for_every_code():
    codes = np.arange(256, dtype=np.uint8)  # float8_e4m3fn bit patterns, as held
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(jax.jit(fp8_values, static_argnums=1)(codes, dtype), np.float32)
        finite = ~np.isnan(want)  # 0x7F/0xFF: NaN, never produced by quantization
        np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.parametrize("method", ["tpu_int8", "fp8"])
def test_online_quantization_is_per_channel_absmax(method):
    w = np.random.default_rng(0).normal(0, 0.05, (48, 80)).astype(np.float32)
    w[3] = 0.0  # an all-zero channel keeps a usable scale
    q = quantize_online(w, method)
    absmax = np.abs(w).max(axis=1, keepdims=True)
    if method == "tpu_int8":
        scale = (np.maximum(absmax, 1e-5) / 127).astype(np.float32)
    else:
        scale = np.where(absmax > 0, absmax / 448, 1.0).astype(np.float32)
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    codes = reference_codes(w, scale, method)
    held = q.codes.view(ml_dtypes.float8_e4m3fn) if method == "fp8" else q.codes
    np.testing.assert_array_equal(held.astype(np.float32), codes)
    values = held.astype(np.float32) * q.scale
    for rows in (5, 40):  # the CPU kernel, XLA's product
        x = np.random.default_rng(rows).normal(size=(rows, 80)).astype(np.float32)
        got = np.asarray(matmul(jnp.asarray(x), jax.tree.map(jnp.asarray, q)))
        np.testing.assert_allclose(got, x @ values.T, rtol=1e-5, atol=1e-6)


def prompt_ids(n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts for the 256-token tiny models."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, length + 3 * i).tolist() for i in range(n)]


def dequantized_copy(model_dir: str, method: str, dest) -> str:
    """The checkpoint with every projection replaced by its per-channel quantized values,
    computed here with numpy and ml_dtypes: the float reference for quantization=method."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim not in (2, 3) or "embed_tokens" in name:
                continue  # 3: stacked experts [E, Out, In], per output channel too
            param.copy_(torch.from_numpy(online_values(param.numpy(), method)))
    model.save_pretrained(dest)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(dest)
    return str(dest)


def generate_like_reference(llm, reference: str, prompts, params):
    """`llm`'s outputs for `prompts`, checked against transformers on the `reference`
    checkpoint (the quantized values in float32, `dequantized_copy`): greedy is its argmax,
    and the reported logprobs are within 1e-4 of its own."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference).eval()
    runs = [(p, o.outputs[0]) for p, o in zip(prompts, outs, strict=True)]
    gap, error = worst_teacher_forced_gaps(model, runs)
    assert gap == 0.0 and error < 1e-4, (gap, error)  # greedy = transformers' argmax
    return outs


@pytest.mark.parametrize("method", ["tpu_int8", "fp8"])
def test_online_methods_match_transformers_on_the_quantized_values(method, save_tiny, tmp_path):
    path, _ = save_tiny("llama", tie=False)  # an untied lm_head is quantized too
    reference = dequantized_copy(path, method, tmp_path / "reference")
    llm = LLM(path, quantization=method, dtype="float32", **SMALL)
    prompts = prompt_ids(4, 5, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = generate_like_reference(llm, reference, prompts, params)
    # float16 activations: the codes' values (fp8's reach 448) and the unscaled products
    # stay in range (float32 accumulation), so the tokens are the same
    half = LLM(path, quantization=method, dtype="float16", **SMALL)
    again = half.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs, again, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert all(np.isfinite(next(iter(lp.values())).logprob) for lp in b.outputs[0].logprobs)
    state = llm.llm_engine.runner.state
    assert isinstance(state["layers"]["mlp"]["up_proj"]["weight"].get_value(), QuantizedWeight)
    assert not isinstance(state["embed_tokens"].get_value(), QuantizedWeight)


@pytest.mark.parametrize("method", ["tpu_int8", "fp8"])
def test_quantized_experts_match_transformers_on_the_quantized_values(
    method, tiny_models, tmp_path
):
    """A mixture of experts quantized on load, experts included (each expert's output
    channels scaled alone): transformers on the same quantized values chooses the same
    tokens and gives the same logprobs."""
    path = tiny_models["mixtral"]
    reference = dequantized_copy(path, method, tmp_path / "reference")
    llm = LLM(path, quantization=method, dtype="float32", **SMALL)
    prompts = oracle_prompts(3, 12, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    generate_like_reference(llm, reference, prompts, params)
    experts = llm.llm_engine.runner.state["layers"]["mlp"]["experts"]
    assert isinstance(experts["down_proj"].get_value(), QuantizedWeight)


@pytest.mark.parametrize(
    "arch,tie,matrix,embedding",
    [("llama", True, "Q4_1", "Q8_0"), ("qwen2", False, "Q4_0", "F16")],
)
def test_gguf_kept_quantized_matches_dequantized_on_load(
    arch, tie, matrix, embedding, tmp_path, make_tiny, gguf_writer
):
    """The same file twice: kept quantized (Q4 codes, a Q8_0 embedding read by the tied
    lm_head) and dequantized on load by gguf-py (checked against transformers elsewhere)."""
    path = str(tmp_path / f"{arch}.gguf")
    gguf_writer(path, make_tiny(arch, tie=tie), arch, matrix_type=matrix, embedding_type=embedding)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(4, 6, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    float_run = LLM(path, dtype="float32", **GGUF_ARGS).generate(prompts, params, use_tqdm=False)
    kept = LLM(path, quantization="gguf", dtype="float32", **GGUF_ARGS)
    runs = [kept.generate(prompts, params, use_tqdm=False)]
    runs.append(  # and over two devices (heads, the MLP and the vocabulary split)
        LLM(
            path, quantization="gguf", dtype="float32", tensor_parallel_size=2, **GGUF_ARGS
        ).generate(prompts, params, use_tqdm=False)
    )
    for run in runs:
        for want, got in zip(float_run, run, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
                for token, lp in a.items():
                    assert abs(b[token].logprob - lp.logprob) < 1e-4
    state = kept.llm_engine.runner.state
    up = state["layers"]["mlp"]["up_proj"]["weight"].get_value()
    assert isinstance(up, QuantizedWeight) and up.kind == "uint4"
    assert isinstance(state["embed_tokens"].get_value(), QuantizedWeight) == (embedding == "Q8_0")


def test_gguf_mixed_types_per_layer(tmp_path, make_tiny, gguf_writer):
    """llama.cpp's K_M mixes: one part's layers in different kept types (Q6_K and Q4_K) are
    stacked as int8 codes with 16-input scales; a part with a layer of a type not kept (Q5_0)
    is dequantized in every layer; both run as the dequantized-on-load engine does."""
    path = str(tmp_path / "mixed.gguf")
    types = {
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.1.ffn_down.weight": "Q4_K",
        "blk.1.attn_v.weight": "Q5_0",
    }
    model = make_tiny("llama", tie=True, intermediate_size=256)
    gguf_writer(path, model, "llama", matrix_type="Q4_1", types=types)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(3, 6, seed=7)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = LLM(path, dtype="float32", **GGUF_ARGS).generate(prompts, params, use_tqdm=False)
    kept = LLM(path, quantization="gguf", dtype="float32", **GGUF_ARGS)
    got = kept.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(y[t].logprob - lp.logprob) < 1e-4 for t, lp in x.items())
    layers = kept.llm_engine.runner.state["layers"]
    down = layers["mlp"]["down_proj"]["weight"].get_value()
    assert isinstance(down, QuantizedWeight) and (down.kind, down.group) == ("int8", 16)
    assert not isinstance(layers["self_attn"]["v_proj"]["weight"].get_value(), QuantizedWeight)
    assert layers["mlp"]["up_proj"]["weight"].get_value().kind == "uint4"


def test_no_compile_after_warmup_with_quantized_weights(tmp_path, make_tiny, gguf_writer):
    path = str(tmp_path / "llama.gguf")
    gguf_writer(path, make_tiny("llama", tie=True), "llama", matrix_type="Q4_1")
    small = dict(max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=False)
    llm = LLM(path, quantization="gguf", **{**GGUF_ARGS, **small})
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(5, 4, seed=2)]
    params = [SamplingParams(temperature=t, max_tokens=6, seed=1) for t in (0, 0.8, 1, 0, 0.5)]
    with count_compiles() as events:
        llm.generate(prompts, params, use_tqdm=False)
    assert events == []


def test_quantization_the_checkpoint_contradicts_is_refused(llama_dir, smollm_path):
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        resolve_quantization("gguf", resolve_model(llama_dir))
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("fp8", resolve_model(smollm_path))
    with pytest.raises(ValueError, match="quantization='awq' needs an AWQ checkpoint"):
        LLM(llama_dir, quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(llama_dir, quantization="int3")

"""AWQ and GPTQ checkpoints, written by the tests' own packing code (tests/
quantized_checkpoints.py: AutoAWQ's gemm layout, AutoGPTQ's v1 and GPTQModel's v2) from a
tiny transformers model: the engine, which finds the method in config.json, against
transformers running the same quantized values dequantized by that code."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from oracle import SMALL, worst_teacher_forced_gaps
from quantized_checkpoints import (
    awq_tensors,
    gptq_tensors,
    quantize,
    quantize_checkpoint,
    reference,
)
from safetensors.numpy import load_file, save_file

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model
from jllm.quantization import cpu_kernel, resolve_quantization
from jllm.quantization.checkpoints import awq_weight, gptq_weight, parse_config
from jllm.quantization.weights import QuantizedWeight, dequantize, matmul

CASES = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
            "version": "gemm"},
    "gptq-v1-4bit": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                     "sym": False},
    "gptq-v2-8bit-channel": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                             "desc_act": False, "sym": True, "checkpoint_format": "gptq_v2"},
}  # fmt: skip


# (80 inputs: not whole 32-input runs, so 4-bit codes are held one to a byte.)
@pytest.mark.parametrize(
    "method,bits,group,width", [("awq", 4, 32, 96), ("awq", 4, 48, 96), ("awq", 4, 16, 80),
                                ("gptq", 4, 32, 96), ("gptq", 4, -1, 96), ("gptq", 8, 32, 96)]
)  # fmt: skip
def test_weights_unpack_to_the_formats_values(method, bits, group, width):
    rng = np.random.default_rng(bits * 7 + group + 1)
    w = rng.normal(0, 0.05, (48, width)).astype(np.float32)
    q, zero, scale = quantize(w, bits, group)
    if method == "awq":
        spec = parse_config({"quant_method": "awq", "bits": 4, "group_size": group}, "x")
        got = awq_weight(awq_tensors(q, zero, scale), spec)
    else:
        config = {"quant_method": "gptq", "bits": bits, "group_size": group}
        spec = parse_config(config, "x")
        got = gptq_weight(gptq_tensors(q, zero, scale, bits, v1=True), spec)
    want = reference(q, zero, scale)
    assert got.kind == ("uint4" if bits == 4 and width % 32 == 0 else "int8")
    np.testing.assert_allclose(np.asarray(dequantize(got, jnp.float32)), want, rtol=0, atol=1e-7)
    for rows, kernel in ((3, True), (20, False)):  # the CPU kernel; XLA's product
        x = rng.normal(size=(rows, width)).astype(np.float32)
        args = (jnp.asarray(x), jax.tree.map(jnp.asarray, got))
        assert (cpu_kernel.TARGET in jax.jit(matmul).lower(*args).as_text()) == kernel
        np.testing.assert_allclose(np.asarray(jax.jit(matmul)(*args)), x @ want.T, atol=1e-5)


def test_group_size_must_divide_the_inputs():
    """AutoGPTQ writes ceil(In / group_size) groups when it does not divide (SmolLM2's 576
    inputs at 128); those are refused as vLLM refuses them, not read as other groups."""
    w = np.random.default_rng(0).normal(0, 0.05, (16, 96)).astype(np.float32)
    q, zero, scale = quantize(w, 4, 48)  # two groups of 48: what 96 / 64 rounded up stores
    spec = parse_config({"quant_method": "gptq", "bits": 4, "group_size": 64}, "x")
    with pytest.raises(ValueError, match="96 inputs are not a multiple of gptq group_size 64"):
        gptq_weight(gptq_tensors(q, zero, scale, 4, v1=True), spec)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_transformers_on_its_dequantized_values(case, tmp_path, save_tiny):
    config = CASES[case]
    bits, group = config["bits"], config["group_size"]
    src, _ = save_tiny("llama", tie=False)
    path, ref = str(tmp_path / "q"), str(tmp_path / "reference")
    # GPTQ v1 with AutoGPTQ's zero biases on every projection of a model without biases
    quantize_checkpoint(src, path, config, ref, zero_biases=case == "gptq-v1-4bit")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, 5 + 3 * i).tolist() for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = LLM(path, dtype="float32", **SMALL)  # the method comes from config.json
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(ref).eval()
    runs = [(p, o.outputs[0]) for p, o in zip(prompts, outs, strict=True)]
    gap, error = worst_teacher_forced_gaps(oracle, runs)
    assert gap == 0.0 and error < 1e-4, (gap, error)
    down = llm.llm_engine.runner.state["layers"]["mlp"]["down_proj"]["weight"].get_value()
    assert isinstance(down, QuantizedWeight) and down.kind == ("uint4" if bits == 4 else "int8")
    assert down.group == (96 if group == -1 else group)
    if case == "awq":  # and split over two devices (vLLM's GPU kernel name as the method)
        split = LLM(path, dtype="float32", quantization="awq_marlin", tensor_parallel_size=2,
                    **SMALL)  # fmt: skip
        again = split.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for a, b in zip(outs, again, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_refusals(tmp_path, save_tiny, llama_dir):
    config = CASES["gptq-v1-4bit"]
    path = quantize_checkpoint(save_tiny("llama")[0], str(tmp_path / "g"), config)
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* \(awq\)"):
        resolve_quantization("awq", resolve_model(path))
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        LLM(llama_dir, quantization="gptq")

    def rewrite(**changes):
        cfg_path = tmp_path / "g" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = {**config, **changes}
        cfg_path.write_text(json.dumps(cfg))
        return path

    with pytest.raises(ValueError, match="3-bit GPTQ weights are not supported"):
        resolve_model(rewrite(bits=3))
    with pytest.raises(ValueError, match="'bitsandbytes'-quantized checkpoint"):
        resolve_model(rewrite(quant_method="bitsandbytes"))
    # act-order: g_idx that is not i // group_size
    rewrite()
    tensors = load_file(str(tmp_path / "g" / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = np.random.default_rng(0).permutation(tensors[name])
    save_file(tensors, str(tmp_path / "g" / "model.safetensors"))
    with pytest.raises(ValueError, match="desc_act"):
        LLM(path, **SMALL)


def test_dummy_awq_weights_from_a_config_only_folder(tmp_path, make_tiny):
    """A config-only AWQ folder with load_format="dummy": random 4-bit codes on the devices
    (how a quantized big model's speed is measured)."""
    make_tiny("llama").config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = CASES["awq"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, **SMALL)
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4
    up = llm.llm_engine.runner.state["layers"]["mlp"]["up_proj"]["weight"].get_value()
    assert isinstance(up, QuantizedWeight) and (up.kind, up.group) == ("uint4", 32)
    values = np.asarray(dequantize(jax.tree.map(lambda a: a[0], up), jnp.float32))
    assert 0.01 < values.std() < 0.04  # about N(0, 0.02)'s spread

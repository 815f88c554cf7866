"""Float8 checkpoints (`quant_method: "fp8"`): written here from tiny transformers models, with
DeepSeek-V3's block-wise scales (`weight_block_size`, `weight_scale_inv`; blocks of 24 output
channels, so the last is partial) and with one scale per tensor (`weight_scale`, a static
`input_scale` beside it). The engine keeps the codes in float8 and equals transformers
running the same values dequantized, experts included; under tensor and expert parallelism
too. A config-only folder loads with dummy float8 weights of the same form."""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from deepseek_oracle import save_tiny
from oracle import SMALL, assert_matches, eager, prompt_ids
from oracle import save_tiny as save_tiny_dense
from safetensors.numpy import load_file
from safetensors.torch import save_file

from jllm import LLM, SamplingParams
from jllm.quantization.checkpoints import parse_config
from jllm.quantization.fp8_checkpoints import fp8_weight, iter_fp8
from jllm.quantization.weights import QuantizedWeight, dequantize

BLOCK = [24, 16]
E4M3_MAX = 448.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def quantized(name: str) -> bool:
    """The projections FP8 releases store in float8: not the embedding, lm_head, the norms
    or a router."""
    return (
        name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")
    ) and ".mlp.gate." not in name


def fp8_blocks(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """w [Out, In] as float8 codes and a float32 scale per block (`block`) or per tensor
    (None): scale = the block's absmax / 448, codes rounded to nearest."""
    out, width = w.shape
    if block is None:
        scale = np.float32(np.abs(w).max() / E4M3_MAX)
        return (w / scale).astype(ml_dtypes.float8_e4m3fn), np.array(scale, np.float32)
    bo, bi = block
    rows = -(-out // bo)
    padded = np.zeros((rows * bo, width), np.float32)
    padded[:out] = w
    blocks = padded.reshape(rows, bo, width // bi, bi)
    scale = (np.abs(blocks).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)  # [rows, In/bi]
    codes = (blocks / scale[:, None, :, None]).reshape(rows * bo, width)[:out]
    return codes.astype(ml_dtypes.float8_e4m3fn), scale


def dequantized(codes, scale, block) -> np.ndarray:
    values = codes.astype(np.float32)
    if block is None:
        return values * scale
    bo, bi = block
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)
    return values * full[: values.shape[0]]


def write_fp8(src: str, dst, block, reference) -> str:
    """`src`'s projections in float8 at `dst` (FP8 checkpoint), and the same values
    dequantized as a float checkpoint at `reference` (the oracle's)."""
    tensors = load_file(f"{src}/model.safetensors")
    stored, plain = {}, {}
    for name, w in tensors.items():
        if not quantized(name):
            stored[name] = torch.from_numpy(np.ascontiguousarray(w))
            plain[name] = stored[name]
            continue
        codes, scale = fp8_blocks(w, block)
        prefix = name.removesuffix(".weight")
        bits = torch.from_numpy(np.ascontiguousarray(codes).view(np.uint8))
        stored[name] = bits.view(torch.float8_e4m3fn)
        stored[f"{prefix}.weight_scale{'_inv' if block else ''}"] = torch.from_numpy(scale)
        if block is None:  # a static activation scale, which jllm drops
            stored[f"{prefix}.input_scale"] = torch.tensor(1.0)
        plain[name] = torch.from_numpy(dequantized(codes, scale, block))
    for path, weights in ((dst, stored), (reference, plain)):
        shutil.copytree(src, path)
        save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic" if block else "static",
        **({"weight_block_size": block} if block else {}),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("fp8")
    src = save_tiny("v3-q-lora", root / "float", tokenizer_dir)
    return write_fp8(src, root / "fp8", BLOCK, root / "reference"), str(root / "reference")


def fp8_weights(llm) -> list[QuantizedWeight]:
    state = llm.llm_engine.runner.state
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return [w for w in leaves if isinstance(w, QuantizedWeight)]


@pytest.mark.parametrize(
    "settings",
    [{}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}],
    ids=["one-device", "tp2-ep"],
)
def test_block_scaled_deepseek_matches_transformers(deepseek_fp8, settings):
    path, reference = deepseek_fp8
    llm = LLM(path, **{**SMALL, "dtype": "float32", **settings})
    prompts = prompt_ids(2, 6, vocab=512) + prompt_ids(1, 45, seed=1, vocab=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches(eager(reference), prompts, outs)
    weights = fp8_weights(llm)
    assert {w.kind for w in weights} == {"fp8"}
    # the attention's, the dense layer's, the shared and the routed experts' projections
    experts = [w for w in weights if w.codes.ndim == 4]  # [L, E, Out, In]
    assert experts and all(w.group == BLOCK[1] for w in weights)
    assert len(weights) >= 10


def test_per_tensor_scaled_llama_matches_transformers(tmp_path, tokenizer_dir):
    src = save_tiny_dense("llama", tmp_path, tokenizer_dir)
    path = write_fp8(src, tmp_path / "fp8", None, tmp_path / "reference")
    llm = LLM(path, **{**SMALL, "dtype": "float32"})
    prompts = prompt_ids(3, 7, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches(eager(str(tmp_path / "reference")), prompts, outs)
    weights = fp8_weights(llm)
    assert weights and all(w.kind == "fp8" and w.scale.shape[-1] == 1 for w in weights)
    with pytest.raises(ValueError, match=r"model config \(fp8\) does not match .* \(tpu_int8\)"):
        LLM(path, quantization="tpu_int8", **SMALL)


def test_block_scales_read_as_the_format_says():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (50, 32)).astype(np.float32)
    codes, scale = fp8_blocks(w, BLOCK)
    assert scale.shape == (3, 2)  # 50 channels in blocks of 24: the last partial
    got = fp8_weight(codes, scale, tuple(BLOCK), "p")
    assert got.codes.dtype == np.uint8 and got.scale.shape == (50, 2) and got.group == 16
    want = dequantized(codes, scale, BLOCK)
    np.testing.assert_array_equal(np.asarray(dequantize(got, np.float32)), want)

    stream = [("a.weight", codes), ("b.weight", w), ("a.weight_scale_inv", scale)]
    out = dict(iter_fp8(iter(stream), tuple(BLOCK)))
    assert isinstance(out["a.weight"], QuantizedWeight) and out["b.weight"] is w

    bad = (
        ([("a.weight", codes)], "float8 weight but no scale"),
        ([("a.weight_scale_inv", scale)], "a weight scale but no float8 weight"),
        ([("a.weight", codes), ("a.weight_scale_inv", scale[:2])], r"does not fit \[24, 16\]"),
        ([("a.weight", w.astype(ml_dtypes.float8_e5m2))], "float8_e5m2 are not supported"),
    )
    for tensors, message in bad:
        with pytest.raises(ValueError, match=message):
            list(iter_fp8(iter(tensors), tuple(BLOCK)))
    with pytest.raises(ValueError, match="does not divide its 32 inputs"):
        fp8_weight(codes, scale, (24, 12), "p")
    with pytest.raises(ValueError, match="in 'e5m2' are not supported"):
        parse_config({"quant_method": "fp8", "fmt": "e5m2"}, "x")
    with pytest.raises(ValueError, match="weight_block_size must be two positive ints"):
        parse_config({"quant_method": "fp8", "weight_block_size": [128]}, "x")
    spec = parse_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, "x")
    assert (spec.method, spec.block, spec.group_size) == ("fp8", (128, 128), 128)


def test_config_only_fp8_folder_loads_dummy_blocks(deepseek_fp8, tmp_path):
    """`load_format="dummy"` over an FP8 config (the benchmarks' config-only folders): every
    projection float8 with a scale per block of inputs, as the checkpoint would give."""
    path, _ = deepseek_fp8
    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{name}", folder)
    llm = LLM(str(folder), load_format="dummy", **{**SMALL, "dtype": "float32"})
    weights = fp8_weights(llm)
    assert any(w.codes.ndim == 4 for w in weights)  # the routed experts
    assert all(w.kind == "fp8" and w.group == BLOCK[1] for w in weights)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8

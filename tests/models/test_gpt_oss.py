"""gpt-oss against transformers' torch path: a tiny random model (float32, 4 layers
alternating a 16-token sliding window and full attention, learned sinks, biases on the
attention and the router and every expert, the clamped SwiGLU with a limit the activations
reach, YaRN), 40-90 token prompts past the window, greedy tokens equal and each chosen
token's logprob within 1e-4 of transformers' teacher-forced one. Crosses: chunked prefill
(decodes beside chunks, one step ahead), preemption, the prefix cache, tensor parallelism
with and without expert parallelism, the Pallas kernels (interpreted), n-gram speculation,
two pipeline stages, fp8 experts quantized on load (against transformers on the quantized
values)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from lora_oracle import assert_attention_adapter_matches
from oracle import (
    CROSS_IDS,
    CROSSES,
    SMALL,
    TINY,
    assert_crosses_match,
    assert_matches,
    generate,
    prompt_ids,
)
from quantized_checkpoints import online_values
from safetensors.numpy import save_file

from jllm import LLM
from jllm.models.gpt_oss import regroup

VOCAB = 512
PROMPTS = prompt_ids(3, 40, vocab=VOCAB) + prompt_ids(1, 90, seed=1, vocab=VOCAB)
CACHED = [32, 32, 48, 80]  # their whole blocks (of 40, 47, 54 and 90 tokens), on a rerun

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=4,
    sliding_window=16,
    swiglu_limit=1.5,  # reached by some gates and ups of these weights: the clamp matters
    tie_word_embeddings=False,
    **{k: TINY[k] for k in ("max_position_embeddings", "rms_norm_eps", "initializer_range")},
    **{k: TINY[k] for k in ("bos_token_id", "eos_token_id")},
)


def save_gpt_oss(root, tokenizer_dir: str, **overrides) -> str:
    """A tiny random gpt-oss with sinks of either sign and non-zero biases."""
    config = transformers.GptOssConfig(**SHAPE | overrides)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif "bias" in name:
                param.normal_(0.0, 0.2)
    path = root / "gpt_oss"
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tokenizer_dir) -> str:
    return save_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), tokenizer_dir)


@pytest.fixture(scope="module")
def oracle(gpt_oss_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_dir).eval()


def test_regroup_cuts_the_stacked_experts():
    """gate and up interleaved column by column in gate_up_proj [E, D, 2F]; each expert's
    parts come out in transformers' [Out, In]."""
    gate_up = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # E=2, D=3, F=2
    bias = np.arange(2 * 4, dtype=np.float32).reshape(2, 4)
    out = dict(
        regroup(
            [
                ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
                ("model.layers.0.mlp.experts.gate_up_proj_bias", bias),
                ("model.norm.weight", bias[0]),
            ]
        )
    )
    np.testing.assert_array_equal(
        out["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1][:, ::2].T
    )
    np.testing.assert_array_equal(
        out["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1][:, 1::2].T
    )
    np.testing.assert_array_equal(out["model.layers.0.mlp.experts.0.up_proj.bias"], [1, 3])
    assert "model.norm.weight" in out and len(out) == 9


@pytest.mark.parametrize("settings", CROSSES, ids=CROSS_IDS)
def test_matches_transformers(gpt_oss_dir, oracle, settings):
    assert_crosses_match(gpt_oss_dir, oracle, PROMPTS, settings, CACHED)


def test_fp8_matches_transformers_on_the_quantized_values(gpt_oss_dir):
    """quantization="fp8": every projection, the router and each expert quantized per output
    channel on load; the biases and sinks kept. Equal to transformers on a checkpoint of the
    quantized values (the stacked experts' channels are their columns: the absmax runs over
    the input axis, 1)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_dir).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "embed_tokens" in name:
                continue  # (the experts' biases are [E, F]: 2-D, not quantized)
            if param.ndim == 2:
                param.copy_(torch.from_numpy(online_values(param.numpy(), "fp8")))
            elif param.ndim == 3:  # [E, In, Out]
                param.copy_(torch.from_numpy(online_values(param.numpy(), "fp8", axis=1)))
    llm = LLM(gpt_oss_dir, **{**SMALL, "dtype": "float32", "quantization": "fp8"})
    outs = generate(llm, PROMPTS[:2])
    assert_matches(model, PROMPTS[:2], outs)


# The e2m1 values of the 16 FP4 codes, the test's own table (OCP's microscaling format).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def to_mxfp4(w: np.ndarray):
    """w [..., Out, In] -> (blocks [..., Out, In / 32, 16] uint8, scales [..., Out, In / 32]
    uint8, the values they hold): each block of 32 inputs scaled by the power of two that
    brings its absmax within 6, each value rounded to the nearest code."""
    *lead, out, width = w.shape
    g = w.reshape(*lead, out, width // 32, 32)
    absmax = np.maximum(np.abs(g).max(-1), 1e-30)
    exp = np.clip(np.ceil(np.log2(absmax / 6.0)), -127, 127).astype(np.int32)
    scale = np.exp2(exp.astype(np.float32))[..., None]
    idx = np.abs((g / scale)[..., None] - E2M1).argmin(-1)
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).astype(np.uint8)
    scales = (exp + 127).astype(np.uint8)  # (safetensors writes an array's memory order)
    values = (E2M1[idx] * scale).reshape(w.shape)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales), values


@pytest.fixture(scope="module")
def mxfp4_dirs(gpt_oss_dir, tmp_path_factory):
    """(the checkpoint in the released MXFP4 layout, its float twin holding the values the
    MXFP4 codes hold): the tiny model's experts as `*_blocks` / `*_scales` [E, Out, In]."""
    root = tmp_path_factory.mktemp("mxfp4")
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_dir).eval()
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales, values = to_mxfp4(np.swapaxes(param.numpy(), 1, 2))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
                param.copy_(torch.from_numpy(np.swapaxes(values, 1, 2)))
            else:
                tensors[name] = param.numpy().copy()
    model.save_pretrained(root / "float")
    quantized = root / "mxfp4"
    shutil.copytree(gpt_oss_dir, quantized)
    os.remove(quantized / "model.safetensors")
    save_file(tensors, str(quantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(root / "float")


@pytest.mark.parametrize(
    "settings",
    [{}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}],
    ids=["plain", "tp2-ep"],
)
def test_mxfp4_checkpoint_stays_4_bit_and_matches_transformers(mxfp4_dirs, settings):
    """The released layout loads with quantization detected ("mxfp4"), its experts kept as
    4-bit codes and e8m0 scales; greedy tokens and logprobs equal transformers' on the values
    the codes hold."""
    quantized, floats = mxfp4_dirs
    llm = LLM(quantized, **{**SMALL, "dtype": "float32", **settings})
    experts = llm.llm_engine.runner.state["blocks"][0][0]["mlp"]["experts"]
    gate = experts["gate_proj"].get_value()
    assert gate.kind == "mxfp4" and gate.codes.dtype == np.uint8 and gate.scale.dtype == np.uint8
    assert gate.codes.shape == (2, 8, 32, 32) and gate.scale.shape == (2, 8, 32, 2)  # F, D / 2
    oracle = transformers.AutoModelForCausalLM.from_pretrained(floats).eval()
    assert_matches(oracle, PROMPTS, generate(llm, PROMPTS))


def test_mxfp4_dummy_weights(mxfp4_dirs):
    """load_format="dummy" on an MXFP4 config draws 4-bit experts (the speed benchmarks')."""
    llm = LLM(mxfp4_dirs[0], **{**SMALL, "load_format": "dummy"})
    gate = llm.llm_engine.runner.state["blocks"][0][0]["mlp"]["experts"]["gate_proj"].get_value()
    assert gate.kind == "mxfp4"
    assert len(generate(llm, PROMPTS[:1])[0].outputs[0].token_ids) == 8


def test_mxfp4_refused_without_such_a_checkpoint(gpt_oss_dir):
    with pytest.raises(ValueError, match="needs an MXFP4 checkpoint"):
        LLM(gpt_oss_dir, **SMALL, quantization="mxfp4")


def test_lora_on_the_attention_matches_merged_peft(gpt_oss_dir, tmp_path):
    """A PEFT adapter on q/k/v/o (biased projections beside sinks), mixed with the base model
    in one batch: each request equals transformers with the adapter merged."""
    assert_attention_adapter_matches(gpt_oss_dir, tmp_path, PROMPTS, SMALL)

"""DeepSeek-V2 and V3 (models/deepseek.py) against transformers on tiny random checkpoints,
float32: V3 with a q LoRA and grouped, biased routing; V3 without q LoRA, with YaRN and its
mscale; V2 with softmax routing. Greedy tokens equal and each token's logprob within 1e-4,
teacher-forced; the cache holds one latent per token and layer; chunked prefill with
preemption, prefix hits, tensor parallelism, expert parallelism and pipeline stages (the
dense layer and the sparse ones in one stage or two) give the same tokens, and so does the
GPU kernel (interpret mode) over heads split in two and over stages."""

from __future__ import annotations

import numpy as np
import pytest
from deepseek_oracle import TINY, VARIANTS, save_tiny
from oracle import SMALL, assert_bf16_near_fp32, assert_matches, eager, prompt_ids

from jllm import LLM, SamplingParams

PROMPTS = prompt_ids(2, 6, vocab=512) + prompt_ids(1, 45, seed=1, vocab=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: save_tiny(name, root / name, tokenizer_dir) for name in VARIANTS}


def generate(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(checkpoints, variant):
    llm = LLM(checkpoints[variant], **{**SMALL, "dtype": "float32"})
    kv = llm.llm_engine.scheduler.kv_cache
    assert [spec.describe() for spec in kv.specs] == ["MLA latent 16+16"]  # one latent a token
    assert_matches(eager(checkpoints[variant]), PROMPTS, generate(llm, PROMPTS))
    again = generate(llm, [p[:34] + [7, 8, 9] for p in PROMPTS[2:]])  # two blocks cached
    assert again[0].num_cached_tokens == 32
    assert_matches(eager(checkpoints[variant]), [PROMPTS[2][:34] + [7, 8, 9]], again)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 7},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 2, "enable_expert_parallel": True},
        {"tensor_parallel_size": 4, "enable_expert_parallel": True},
        {"tensor_parallel_size": 2, "attention_backend": "pallas_gpu_interpret"},
        {"attention_backend": "xla", "max_num_batched_tokens": 16},
        {"pipeline_parallel_size": 3, "max_num_batched_tokens": 16},
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True},
        {
            "pipeline_parallel_size": 2,
            "attention_backend": "pallas_gpu_interpret",
            "max_num_batched_tokens": 16,
        },
    ],
    ids=[
        "chunked-preempting",
        "tp2",
        "ep2",
        "ep4",
        "tp2-gpu-kernel",
        "xla-chunked",
        "pp3",
        "pp2-ep2",
        "pp2-gpu-kernel",
    ],
)
def test_layouts_give_the_same_tokens(checkpoints, settings):
    path = checkpoints["v3-q-lora"]
    llm = LLM(path, **{**SMALL, "dtype": "float32", **settings})
    # Preempting: four requests of two blocks each growing into a third, on six blocks.
    preempting = "num_gpu_blocks_override" in settings
    prompts, params = PROMPTS, GREEDY
    if preempting:
        prompts = prompt_ids(4, 20, seed=2, vocab=512)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    assert_matches(eager(path), prompts, generate(llm, prompts, params))
    if preempting:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    stages = settings.get("pipeline_parallel_size", 1)
    if stages > 1:  # the dense layer, then the two sparse ones: vLLM's consecutive runs
        plan = {3: ((1, 0), (0, 1), (0, 1)), 2: ((1, 1), (0, 1))}[stages]
        assert llm.llm_engine.model_config.stage_segments == plan


def test_the_checkpoints_mtp_layer_is_left_out(checkpoints, tmp_path):
    """DeepSeek-V3's checkpoints carry `num_nextn_predict_layers` layers after the decoder's
    (the MTP module: a layer's tensors and its own norms and projection): the model that
    generates leaves them out; a layer past the decoder's that no config declares is refused."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    path = tmp_path / "mtp"
    shutil.copytree(checkpoints["v3-q-lora"], path)
    tensors = load_file(path / "model.safetensors")
    L = TINY["num_hidden_layers"]
    extra = {
        k.replace("layers.2.", f"layers.{L}."): v for k, v in tensors.items() if "layers.2." in k
    }
    extra[f"model.layers.{L}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    extra[f"model.layers.{L}.enorm.weight"] = np.ones(64, np.float32)
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=f"layers.{L}"):
        LLM(str(path), **{**SMALL, "dtype": "float32"})
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    llm = LLM(str(path), **{**SMALL, "dtype": "float32"})
    assert_matches(eager(checkpoints["v3-q-lora"]), PROMPTS[:1], generate(llm, PROMPTS[:1]))


def test_bf16_stays_near_float32(tmp_path, tokenizer_dir):
    """bf16 weights in a bf16 engine (the latent cache, the absorbed products, the experts in
    bf16; the router's scores in float32): greedy choices and logprobs within bf16's error
    of transformers running the same weights in float32. The correction bias is spread wide
    (10) so that each layer's experts are the same for every token: with the usual spread
    a bf16-rounded hidden state flips near-tied expert choices of these wide random weights,
    and a flipped expert moves a logit by nats (measured: worst gap 5.3 nats, against 0.04
    with the choices fixed)."""
    import torch

    path = save_tiny(
        "v3-q-lora", tmp_path / "bf16", tokenizer_dir, dtype=torch.bfloat16, bias_std=10.0
    )
    llm = LLM(path, **{**SMALL, "dtype": "bfloat16"})
    assert_bf16_near_fp32(llm, path, vocab=TINY["vocab_size"])


def test_adapters_are_refused_with_the_reason(checkpoints):
    """LoRA on multi-head latent attention (kv_b_proj split and absorbed) is refused at
    start-up by name."""
    with pytest.raises(ValueError, match="multi-head latent attention"):
        LLM(checkpoints["v3-q-lora"], **{**SMALL, "enable_lora": True, "max_loras": 1})

"""DeepSeek-V2 and V3 (models/deepseek.py) against transformers on tiny random checkpoints,
float32: V3 with a q LoRA and grouped, biased routing; V3 without q LoRA, with YaRN and its
mscale; V2 with softmax routing. Greedy tokens equal and each token's logprob within 1e-4,
teacher-forced; the cache holds one latent per token and layer; chunked prefill with
preemption, prefix hits, tensor parallelism and expert parallelism give the same tokens, and
so does the GPU kernel (interpret mode) over heads split in two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from oracle import SMALL, assert_matches, eager, prompt_ids

from jllm import LLM, SamplingParams

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,  # with kv_lora_rank, the GPU kernel's two loads
    v_head_dim=16,
    n_shared_experts=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
V3 = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
V2 = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
VARIANTS = {
    "v3-q-lora": (V3, dict(q_lora_rank=32, n_group=4, topk_group=2)),
    "v3-yarn": (V3, dict(q_lora_rank=None, n_group=2, topk_group=1, rope_parameters=YARN)),
    "v2": (V2, dict(q_lora_rank=None, topk_method="greedy")),
}
PROMPTS = prompt_ids(2, 6, vocab=512) + prompt_ids(1, 45, seed=1, vocab=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for name, ((config_cls, model_cls), extra) in VARIANTS.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**TINY, **extra)).eval()
        with torch.no_grad():  # non-trivial norms, and a correction bias that matters
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.3)
        model.save_pretrained(root / name)
        transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


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
    ],
    ids=["chunked-preempting", "tp2", "ep2", "ep4", "tp2-gpu-kernel"],
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

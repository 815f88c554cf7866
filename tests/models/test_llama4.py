"""Llama 4's text model against transformers' torch path: a tiny random model (float32, 4
layers: three with rotary positions, chunked local attention over 16-position chunks and the
weightless q/k norm, one NoPE layer over everything with its queries' temperature; experts
(sigmoid top-1 routing on the inputs, a shared expert) on every second layer, a wider dense
MLP on the others), 40-90 token prompts past several chunks: greedy tokens equal and each
chosen token's logprob within 1e-4 of transformers' teacher-forced one. Crosses: chunked
prefill (decodes beside chunks, one step ahead), preemption, the prefix cache, tensor and
expert parallelism, the Pallas TPU and GPU kernels (interpreted), n-gram speculation, two
pipeline stages."""

from __future__ import annotations

import pytest
import torch
import transformers
from lora_oracle import assert_attention_adapter_matches, make_adapter
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

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest

VOCAB = 512
PROMPTS = prompt_ids(3, 40, vocab=VOCAB) + prompt_ids(1, 90, seed=1, vocab=VOCAB)
CACHED = [32, 32, 48, 80]  # their whole blocks (of 40, 47, 54 and 90 tokens), on a rerun

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=16,
    floor_scale=8,  # the NoPE layer's temperature changes every 8 positions
    attn_scale=0.5,
    tie_word_embeddings=False,
    **{k: TINY[k] for k in ("max_position_embeddings", "rms_norm_eps", "initializer_range")},
    **{k: TINY[k] for k in ("bos_token_id", "eos_token_id")},
)


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tokenizer_dir) -> str:
    config = transformers.Llama4TextConfig(**SHAPE)
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama4") / "llama4"
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def oracle(llama4_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama4_dir).eval()


@pytest.mark.parametrize("settings", CROSSES, ids=CROSS_IDS)
def test_matches_transformers(llama4_dir, oracle, settings):
    assert_crosses_match(llama4_dir, oracle, PROMPTS, settings, CACHED)


def test_the_multimodal_checkpoints_text_half(tmp_path, tokenizer_dir):
    """`Llama4ForConditionalGeneration` (Scout's and Maverick's class): its language model
    under `language_model.` serves text; the vision tower and projector are not loaded."""
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    torch.manual_seed(1)
    config = transformers.Llama4Config(text_config=SHAPE, vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **{**SMALL, "dtype": "float32"})
    assert_matches(model.language_model, PROMPTS[:2], generate(llm, PROMPTS[:2]))


def test_lora_on_the_attention_matches_merged_peft(llama4_dir, tmp_path):
    """A PEFT adapter on q/k/v/o, mixed with the base model in one batch, equals transformers
    with it merged: its q/k rows take the rotate-half order the weights took on load. An
    adapter on down_proj (the dense MLP's and the shared expert's differ in shape) is
    refused by name."""
    llm = assert_attention_adapter_matches(llama4_dir, tmp_path, PROMPTS, SMALL)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    mlp = make_adapter(llama4_dir, tmp_path, "mlp", 8, 16, ["q_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"target modules \['down_proj'\] are not in"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, False, LoRARequest("mlp", 2, mlp[0]))

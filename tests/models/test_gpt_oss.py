"""gpt-oss against transformers' torch path: a tiny random model (float32, 4 layers
alternating a 16-token sliding window and full attention, learned sinks, biases on the
attention and the router and every expert, the clamped SwiGLU with a limit the activations
reach, YaRN), 40-90 token prompts past the window, greedy tokens equal and each chosen
token's logprob within 1e-4 of transformers' teacher-forced one. Crosses: chunked prefill
(decodes beside chunks, one step ahead), preemption, the prefix cache, tensor parallelism
with and without expert parallelism, fp8 experts quantized on load (against transformers on
the quantized values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from oracle import SMALL, TINY, assert_matches, generate, prompt_ids
from quantized_checkpoints import online_values

from jllm import LLM, SamplingParams
from jllm.models.gpt_oss import regroup

VOCAB = 512
PROMPTS = prompt_ids(3, 40, vocab=VOCAB) + prompt_ids(1, 90, seed=1, vocab=VOCAB)

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


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # A 16-token budget: every prompt is cut into chunks, decodes run beside them.
        {"max_num_batched_tokens": 16, "async_scheduling": True},
        # 13 usable blocks: the requests outgrow them with 40 tokens each.
        {"num_gpu_blocks_override": 14},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    ],
    ids=["plain", "chunked-async", "preempting", "tp2", "tp2-ep"],
)
def test_matches_transformers(gpt_oss_dir, oracle, settings):
    llm = LLM(gpt_oss_dir, **{**SMALL, "dtype": "float32", **settings})
    tokens = 40 if "num_gpu_blocks_override" in settings else 8
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    outs = generate(llm, PROMPTS, params)
    assert_matches(oracle, PROMPTS, outs)
    if "num_gpu_blocks_override" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if settings == {}:  # the prefix cache: whole blocks of the prompts
        again = generate(llm, PROMPTS, params)
        assert_matches(oracle, PROMPTS, again)
        assert [o.num_cached_tokens for o in again] == [32, 32, 48, 80]  # of 40, 47, 54, 90


def test_fp8_matches_transformers_on_the_quantized_values(gpt_oss_dir, tmp_path):
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

"""Prompts given as embeddings (vLLM's `{"prompt_embeds": tensor}`, `enable_prompt_embeds`):
against transformers' `inputs_embeds` (greedy tokens, logprobs within 1e-4 in float32), the
prefix cache keyed on the rows themselves, penalties that see no placeholder prompt tokens,
the crosses with LoRA (PEFT's merged model as the oracle) and n-gram speculation, and every
malformed array refused by name. Chunked prefill, preemption, async scheduling, the host
tier and TP/PP are crossed in test_crosses.py's random mixes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from embeds_oracle import embeds_of, hf_from_embeds
from lora_oracle import make_adapters
from oracle import SMALL, prompt_ids, same_outputs

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest

ARGS = {**SMALL, "dtype": "float32", "enable_prompt_embeds": True}
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def hf(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ARGS)


def assert_matches(out, tokens, logprobs) -> None:
    gen = out.outputs[0]
    assert gen.token_ids == tokens
    got = [gen.logprobs[i][t].logprob for i, t in enumerate(tokens)]
    np.testing.assert_allclose(got, logprobs, atol=1e-4)


def test_greedy_tokens_and_logprobs_match_transformers(llm, hf):
    prompts = [embeds_of(hf, ids, seed=i) for i, ids in enumerate(prompt_ids(3, 5))]
    prompts[1] = embeds_of(hf, prompt_ids(1, 37, seed=4)[0], seed=9)  # past two blocks
    outs = llm.generate(
        [{"prompt_embeds": e} for e in prompts], SamplingParams(**GREEDY), use_tqdm=False
    )
    for embeds, out in zip(prompts, outs, strict=True):
        assert_matches(out, *hf_from_embeds(hf, embeds, 8))
        # vLLM's placeholders: a prompt of 0s, no prompt text
        assert out.prompt is None and out.prompt_token_ids == [0] * len(embeds)
        assert out.outputs[0].text  # detokenized from no prompt context


def test_data_parallel_shards_take_embeddings_prompts(llama_dir, hf):
    """Two data shards: embeddings prompts beside token prompts, each shard's rows its own."""
    llm = LLM(llama_dir, **ARGS, data_parallel_size=2)
    ids = prompt_ids(4, 5, seed=3)
    prompts = [
        {"prompt_embeds": embeds_of(hf, p, seed=i)} if i % 2 == 0 else {"prompt_token_ids": p}
        for i, p in enumerate(ids)
    ]
    outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    one = LLM(llama_dir, **ARGS).generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    same_outputs([o.outputs[0] for o in outs], [o.outputs[0] for o in one])
    assert all(s.kv_cache.prefix_queries > 0 for s in llm.llm_engine.scheduler.shards)


def test_the_table_rows_of_a_prompt_are_that_prompt(llm, hf):
    ids = prompt_ids(1, 21, seed=3)[0]
    rows = hf.get_input_embeddings().weight.detach()[torch.tensor(ids)]
    params = SamplingParams(**GREEDY)
    (by_rows,) = llm.generate({"prompt_embeds": rows.numpy()}, params, use_tqdm=False)
    (by_ids,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    same_outputs(by_rows.outputs, by_ids.outputs, logprob_tol=0.0)


def test_torch_bfloat16_and_a_batch_axis_of_one(llm, hf):
    embeds = embeds_of(hf, prompt_ids(1, 9, seed=5)[0]).to(torch.bfloat16)
    params = SamplingParams(**GREEDY)
    (a,) = llm.generate({"prompt_embeds": embeds[None]}, params, use_tqdm=False)
    (b,) = llm.generate({"prompt_embeds": embeds.float().numpy()}, params, use_tqdm=False)
    same_outputs(a.outputs, b.outputs, logprob_tol=0.0)


def test_the_prefix_cache_keys_on_the_rows(llm, hf):
    """40 rows: two full blocks are cached and hit by the same rows, by rows that differ
    only in the third block, never by other rows, by placeholder ids or under a salt."""
    embeds = embeds_of(hf, prompt_ids(1, 40, seed=6)[0]).numpy()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def cached(prompt) -> int:
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        return out.num_cached_tokens

    cached({"prompt_embeds": embeds})
    assert cached({"prompt_embeds": embeds}) == 32
    late = embeds.copy()
    late[35] += 1.0
    assert cached({"prompt_embeds": late}) == 32
    middle = embeds.copy()
    middle[20] += 1.0
    assert cached({"prompt_embeds": middle}) == 16
    first = embeds.copy()
    first[0] += 1e-3
    assert cached({"prompt_embeds": first}) == 0
    assert cached({"prompt_token_ids": [0] * 40}) == 0
    assert cached({"prompt_embeds": embeds, "cache_salt": "tenant"}) == 0


def test_penalties_see_no_prompt_tokens(llm, hf):
    """The placeholder ids are not prompt tokens: a repetition penalty applies to the
    generated tokens alone, as transformers' generate does from inputs_embeds. A logit bias
    makes token 0 (the placeholder) the first pick by a hair, which a penalty on it undoes."""
    embeds = embeds_of(hf, prompt_ids(1, 12, seed=7)[0])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    params.repetition_penalty = 1.8
    (out,) = llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    tokens, _ = hf_from_embeds(hf, embeds, 12, repetition_penalty=1.8)
    assert out.outputs[0].token_ids == tokens
    with torch.no_grad():
        logits = hf(inputs_embeds=embeds[None]).logits[0, -1]
    assert abs(logits[0].item()) > 0.1  # a penalty would move it past the margin below
    bias = (logits.max() - logits[0]).item() + 0.02
    params = SamplingParams(
        temperature=0.0, max_tokens=1, repetition_penalty=1.8, logit_bias={0: bias}
    )
    (out,) = llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == [0]


def test_a_grammar_applies_to_what_follows_the_rows(llm, hf):
    from jllm.sampling_params import StructuredOutputsParams

    embeds = embeds_of(hf, prompt_ids(1, 10, seed=11)[0])
    params = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=20,
        n=3,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    )
    (out,) = llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert {o.text for o in out.outputs} <= {"yes", "no", "maybe"}


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_embeds": np.zeros((4, 63), np.float32)}, "hidden_size 63 does not match"),
        ({"prompt_embeds": np.zeros((2, 4, 64), np.float32)}, "2D tensor"),
        ({"prompt_embeds": np.zeros(64, np.float32)}, "2D tensor"),
        ({"prompt_embeds": np.zeros((0, 64), np.float32)}, "cannot be empty"),
        ({"prompt_embeds": np.zeros((3, 64), np.int64)}, "not a floating-point"),
        ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.int32)}, "must hold floats"),
        ({"prompt_embeds": np.full((3, 64), np.nan, np.float32)}, "must be finite"),
        ({"prompt_embeds": "abc"}, "2D tensor"),
        ({"prompt_embeds": np.zeros((600, 64), np.float32)}, "longer than the maximum"),
        (
            {"prompt_embeds": np.zeros((3, 64), np.float32), "prompt_token_ids": [1, 2, 3]},
            "only 'cache_salt'",
        ),
    ],
)
def test_bad_embeddings_are_refused_by_name(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    (ok,) = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    assert len(ok.outputs[0].token_ids) == 2  # the engine goes on


def test_prompt_logprobs_and_a_disabled_engine_are_refused(llm, llama_llm):
    embeds = {"prompt_embeds": np.zeros((3, 64), np.float32)}
    with pytest.raises(ValueError, match="prompt_logprobs is not compatible"):
        llm.generate(embeds, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        llama_llm.generate(embeds, SamplingParams(max_tokens=2), use_tqdm=False)


def test_with_lora_matches_the_merged_model(llama_dir, tmp_path):
    (path, merged) = make_adapters(llama_dir, tmp_path, names=("attn4",))["attn4"]
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.eval()
    embeds = embeds_of(model, prompt_ids(1, 19, seed=8)[0])
    llm = LLM(llama_dir, enable_lora=True, max_lora_rank=8, **ARGS)
    (out,) = llm.generate(
        {"prompt_embeds": embeds},
        SamplingParams(**GREEDY),
        lora_request=LoRARequest("attn4", 1, path),
        use_tqdm=False,
    )
    tokens, logprobs = hf_from_embeds(model, embeds, 8)
    gen = out.outputs[0]
    assert gen.token_ids == tokens
    got = [gen.logprobs[i][t].logprob for i, t in enumerate(tokens)]
    np.testing.assert_allclose(got, logprobs, atol=2e-3)  # the LoRA tests' tolerance


def test_with_ngram_speculation_the_tokens_are_the_same(llama_dir, llm, hf):
    spec = LLM(
        llama_dir,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **ARGS,
    )
    ids = prompt_ids(1, 6, seed=10)[0] * 4  # repeats: the n-gram proposer has drafts
    prompts = [{"prompt_embeds": embeds_of(hf, ids, noise=0.0)}, {"prompt_token_ids": ids}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for got, want in zip(
        spec.generate(prompts, params, use_tqdm=False),
        llm.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_what_it_does_not_run_with_is_refused_at_start(llama_dir):
    from jllm.config import EngineArgs
    from jllm.engine.llm_engine import check_prompt_embeds

    args = EngineArgs(model=llama_dir, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="image inputs"):
        check_prompt_embeds(args, vision=object(), draft=None)
    with pytest.raises(ValueError, match="draft model"):
        check_prompt_embeds(args, vision=None, draft=object())
    check_prompt_embeds(EngineArgs(model=llama_dir), vision=object(), draft=object())

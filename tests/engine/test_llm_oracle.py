"""LLM.generate against transformers: greedy tokens and logprobs on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from oracle import SMALL, hf_greedy, prompt_ids, teacher_forced_logprobs

from jllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen2-yarn", "llama3-untied", "qwen3", "llama-bias"]
)
def test_greedy_matches_transformers(tiny_models, arch):
    prompts = prompt_ids(4, 5) + prompt_ids(1, 40, seed=1)
    llm = LLM(tiny_models[arch], **SMALL)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    expected = hf_greedy(tiny_models[arch], prompts, 12)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_match_transformers(tiny_models, llama_llm, arch):
    """The full log-softmax of each step (top 5 and their values) against transformers."""
    prompt = prompt_ids(1, 21, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    llm = llama_llm if arch == "llama" else LLM(tiny_models[arch], **SMALL)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[arch]).eval()
    ref = teacher_forced_logprobs(model, prompt, out.token_ids)  # [6, V]
    cumulative = 0.0
    for step, entry in enumerate(out.logprobs):
        token = out.token_ids[step]
        assert token in entry and entry[token].rank == 1  # greedy: the top token
        top_vals, top_ids = torch.topk(ref[step], 5)
        assert set(entry) == set(top_ids.tolist())
        for tid, lp in entry.items():
            np.testing.assert_allclose(lp.logprob, ref[step, tid].item(), atol=2e-4)
        assert [entry[t].rank for t in top_ids.tolist()] == [1, 2, 3, 4, 5]
        cumulative += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-5)


def test_logprobs_minus_one_is_the_whole_vocabulary(llama_dir, llama_llm, all_logprobs_llm):
    """vLLM's rule: -1 asks for every token, allowed only when max_logprobs is -1."""
    prompt = {"prompt_token_ids": prompt_ids(1, 10, seed=5)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=-1)
    with pytest.raises(ValueError, match="which is greater than max allowed: 20"):
        llama_llm.generate(prompt, params, use_tqdm=False)
    out = all_logprobs_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ref = teacher_forced_logprobs(model, prompt["prompt_token_ids"], out.token_ids)
    for step, entry in enumerate(out.logprobs):
        assert len(entry) == ref.shape[1]
        got = np.array([entry[t].logprob for t in range(ref.shape[1])])
        np.testing.assert_allclose(got, ref[step].numpy(), atol=2e-4)
        assert entry[out.token_ids[step]].rank == 1

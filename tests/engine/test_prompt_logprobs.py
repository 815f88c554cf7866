"""`prompt_logprobs` against transformers' log-softmax over the prompt, with chunked
prefill (the scheduler also caps a step's prompt-logprob tokens at PROMPT_LOGPROB_ROWS), a
prefix-cache hit that must not make them disappear, n > 1, 0 and -1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row t is the distribution of prompt token t + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1]


def check(entries, prompt, ref, k):
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry, row, target = entries[pos], ref[pos - 1], prompt[pos]
        top = torch.topk(row, k).indices.tolist() if k else []
        assert list(entry)[0] == target  # the prompt token first, then the top-k
        assert set(entry) == {target, *top}
        for tid, lp in entry.items():
            np.testing.assert_allclose(lp.logprob, row[tid].item(), atol=2e-4)
        # The rank among V float32 logprobs, within the tolerance the values have.
        lo, hi = (int((row > row[target] + d).sum()) + 1 for d in (2e-4, -2e-4))
        assert lo <= entry[target].rank <= hi
        assert [entry[t].rank for t in top if t != target] == [
            r + 1 for r, t in enumerate(top) if t != target
        ]


def test_prompt_logprobs_match_transformers(llama_llm, hf_model):
    prompt = prompt_ids(1, 40, seed=50)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    out = llama_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    check(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model, prompt), 3)
    # A second request with the same prompt would hit the prefix cache: prompt logprobs are
    # still computed for the whole prompt (vLLM skips the cache read for them).
    again = llama_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert again.prompt_logprobs == out.prompt_logprobs
    # 0: the prompt token alone; n = 2: both sequences share them.
    zero = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=2, prompt_logprobs=0)
    out0 = llama_llm.generate({"prompt_token_ids": prompt}, zero, use_tqdm=False)[0]
    assert [list(e) for e in out0.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    assert len(out0.outputs) == 2


def test_chunked_and_capped(llama_dir, hf_model):
    """Chunks of 32 tokens, and a prompt longer than a step's prompt-logprob rows; two such
    requests side by side."""
    llm = LLM(llama_dir, **{**SMALL, "max_num_batched_tokens": 32})
    long = prompt_ids(1, PROMPT_LOGPROB_ROWS + 60, seed=51)[0]
    short = prompt_ids(1, 50, seed=52)[0]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in (long, short)], params, use_tqdm=False)
    for out, prompt in zip(outs, (long, short), strict=True):
        check(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model, prompt), 2)
    big = LLM(llama_dir, **{**SMALL, "max_num_batched_tokens": 512})
    out = big.generate({"prompt_token_ids": long}, params, use_tqdm=False)[0]
    check(out.prompt_logprobs, long, hf_prompt_logprobs(hf_model, long), 2)


def test_prompt_logprobs_limits(llama_llm, all_logprobs_llm, hf_model):
    prompt = prompt_ids(1, 6, seed=53)[0]
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21"):
        llama_llm.generate({"prompt_token_ids": prompt}, SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match="non-negative or -1"):
        SamplingParams(prompt_logprobs=-2)
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    out = all_logprobs_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    ref = hf_prompt_logprobs(hf_model, prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert len(entry) == ref.shape[1]
        got = np.array([entry[t].logprob for t in range(ref.shape[1])])
        np.testing.assert_allclose(got, ref[pos - 1].numpy(), atol=2e-4)

"""`logprobs_mode` against a torch computation of the same step, and the sampled tokens'
logprobs as a trainer needs them: equal to transformers' teacher-forced forward (1e-4) and
to jllm's own `prompt_logprobs` of the same sequence (1e-5), float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import SMALL, eager, prompt_ids

from jllm import LLM, SamplingParams

PROMPT = prompt_ids(1, 12, seed=5)[0]
PARAMS = dict(temperature=0.8, top_k=12, repetition_penalty=1.3, max_tokens=6, seed=7)
TOP = 5


def _expected(model, mode: str, tokens: list[int]) -> torch.Tensor:
    """[n, V] what `mode` reports at each generated position: vLLM's processing of the
    teacher-forced logits (repetition penalty over prompt and output so far, temperature,
    top-k at -inf)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].double()
    rows = []
    for i in range(len(tokens)):
        x = logits[len(PROMPT) - 1 + i].clone()
        if mode.startswith("processed"):
            seen = torch.tensor(sorted(set(PROMPT + tokens[:i])))
            v = x[seen]
            x[seen] = torch.where(
                v > 0, v / PARAMS["repetition_penalty"], v * PARAMS["repetition_penalty"]
            )
            x = x / PARAMS["temperature"]
            kth = torch.topk(x, PARAMS["top_k"]).values[-1]
            x = torch.where(x >= kth, x, torch.tensor(-torch.inf, dtype=x.dtype))
        rows.append(torch.log_softmax(x, -1) if mode.endswith("logprobs") else x)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_logprobs_mode_reports_what_vllm_does(llama_dir, mode):
    llm = LLM(llama_dir, **SMALL, dtype="float32", logprobs_mode=mode)
    params = SamplingParams(**PARAMS, logprobs=TOP)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    want = _expected(eager(llama_dir), mode, tokens)
    for i, (token, entries) in enumerate(zip(tokens, out.logprobs, strict=True)):
        np.testing.assert_allclose(entries[token].logprob, want[i, token].item(), atol=1e-4)
        top = sorted((e for t, e in entries.items() if e.rank <= TOP), key=lambda e: e.rank)
        finite = want[i][torch.isfinite(want[i])]
        ref = torch.sort(finite, descending=True).values[:TOP]
        np.testing.assert_allclose([e.logprob for e in top], ref.numpy(), atol=1e-4)


def test_sampled_logprobs_equal_the_teacher_forced_forward_and_prompt_logprobs(llama_dir):
    llm = LLM(llama_dir, **SMALL, dtype="float32")
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, logprobs=0)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    sampled = np.array([d[t].logprob for d, t in zip(out.logprobs, tokens, strict=True)])
    trainer = _expected(eager(llama_dir), "raw_logprobs", tokens)
    np.testing.assert_allclose(
        sampled, [trainer[i, t].item() for i, t in enumerate(tokens)], atol=1e-4
    )
    again = SamplingParams(max_tokens=1, prompt_logprobs=0)
    full = llm.generate({"prompt_token_ids": PROMPT + tokens}, again, use_tqdm=False)[0]
    scored = [full.prompt_logprobs[len(PROMPT) + i][t].logprob for i, t in enumerate(tokens)]
    np.testing.assert_allclose(sampled, scored, atol=1e-5)

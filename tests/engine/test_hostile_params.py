"""Sampling parameters at their extremes reach the engine's int32 rows only bounded, and a
request whose admission still fails fails alone: the engine and its neighbours go on."""

from __future__ import annotations

import math

import pytest
from oracle import SMALL, generate, prompt_ids, same_outputs

from jllm import LLM, SamplingParams
from jllm.config.limits import MAX_N_SEQUENCES
from jllm.runner.input_batch import InputBatch


def sampled(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, **fields)


def test_top_k_past_int32_keeps_every_token(llama_llm):
    prompts = prompt_ids(2, 9, seed=3)
    for top_k in (2**31, 2**63):
        got = generate(llama_llm, prompts, sampled(top_k=top_k))
        want = generate(llama_llm, prompts, sampled(top_k=0))
        same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in want])


def test_min_tokens_past_the_context(llama_llm):
    max_len = llama_llm.llm_engine.max_model_len
    prompt = prompt_ids(1, 9)[0]
    # Unset max_tokens leaves the context's room, and min_tokens must fit it (vLLM's check).
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens"):
        generate(llama_llm, [prompt], SamplingParams(max_tokens=None, min_tokens=2**31))
    # With a larger max_tokens the request runs to the end of the context.
    params = SamplingParams(temperature=0, max_tokens=2**40, min_tokens=2**31)
    (out,) = generate(llama_llm, [prompt], params)
    assert len(out.outputs[0].token_ids) == max_len - len(prompt)
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n": MAX_N_SEQUENCES + 1}, "VLLM_MAX_N_SEQUENCES"),
        ({"n": 2.0}, "n must be an int"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"repetition_penalty": math.nan}, "repetition_penalty must be a finite number"),
        ({"min_tokens": 1.0}, "min_tokens must be an integer"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_sampling_params_refuse_unbounded_values(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_a_failed_admission_fails_only_its_request(llama_llm, monkeypatch):
    """A row that cannot be written (here: any row with top_p 0.5) fails its request with
    finish reason "error"; the requests admitted with it give their usual outputs and the
    engine serves the next request."""
    prompts = prompt_ids(3, 11, seed=5)
    want = generate(llama_llm, prompts)
    batch = llama_llm.llm_engine.runner.batch
    original = InputBatch.add

    def add(new):
        if new.sampling_params.top_p == 0.5:
            raise OverflowError("Python int too large to convert to C int")
        return original(batch, new)

    monkeypatch.setattr(batch, "add", add)
    bad = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=8, ignore_eos=True)
    good = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llama_llm.generate(
        [{"prompt_token_ids": p} for p in [prompts[0], prompts[1], prompts[1], prompts[2]]],
        [good, bad, good, good],
        use_tqdm=False,
    )
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "error"
    same_outputs([outs[i].outputs[0] for i in (0, 2, 3)], [o.outputs[0] for o in want])
    monkeypatch.undo()
    same_outputs([o.outputs[0] for o in generate(llama_llm, prompts)], [o.outputs[0] for o in want])


def test_max_logprobs_past_the_vocabulary_is_a_cap(llama_dir):
    """vLLM treats --max-logprobs as a cap: a value past the vocabulary is the vocabulary
    (it used to fail the sampler's compile on the first request)."""
    llm = LLM(llama_dir, max_logprobs=10**6, **SMALL)
    vocab = llm.llm_engine.model_config.vocab_size
    assert llm.llm_engine.args.max_logprobs == vocab
    (out,) = generate(
        llm, prompt_ids(1, 7), SamplingParams(temperature=0, max_tokens=2, logprobs=vocab)
    )
    assert all(len(entry) == vocab for entry in out.outputs[0].logprobs)

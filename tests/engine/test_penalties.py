"""Penalties end to end against transformers, with prefix-cache hits, chunked prefill and
preemption: the penalty state is written at admission, so none of them changes the output.

The oracle is transformers' greedy generation on the same weights with a logits processor
that applies vLLM's penalties: repetition over prompt and output tokens (transformers' own
rule), presence and frequency over output tokens only."""

from __future__ import annotations

import pytest
import torch
import transformers
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams

SHARED = prompt_ids(1, 48, seed=21)[0]
# Each prompt's last block fills up during generation: with few blocks, decodes preempt.
PROMPTS = [SHARED + [5, 6, 7, 8, 9, 10], SHARED + list(range(40, 50)), prompt_ids(1, 28, 22)[0]]
# Below-one repetition and negative presence/frequency penalties pull the greedy choice
# back to seen tokens, so on a tiny random model (which rarely repeats) they change the
# output; the prompt's tokens matter for repetition, the output's for the others.
PENALTIES = [
    {"repetition_penalty": 0.3},
    {"presence_penalty": -2.0},
    {"frequency_penalty": -2.0, "repetition_penalty": 0.6},
]
MAX_TOKENS = 12


class VllmPenalties(transformers.LogitsProcessor):
    def __init__(self, prompt_len: int, presence=0.0, frequency=0.0, repetition=1.0):
        self.prompt_len = prompt_len
        self.presence, self.frequency, self.repetition = presence, frequency, repetition

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        seen = torch.zeros_like(scores, dtype=torch.bool)
        seen[0, input_ids[0]] = True
        rep = torch.where(scores > 0, scores / self.repetition, scores * self.repetition)
        scores = torch.where(seen, rep, scores)
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
        scores -= self.frequency * counts[None].to(scores.dtype)
        return scores - self.presence * (counts[None] > 0).to(scores.dtype)


def hf_penalised(model_dir, prompt, penalty) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    proc = VllmPenalties(
        len(prompt),
        presence=penalty.get("presence_penalty", 0.0),
        frequency=penalty.get("frequency_penalty", 0.0),
        repetition=penalty.get("repetition_penalty", 1.0),
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([proc]),
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def params(penalty) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **penalty)


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return {
        (i, j): hf_penalised(llama_dir, p, pen)
        for i, p in enumerate(PROMPTS)
        for j, pen in enumerate(PENALTIES)
    }


def generate(llm, pairs):
    prompts = [{"prompt_token_ids": PROMPTS[i]} for i, _ in pairs]
    outs = llm.generate(prompts, [params(PENALTIES[j]) for _, j in pairs], use_tqdm=False)
    return outs


PAIRS = [(i, j) for i in range(len(PROMPTS)) for j in range(len(PENALTIES))]


def test_oracle_penalties_change_the_output(llama_llm, oracle):
    """Guards the comparison below: each penalty changes some prompt's greedy output."""
    plain = llama_llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    for j, penalty in enumerate(PENALTIES):
        changed = [oracle[i, j] != plain[i].outputs[0].token_ids for i in range(len(PROMPTS))]
        assert any(changed), penalty


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16, "max_num_seqs": 4},
        {"num_gpu_blocks_override": 7},
    ],
    ids=["prefix-cache", "no-prefix-cache", "budget-16", "preemption"],
)
def test_penalties_match_transformers(llama_dir, oracle, engine):
    llm = LLM(llama_dir, **{**SMALL, **engine})
    first = generate(llm, PAIRS)
    assert [o.outputs[0].token_ids for o in first] == [oracle[p] for p in PAIRS]
    # Again, one by one: every request now hits the prefix cache (when it is on).
    again = [generate(llm, [p])[0] for p in PAIRS]
    assert [o.outputs[0].token_ids for o in again] == [oracle[p] for p in PAIRS]
    if engine.get("enable_prefix_caching", True) and "num_gpu_blocks_override" not in engine:
        assert all(o.num_cached_tokens >= 16 for o in again)
    if "num_gpu_blocks_override" in engine:
        assert llm.llm_engine.scheduler.num_preemptions > 0

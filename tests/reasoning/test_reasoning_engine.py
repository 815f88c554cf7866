"""The grammar gate in the engine (`reasoning_parser`): the scripted reasoning model
(conftest.THINKER_SCRIPT) thinks freely and its grammar holds after `</think>`, in every
step shape that moves a sequence's tokens around: a batch, chunked prefill, preemption
(recompute), n-gram drafts (rolled back over the end tag when refused), async scheduling,
and a prefix-cache rerun."""

from __future__ import annotations

import pytest
from oracle import SMALL

from jllm import LLM, SamplingParams
from jllm.sampling_params import StructuredOutputsParams

THOUGHT = "<think>Let me see.</think>"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# Prompts of 44 tokens: with the answer they grow past their third block (preemption).
QUESTIONS = [f"Question {i}: is the number {i} even, yes or no?" for i in range(8)]


def chat_prompts(llm) -> list[str]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"max_num_batched_tokens": 32, "max_num_seqs": 4},
        {"num_gpu_blocks_override": 12},
        {"speculative_config": NGRAM},
        {"async_scheduling": True},
    ],
    ids=["batch", "chunked", "preempting", "ngram", "async"],
)
def test_the_grammar_waits_for_the_reasoning(thinker_dir, extra):
    llm = LLM(thinker_dir, reasoning_parser="deepseek_r1", **{**SMALL, **extra})
    prompts = chat_prompts(llm)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"] if i % 2 else None)
            if i % 2
            else StructuredOutputsParams(regex="(red|blue)"),
        )
        for i in range(len(prompts))
    ]
    for _ in range(2):  # the second pass reads the prompts from the prefix cache
        outs = llm.generate(prompts, params)
        for i, out in enumerate(outs):
            text = out.outputs[0].text
            assert text.startswith(THOUGHT), text
            answer = text.removeprefix(THOUGHT)
            assert answer in (("yes", "no") if i % 2 else ("red", "blue")), text
    if "num_gpu_blocks_override" in extra:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_vocabulary_without_the_tags_is_refused(llama_dir):
    with pytest.raises(ValueError, match="needs the tokens"):
        LLM(llama_dir, reasoning_parser="deepseek_r1", **SMALL)
    with pytest.raises(ValueError, match="invalid reasoning parser"):
        LLM(llama_dir, reasoning_parser="nope", **SMALL)

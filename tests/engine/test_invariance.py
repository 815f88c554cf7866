"""A prompt's greedy output does not depend on how the engine batched, chunked, cached or
preempted it. The reference is the same prompt run alone on a default engine."""

from __future__ import annotations

import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    shared = prompt_ids(1, 40, seed=7)[0]
    # Mixed lengths, two prompts sharing a 40-token prefix (prefix-cache hits).
    return prompt_ids(5, 3, seed=5) + [shared + [11, 12, 13], shared + [21, 22], shared]


@pytest.fixture(scope="module")
def alone(llama_llm, prompts):
    return [_run(llama_llm, [p])[0] for p in prompts]


def test_batch_equals_alone(llama_llm, prompts, alone):
    assert _run(llama_llm, prompts) == alone
    assert _run(llama_llm, prompts[::-1]) == alone[::-1]


def test_prefix_caching_hits_and_matches(llama_dir, prompts, alone):
    llm = LLM(llama_dir, **SMALL)
    assert _run(llm, prompts) == alone
    kv = llm.llm_engine.scheduler.kv_cache
    hits_before = kv.prefix_hits
    assert _run(llm, prompts) == alone  # the whole batch again: every full block is cached
    assert kv.prefix_hits - hits_before >= sum(len(p) // 16 * 16 for p in prompts) - 16 * 2


def test_without_prefix_caching(llama_dir, prompts, alone):
    llm = LLM(llama_dir, **{**SMALL, "enable_prefix_caching": False})
    assert _run(llm, prompts) == alone
    assert llm.llm_engine.scheduler.kv_cache.prefix_hits == 0


def test_chunked_prefill_small_budget(llama_dir, prompts, alone):
    llm = LLM(llama_dir, **{**SMALL, "max_num_batched_tokens": 16, "max_num_seqs": 4})
    assert _run(llm, prompts) == alone


def test_preemption_by_recompute(llama_dir, prompts, alone, caplog):
    # 12 blocks of 16 slots: far fewer than the batch needs at once.
    llm = LLM(llama_dir, **{**SMALL, "num_gpu_blocks_override": 12})
    with caplog.at_level("WARNING"):
        assert _run(llm, prompts) == alone
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert "is preempted by PreemptionMode.RECOMPUTE mode" in caplog.text
    assert "total_num_cumulative_preemption=" in caplog.text
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks - 1  # everything given back


def test_block_size_32(llama_dir, prompts, alone):
    llm = LLM(llama_dir, **{**SMALL, "block_size": 32})
    assert _run(llm, prompts) == alone

"""The host-memory KV tier (`kv_offloading_size`): blocks evicted from a small device pool
come back from host memory on a prefix hit, with the outputs of a run that computed them
(greedy tokens and logprobs), isolated by the same keys as on the device."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from oracle import prometheus_value, prompt_ids, with_metrics

from jllm import LLM, SamplingParams
from jllm.engine.host_kv_tier import HostKVTier

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
# 40 device blocks of 16 tokens; six prompts of 160-195 tokens need 66.
SMALL_POOL = dict(
    dtype="float32",
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    num_gpu_blocks_override=40,
)
PROMPTS = prompt_ids(6, 160, seed=1)


def requests(prompts, salt=None):
    extra = {} if salt is None else {"cache_salt": salt}
    return [{"prompt_token_ids": p, **extra} for p in prompts]


def outputs(outs):
    return [
        (
            o.outputs[0].token_ids,
            [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def assert_same(got, expected):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs(got), outputs(expected), strict=True):
        assert tokens == ref_tokens
        np.testing.assert_allclose(lps, ref_lps, atol=1e-5)


@pytest.fixture(scope="module")
def tiered(llama_dir):
    return LLM(llama_dir, kv_offloading_size=0.05, **SMALL_POOL)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(llama_dir, **SMALL_POOL)


def test_host_tier_lru_and_arrivals():
    tier = HostKVTier(2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert tier.store(a) is not None and tier.store(a) is None  # held already
    assert tier.lookup([a]) == []  # its data arrives with the next step
    tier.step_scheduled()
    assert tier.lookup([a, b]) == [tier.cached[a]]
    tier.store(b)
    tier.step_scheduled()
    tier.touch([a])  # a is now the most recent: c evicts b
    tier.store(c)
    tier.step_scheduled()
    assert b not in tier.cached and tier.lookup([a, c]) == [tier.cached[a], tier.cached[c]]
    assert tier.usage == 1.0 and tier.stores == 3


def test_evicted_prefixes_come_back_from_host(tiered, plain):
    """Six prompts that overflow the device pool, run twice: the second run finds blocks in
    host memory (cached tokens), and answers as the first and as an engine without the tier,
    which finds nothing."""
    prom = with_metrics(tiered)
    first = tiered.generate(requests(PROMPTS), PARAMS, use_tqdm=False)
    second = tiered.generate(requests(PROMPTS), PARAMS, use_tqdm=False)
    without = [plain.generate(requests(PROMPTS), PARAMS, use_tqdm=False) for _ in range(2)]
    host = tiered.llm_engine.scheduler.kv_cache.host
    assert host.loads > 0 and host.hits > 0
    block_bytes = host.block_bytes
    assert prometheus_value(prom, "vllm:external_prefix_cache_hits_total") == host.hits
    assert prometheus_value(prom, "vllm:external_prefix_cache_queries_total") == host.queries
    assert prometheus_value(prom, "vllm:kv_offload_load_bytes_total") == host.loads * block_bytes
    assert prometheus_value(prom, "vllm:kv_offload_store_bytes_total") == host.stores * block_bytes
    assert 0 < prometheus_value(prom, "jllm:kv_offload_host_usage_perc") <= 1
    assert sum(o.num_cached_tokens for o in second) > 0
    assert all(o.num_cached_tokens == 0 for o in without[1])
    assert_same(second, first)
    assert_same(second, without[0])
    kv = tiered.llm_engine.scheduler.kv_cache
    assert kv.all_blocks_free and not kv.kv_stores and not kv.kv_loads


def test_salts_never_share_host_blocks(tiered):
    tiered.reset_prefix_cache()
    prompts = prompt_ids(6, 160, seed=2)
    tiered.generate(requests(prompts, "tenant-a"), PARAMS, use_tqdm=False)
    other = tiered.generate(requests(prompts, "tenant-b"), PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in other)
    tiered.generate(requests(prompt_ids(6, 160, seed=3)), PARAMS, use_tqdm=False)  # evicts b
    same = tiered.generate(requests(prompts, "tenant-a"), PARAMS, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in same) > 0


def count_computed(llm):
    """Wrap the scheduler to count the tokens every step computes."""
    scheduler = llm.llm_engine.scheduler
    schedule, total = scheduler.schedule, [0]

    def counted():
        out = schedule()
        total[0] += out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counted
    return total


def test_preemption_resumes_from_host(llama_dir, tiered, plain):
    """Eight long requests on 40 device blocks preempt each other; with the tier a preempted
    request reloads its blocks instead of recomputing them: fewer tokens computed, the
    outputs of an engine with room for all."""
    prompts = prompt_ids(8, 120, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    roomy = LLM(llama_dir, **{**SMALL_POOL, "num_gpu_blocks_override": 400})
    expected = roomy.generate(requests(prompts), params, use_tqdm=False)
    counts = []
    for llm in (plain, tiered):
        llm.reset_prefix_cache()
        before = llm.llm_engine.scheduler.num_preemptions
        computed = count_computed(llm)
        got = llm.generate(requests(prompts), params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > before
        assert_same(got, expected)
        counts.append(computed[0])
        del llm.llm_engine.scheduler.schedule
    assert counts[1] < counts[0]


def test_tensor_parallel(llama_dir, plain):
    llm = LLM(llama_dir, kv_offloading_size=0.05, tensor_parallel_size=2, **SMALL_POOL)
    llm.generate(requests(PROMPTS), PARAMS, use_tqdm=False)
    second = llm.generate(requests(PROMPTS), PARAMS, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in second) > 0
    assert_same(second, plain.generate(requests(PROMPTS), PARAMS, use_tqdm=False))


def test_bad_sizes_and_backends(llama_dir, tiny_models, caplog):
    with pytest.raises(ValueError, match="available memory"):
        LLM(llama_dir, kv_offloading_size=1 << 20, **SMALL_POOL)
    with pytest.raises(ValueError, match="'native'"):
        LLM(llama_dir, kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="one\nKV-cache group|one KV-cache group"):
        LLM(tiny_models["gemma3"], kv_offloading_size=0.01, **SMALL_POOL)
    with caplog.at_level(logging.WARNING, logger="jllm"):
        llm = LLM(llama_dir, swap_space=0.01, **SMALL_POOL)
    assert "kv_offloading_size" in caplog.text
    assert llm.llm_engine.scheduler.kv_cache.host is not None
    off = LLM(llama_dir, kv_offloading_size=0, **SMALL_POOL)
    assert off.llm_engine.scheduler.kv_cache.host is None

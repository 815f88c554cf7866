"""Speculative decoding with n-gram prompt lookup: vLLM's lookup rule against a brute-force
reference, vLLM's `speculative_config` validation, and the engine with speculation against
the engine without it (the oracle): greedy, seeded-sampled, penalized and logprob requests
give the same tokens and logprobs (seeded draws are exact, so the output distribution is
the target model's), beside requests that find no n-gram, under chunked prefill, prefix
caching, preemption and TP = 2; vLLM's metrics count what was drafted and accepted.

Two tiny models: the random one, whose output ignores its prompt (drafts are rejected: the
resampling path), and a "copier" made from it that mostly repeats its last token (drafts
are accepted, and sampled rows at temperature 1 take it about two times in three: both
paths)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import (
    SMALL,
    SPEC_SETTING_IDS,
    SPEC_SETTINGS,
    prometheus_value,
    prompt_ids,
    spec_counts,
    with_metrics,
)
from oracle import same_outputs as same

from jllm import LLM, SamplingParams
from jllm.engine.platform import resolve_async_scheduling
from jllm.metrics.stats import SchedulerStats
from jllm.runner.compile_guard import count_compiles
from jllm.spec_decode import SpeculativeConfig, ngram_lookup

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def reference_lookup(tokens, min_n, max_n, k):
    """Brute force: the longest suffix of min_n..max_n tokens found earlier (ending before
    the last token), at its earliest occurrence; the k tokens after it."""
    n = len(tokens)
    for length in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - length :]
        for i in range(0, n - length):
            if tokens[i : i + length] == suffix:
                return tokens[i + length : i + length + k]
    return []


def test_lookup_follows_vllm_examples():
    def f(t, lo, hi, k):
        return ngram_lookup(np.array(t), lo, hi, k)

    assert f([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3, 2) == [9, 1]  # earliest occurrence
    assert f([1, 2, 3, 4, 1, 2], 2, 2, 5) == [3, 4, 1, 2]  # fewer than k near the end
    assert f([1, 1, 1, 1], 2, 2, 5) == [1, 1]  # the occurrence may overlap the suffix
    assert f([1, 2, 3], 2, 2, 3) == []  # no match, no drafts
    assert f([5, 6, 7, 5, 6], 3, 4, 2) == []  # only a 2-token match, min 3


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=30),
    lo=st.integers(1, 4),
    span=st.integers(0, 3),
    k=st.integers(1, 5),
)
def test_lookup_matches_brute_force(tokens, lo, span, k):
    assert ngram_lookup(np.array(tokens, np.int64), lo, lo + span, k) == reference_lookup(
        tokens, lo, lo + span, k
    )


def test_config_follows_vllm():
    c = SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.create(
        {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)
    bad = [
        ({"method": "ngram", "num_speculative_tokens": 0}, "greater than zero"),
        ({"method": "ngram"}, "greater than zero"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model' path"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown field"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be an integer >= 1",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            "prompt_lookup_min must be an integer >= 1",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "> 1"),
        ({"num_speculative_tokens": 2}, "needs a method"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.create(spec)
    with pytest.raises(ValueError, match="async_scheduling=True cannot"):
        resolve_async_scheduling(True, "cpu", speculative=True)
    assert resolve_async_scheduling(None, "gpu", speculative=True) is False


def repetitive_prompts():
    """Prompts that repeat themselves (their continuations are looked up) and random ones
    (no n-gram: those requests run without drafts in the same steps)."""
    base = prompt_ids(4, 6, seed=21)
    return [p + p + p[:3] for p in base] + prompt_ids(3, 9, seed=22)


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=13, ignore_eos=True),
    SamplingParams(
        temperature=0.0,
        max_tokens=21,
        ignore_eos=True,
        repetition_penalty=1.2,
        presence_penalty=0.3,
    ),
    SamplingParams(temperature=0.7, top_k=30, seed=3, max_tokens=17, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=22, ignore_eos=True),
]


def run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module", params=["random", "copier"])
def model(request, llama_dir, copier_dir):
    path = llama_dir if request.param == "random" else copier_dir
    return request.param, path, run(LLM(path, **SMALL), repetitive_prompts())


@pytest.mark.parametrize("settings", SPEC_SETTINGS, ids=SPEC_SETTING_IDS)
def test_outputs_equal_the_engine_without_speculation(model, settings):
    name, path, expected = model
    llm = LLM(path, **{**SMALL, "speculative_config": NGRAM, **settings})
    prom = with_metrics(llm)
    same(run(llm, repetitive_prompts()), expected)
    drafts, drafted, accepted = spec_counts(prom)
    assert drafts > 0 and drafted >= drafts and accepted <= drafted
    if name == "copier":  # most drafts accepted, not all (the sampled rows)
        assert 0.3 * drafted < accepted < drafted
        first = prometheus_value(
            prom, "vllm:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"'
        )
        assert 0 < first <= drafts
    if settings.get("num_gpu_blocks_override"):
        assert llm.llm_engine.scheduler.num_preemptions > 0
    # A second run hits the prefix cache (blocks of accepted tokens only) and is unchanged.
    if not settings:
        kv = llm.llm_engine.scheduler.kv_cache
        hits = kv.prefix_hits
        same(run(llm, repetitive_prompts()), expected)
        assert kv.prefix_hits > hits


def test_log_line_and_disable_by_batch_size(llama_dir, caplog):
    llm = LLM(llama_dir, **{**SMALL, "disable_log_stats": False, "speculative_config": NGRAM})
    (log,) = llm.llm_engine.core.stat_loggers
    prompt = {"prompt_token_ids": repetitive_prompts()[0]}
    with caplog.at_level(logging.INFO, logger="jllm"):
        llm.generate(prompt, PARAMS[0], use_tqdm=False)
        log.log(SchedulerStats.from_scheduler(llm.llm_engine.scheduler))
    assert "SpecDecoding metrics: Mean acceptance length: " in caplog.text
    assert "Per-position acceptance rate: " in caplog.text

    off = LLM(
        llama_dir,
        **{**SMALL, "speculative_config": {**NGRAM, "disable_by_batch_size": 2}},
    )
    prom = with_metrics(off)
    off.generate([prompt] * 3, PARAMS[0], use_tqdm=False)  # 3 requests > 2: no drafts
    assert prometheus_value(prom, "vllm:spec_decode_num_drafts_total") == 0
    off.generate(prompt, PARAMS[0], use_tqdm=False)  # alone: drafts
    assert prometheus_value(prom, "vllm:spec_decode_num_drafts_total") > 0


@pytest.mark.slow
def test_no_compile_after_warmup_with_speculation(copier_dir):
    llm = LLM(
        copier_dir,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        disable_log_stats=True,
        speculative_config=NGRAM,
    )
    prom = with_metrics(llm)
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()[:5]]
    with count_compiles() as events:
        llm.generate(prompts, PARAMS[:5], use_tqdm=False)
    assert events == []
    assert prometheus_value(prom, "vllm:spec_decode_num_accepted_tokens_total") > 0  # rows verified


def test_sampled_distribution_is_the_targets(copier_dir):
    """Chi-square: the second sampled token's distribution with speculation equals the target
    model's (its logprobs from the engine without speculation). The copier repeats its last
    token while the prompt's n-gram drafts another, so the draft mostly disagrees with the
    target: most draws go through rejection and resampling."""
    import scipy.stats

    prompt = repetitive_prompts()[0]
    llm = LLM(copier_dir, **{**SMALL, "speculative_config": NGRAM})
    n = 600
    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * n,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=2, ignore_eos=True) for s in range(n)],
        use_tqdm=False,
    )
    pairs = [tuple(o.outputs[0].token_ids) for o in outs]
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    second = [p[1] for p in pairs if p[0] == first]
    context = np.array(prompt + [first])
    draft = ngram_lookup(context, 1, 3, 3)[0]  # what the proposer drafts at that step
    assert draft != first  # the draft disagrees with the copier's favourite

    plain = LLM(copier_dir, **SMALL)
    top = (
        plain.generate(
            {"prompt_token_ids": prompt + [first]},
            SamplingParams(temperature=1.0, max_tokens=1, logprobs=20),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .logprobs[0]
    )
    p_first, p_draft = (float(np.exp(top[t].logprob)) if t in top else 0.0 for t in (first, draft))
    expected = np.array([p_first, p_draft, 1 - p_first - p_draft]) * len(second)
    observed = np.array(
        [second.count(first), second.count(draft), sum(t not in (first, draft) for t in second)]
    )
    assert observed[0] > 0.3 * len(second)  # the repeat is common: the test has power
    if expected[1] < 5:  # a rare draft joins "other": its draws must still be rare
        observed = np.array([observed[0], observed[1] + observed[2]])
        expected = np.array([expected[0], expected[1] + expected[2]])
    _, p_value = scipy.stats.chisquare(observed, expected)
    assert p_value > 1e-4, (observed, expected)


def test_proposer_buffers_follow_the_growing_sequence():
    """The proposer keeps each request's tokens in a buffer extended step by step; its
    drafts equal a fresh lookup over the whole sequence at every length."""
    from jllm.spec_decode import NgramProposer

    class Req:
        def __init__(self, tokens):
            self.all_token_ids = list(tokens)

        @property
        def num_tokens(self):
            return len(self.all_token_ids)

    config = SpeculativeConfig.create(NGRAM)
    proposer = NgramProposer(config)
    rng = np.random.default_rng(0)
    req = Req(rng.integers(0, 4, 10))
    for _ in range(200):  # past the buffer's first capacities
        got = proposer.propose(req)
        tokens = np.array(req.all_token_ids)
        assert got == ngram_lookup(tokens, 1, 3, 3) == reference_lookup(list(tokens), 1, 3, 3)
        req.all_token_ids += rng.integers(0, 4, int(rng.integers(1, 4))).tolist()

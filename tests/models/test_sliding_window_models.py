"""Gemma 2, Gemma 3, Phi-3, and Mistral and Qwen2 with their sliding windows, against
transformers (eager attention, float32) on tiny random models whose windows (24 tokens) are
shorter than the prompts: greedy tokens equal and logprobs within 1e-4, alone, with chunked
prefill, prefix-cache hits, preemption and tensor parallelism; and a long generation that
fits a pool a few blocks wide because the sliding layers free what left their window."""

from __future__ import annotations

import pytest
from oracle import SMALL, assert_matches, eager, generate, oracle_tokens, prompt_ids

from jllm import LLM, SamplingParams

WINDOWED = ["mistral-window", "qwen2-window", "gemma2", "gemma3", "phi3"]
# Past Phi-3's original 64 positions, so that transformers rotates with LongRoPE's long
# factors, as the engine does at its default max_model_len (512).
PROMPTS = prompt_ids(2, 66) + prompt_ids(1, 90, seed=1)


@pytest.mark.parametrize("arch", WINDOWED)
def test_windowed_families_match_transformers(tiny_models, arch):
    """Alone and then again with the prompts' prefixes cached."""
    llm = LLM(tiny_models[arch], **SMALL)
    model = eager(tiny_models[arch])
    assert_matches(model, PROMPTS, generate(llm, PROMPTS))
    again = [p[:50] + q[50:] for p, q in zip(PROMPTS, prompt_ids(3, 66, seed=7), strict=False)]
    outs = generate(llm, again)
    assert all(o.num_cached_tokens >= 48 for o in outs)  # the first 3 blocks were hits
    assert_matches(model, again, outs)


def test_the_window_matters(tiny_models):
    """Without its window transformers' answer changes: the tests above would see a model
    that ignored it."""
    prompts = PROMPTS[:2]
    windowed = oracle_tokens(eager(tiny_models["mistral-window"]), prompts, 8)
    full = oracle_tokens(eager(tiny_models["mistral-window"], sliding_window=None), prompts, 8)
    assert windowed != full


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 16, "enable_prefix_caching": False},  # chunked prefill
        {"num_gpu_blocks_override": 12},  # preemption
        {"tensor_parallel_size": 2},
    ],
    ids=["chunked", "preempting", "tp2"],
)
@pytest.mark.parametrize("arch", ["gemma3", "mistral-window"])
def test_windows_under_chunking_preemption_and_tp(tiny_models, arch, settings):
    llm = LLM(tiny_models[arch], **{**SMALL, **settings})
    prompts = PROMPTS + prompt_ids(3, 30, seed=4)
    assert_matches(eager(tiny_models[arch]), prompts, generate(llm, prompts))


def test_phi3_short_factors_below_the_original_length(tiny_models):
    """With max_model_len at Phi-3's original 64 positions, LongRoPE's short factors, as
    transformers uses for sequences that short."""
    llm = LLM(tiny_models["phi3"], **{**SMALL, "max_model_len": 64})
    prompts = prompt_ids(2, 40, seed=2)
    assert_matches(eager(tiny_models["phi3"]), prompts, generate(llm, prompts))


def test_disable_sliding_window_caps_max_model_len(tiny_models):
    """vLLM's rule: full attention everywhere, and no sequence longer than the window (where
    full attention and the window agree)."""
    llm = LLM(tiny_models["gemma2"], **{**SMALL, "disable_sliding_window": True})
    assert llm.llm_engine.max_model_len == 24
    prompts = prompt_ids(2, 8, seed=5)  # 8 and 15 tokens: with 8 more, inside the window
    assert_matches(eager(tiny_models["gemma2"]), prompts, generate(llm, prompts))
    with pytest.raises(ValueError, match="sliding_window, with disable_sliding_window=24"):
        LLM(tiny_models["gemma2"], **{**SMALL, "disable_sliding_window": True, "max_model_len": 32})


def test_a_long_generation_fits_a_pool_of_eight_blocks(tiny_models):
    """40 + 400 tokens need 28 blocks of 16 at full attention; every layer of this model
    slides over 24 tokens, so it holds at most 3 blocks at a time and finishes in 8 with the
    oracle's tokens."""
    settings = {**SMALL, "num_gpu_blocks_override": 8, "max_num_batched_tokens": 64}
    llm = LLM(tiny_models["mistral-window"], **settings)
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.group_num_blocks == (8,) and [s.sliding_window for s in kv.specs] == [24]
    prompt = prompt_ids(1, 40, seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    out = generate(llm, [prompt], params)[0].outputs[0]
    model = eager(tiny_models["mistral-window"])
    assert out.token_ids == oracle_tokens(model, [prompt], 400)[0]
    assert kv.all_blocks_free


def test_mixed_model_pools_and_what_a_request_holds(tiny_models):
    """Gemma 3's sliding group gets a pool capped at what max_num_seqs requests can hold in
    its window, and the memory it leaves goes to the global layers' group. A request of 200
    tokens holds its whole context in the global group and, in the sliding one, only the
    blocks its 24-token window still sees (the rest are the null block)."""
    llm = LLM(tiny_models["gemma3"], **SMALL)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache
    assert [getattr(s, "sliding_window", None) for s in kv.specs] == [24, None]
    sliding, full = kv.group_num_blocks
    assert sliding < full
    prompt = {"prompt_token_ids": prompt_ids(1, 200, seed=8)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("long", *engine.prepare(prompt, params))
    for _ in range(20):  # the prompt in 256-token steps, then decodes
        engine.step()
    local, full_blocks = kv.block_ids("long")
    live = [b for b in local if b != 0]
    assert len(full_blocks) == len(local) >= 14  # 200 + 19 tokens, 16 a block
    assert 0 not in full_blocks and 2 <= len(live) <= 3  # 24 keys straddle 2 or 3 blocks
    assert local[-len(live) :] == live  # the live ones are the last
    expected = max(len(live) / (sliding - 1), len(full_blocks) / (full - 1))
    assert kv.usage == pytest.approx(expected)
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.all_blocks_free


def test_gemma2_groups_share_one_pool(tiny_models):
    """Gemma 2's sliding and full layers (2 each, identical arrays) share one pool and one
    cache array. 40 + 200 tokens need 15 blocks of 16 at full attention and up to 3 in the
    24-token window: a pool of 18 usable blocks runs it to the oracle's tokens because the
    blocks the window lets go serve the full-attention layers (two pools would need 15 and
    3 blocks of their own, and a cap for the window)."""
    settings = {**SMALL, "num_gpu_blocks_override": 19, "max_num_batched_tokens": 64}
    llm = LLM(tiny_models["gemma2"], **settings)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache
    assert kv.pool_of == (0, 0) and kv.group_num_blocks == (19, 19)
    (cache,) = engine.runner.kv_cache
    assert cache.shape[:2] == (2, 19)  # each group's 2 layers are the array's 2 rows
    prompt = prompt_ids(1, 40, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("long", *engine.prepare({"prompt_token_ids": prompt}, params))
    seen_full, seen_sliding, done = set(), set(), []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        full, sliding = kv.block_ids("long")
        assert not set(full) & set(sliding) - {0}
        seen_full |= set(full)
        seen_sliding |= set(sliding) - {0}
    assert seen_full & seen_sliding  # a block the window let go held full attention later
    assert len(seen_full | seen_sliding) > 18
    assert (
        done[0].outputs[0].token_ids
        == oracle_tokens(eager(tiny_models["gemma2"]), [prompt], 200)[0]
    )
    assert kv.all_blocks_free

"""Features that share state, crossed: random mixes of requests that meet in the prefix cache
(a common prefix admitted in one step, n = 2 over a prompt one token past a block boundary,
the same prompt under a cache salt, embeddings prompts that share their first blocks' rows),
beside seeded sampling, penalties and logprobs, on
engines that each add what changes when and where blocks are written: chunked prefill with
preemption, async scheduling under the priority policy with preemption, the host KV tier,
tensor and pipeline parallelism. Every request's output equals its output alone on the
plain engine (float32: tokens, finish reasons, logprobs within 1e-4).

Hypothesis draws the mixes (derandomized: a run is reproducible); the engines are built
once per layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from oracle import SMALL, prompt_ids, same_outputs

from jllm import LLM, SamplingParams

ARGS = {**SMALL, "dtype": "float32", "enable_prompt_embeds": True}
LAYOUTS = {
    "chunked-preempting": dict(max_num_batched_tokens=16, num_gpu_blocks_override=8),
    "async-priority-preempting": dict(
        async_scheduling=True, scheduling_policy="priority", num_gpu_blocks_override=8
    ),
    "host-tier": dict(kv_offloading_size=0.05, num_gpu_blocks_override=8),
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2, max_num_batched_tokens=64),
}

PREFIX = prompt_ids(1, 40, seed=21)[0]  # two full blocks and a half
ROWS = np.random.default_rng(26).normal(0.0, 0.25, (59, 64)).astype(np.float32)
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
KINDS = {
    "shared-a": ({"prompt_token_ids": PREFIX + [5, 6, 7]}, dict(**GREEDY, logprobs=2)),
    "shared-b": ({"prompt_token_ids": PREFIX + [9]}, GREEDY),
    "salted": ({"prompt_token_ids": PREFIX + [5, 6, 7], "cache_salt": "s"}, GREEDY),
    # One token past two blocks: the second child finds the first's blocks in its step.
    "n2-one-past": ({"prompt_token_ids": prompt_ids(1, 33, seed=22)[0]}, dict(**GREEDY, n=2)),
    "seeded": (
        {"prompt_token_ids": prompt_ids(1, 20, seed=23)[0]},
        dict(temperature=0.9, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True),
    ),
    "penalized": (
        {"prompt_token_ids": prompt_ids(1, 12, seed=24)[0]},
        dict(**GREEDY, repetition_penalty=1.3, presence_penalty=0.5),
    ),
    "short": ({"prompt_token_ids": prompt_ids(1, 5, seed=25)[0]}, GREEDY),
    # Embeddings prompts (the tiny model's hidden size, 64) sharing two blocks of rows, each
    # 46 rows: three blocks, and a fourth as they decode.
    "embeds-a": ({"prompt_embeds": ROWS[:46]}, dict(**GREEDY, logprobs=2)),
    "embeds-b": (
        {"prompt_embeds": np.concatenate([ROWS[:33], ROWS[46:]])},
        dict(temperature=0.8, seed=5, n=2, max_tokens=6, ignore_eos=True),
    ),
}
SETTINGS = settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["llama-l4"]


@pytest.fixture(scope="module")
def alone(model) -> dict:
    """Each kind's outputs alone on the plain engine."""
    llm = LLM(model, **ARGS)
    out = {}
    for name, (prompt, params) in KINDS.items():
        (result,) = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
        out[name] = result.outputs
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_random_mixes_equal_each_request_alone(model, alone, layout):
    llm = LLM(model, **{**ARGS, **LAYOUTS[layout]})
    mixes = st.lists(
        st.tuples(st.sampled_from(list(KINDS)), st.integers(-2, 2)), min_size=2, max_size=8
    )

    @given(mix=mixes)
    # Embeddings prompts meeting in the prefix cache: three sequences on 5 blocks that
    # each need a fourth of their own as they decode (8 blocks: one is preempted).
    @example(mix=[("embeds-a", 0), ("embeds-b", 0), ("shared-a", 0)])
    @SETTINGS
    def check(mix):
        prompts = [KINDS[name][0] for name, _ in mix]
        params = [SamplingParams(**KINDS[name][1]) for name, _ in mix]
        priority = [p for _, p in mix] if "priority" in layout else None
        outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
        for (name, _), out in zip(mix, outs, strict=True):
            same_outputs(out.outputs, alone[name])

    check()
    scheduler = llm.llm_engine.scheduler
    assert scheduler.kv_cache.prefix_hits > 0  # the mixes met in the prefix cache
    if "preempting" in layout:
        assert scheduler.num_preemptions > 0
    if layout == "host-tier":
        assert scheduler.kv_cache.host.loads > 0  # hits came back from host memory

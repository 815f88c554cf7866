"""A seeded request's tokens depend only on its own distribution, seed and output index: the
same in any batch, bucket, prefix-cache state, token budget, after preemption and under
tensor parallelism as when it runs alone. Hypothesis draws the batches; the reference is
each request alone on a default engine. The model runs in float32; where bfloat16 keeps this
only up to rounding ties: test_invariance.test_layouts_change_tokens_only_at_rounding_ties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams

SHARED = prompt_ids(1, 40, seed=7)[0]
# Short and long prompts; three share a 40-token prefix (prefix-cache hits).
PROMPTS = prompt_ids(3, 3, seed=5) + [SHARED + [11, 12, 13], SHARED + [21, 22], SHARED]

requests = st.fixed_dictionaries(
    {
        "prompt": st.integers(0, len(PROMPTS) - 1),
        "temperature": st.sampled_from([0.0, 0.8, 2.0, 8.0]),
        "top_k": st.sampled_from([0, 3, 300]),
        "top_p": st.sampled_from([1.0, 0.9, 0.3]),
        "min_p": st.sampled_from([0.0, 0.0, 0.05]),
        "penalty": st.sampled_from([None, None, "presence", "frequency", "repetition"]),
        "n": st.sampled_from([1, 1, 2]),
        "seed": st.integers(0, 2**40),
        "max_tokens": st.integers(3, 10),
    }
)
batches = st.lists(requests, min_size=1, max_size=5)
PROPERTY = settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def params_of(r) -> SamplingParams:
    penalty = {
        None: {},
        "presence": {"presence_penalty": 1.5},
        "frequency": {"frequency_penalty": 1.0},
        "repetition": {"repetition_penalty": 1.8},
    }[r["penalty"]]
    return SamplingParams(
        temperature=r["temperature"],
        top_k=r["top_k"],
        top_p=r["top_p"],
        min_p=r["min_p"],
        n=r["n"],
        seed=r["seed"],
        max_tokens=r["max_tokens"],
        ignore_eos=True,
        **penalty,
    )


def run(llm, batch) -> list[list[list[int]]]:
    prompts = [{"prompt_token_ids": PROMPTS[r["prompt"]]} for r in batch]
    outs = llm.generate(prompts, [params_of(r) for r in batch], use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def alone(llama_llm):
    """Each request's output alone on the default engine, memoised across examples."""
    cache = {}

    def get(r):
        key = tuple(sorted(r.items()))
        if key not in cache:
            cache[key] = run(llama_llm, [r])[0]
        return cache[key]

    return get


ENGINES = {
    "prefix-cache": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "budget-16": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_gpu_blocks_override": 12},
    "tp2": {"tensor_parallel_size": 2},
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, llama_dir):
    return request.param, LLM(llama_dir, **{**SMALL, **ENGINES[request.param]})


@PROPERTY
@given(batch=batches)
def test_seeded_requests_in_any_batch_equal_alone(engine, alone, batch):
    name, llm = engine
    assert run(llm, batch) == [alone(r) for r in batch], name


def test_preemption_engine_preempts(llama_dir, alone):
    """Guards the property above: the 'preemption' engine does preempt sampled requests."""
    llm = LLM(llama_dir, **{**SMALL, **ENGINES["preemption"]})
    batch = [
        {
            "prompt": i % len(PROMPTS),
            "temperature": 2.0,
            "top_k": 0,
            "top_p": 0.9,
            "min_p": 0.0,
            "penalty": None,
            "n": 2,
            "seed": i,
            "max_tokens": 10,
        }
        for i in range(6)
    ]
    assert run(llm, batch) == [alone(r) for r in batch]
    assert llm.llm_engine.scheduler.num_preemptions > 0

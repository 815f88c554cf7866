"""Async scheduling (step N+1 scheduled and dispatched before step N's results are read)
changes nothing a user sees: every kind of request gives the same outputs with it on and
off, also when chunked, preempted, stopped early or aborted."""

from __future__ import annotations

import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.4),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=9, logprobs=3),
    SamplingParams(n=2, temperature=0.7, seed=11, max_tokens=12, min_tokens=4),
    SamplingParams(temperature=0.0, max_tokens=30, stop=["a", "e"]),  # stops early
    SamplingParams(temperature=0.0, max_tokens=1),
]


def run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
        for o in outs
    ]


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids(len(PARAMS), 5, seed=21)


@pytest.fixture(scope="module")
def sync(llama_dir, prompts):
    return run(LLM(llama_dir, **SMALL, async_scheduling=False), prompts)


@pytest.mark.parametrize(
    "extra",
    [{}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}, {"num_gpu_blocks_override": 10}],
    ids=["default", "chunked", "preempting"],
)
def test_outputs_identical_on_and_off(llama_dir, prompts, sync, extra):
    llm = LLM(llama_dir, **{**SMALL, **extra}, async_scheduling=True)
    assert llm.llm_engine.core.async_scheduling
    got = run(llm, prompts)
    for g, s in zip(got, sync, strict=True):
        for (gt, gx, gf, gs, glp), (st, sx, sf, ss, slp) in zip(g, s, strict=True):
            assert (gt, gx, gf, gs) == (st, sx, sf, ss)
            if slp is not None:
                assert [lp.keys() for lp in glp] == [lp.keys() for lp in slp]
    if "num_gpu_blocks_override" in extra:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    # Nothing is left behind: every block back in the pool, no step in flight, and the
    # runner holds rows only for requests whose end it will hear of with the next step.
    assert not llm.llm_engine.has_unfinished_requests()
    held = set(llm.llm_engine.runner.batch.index)
    assert held == llm.llm_engine.scheduler._finished_ids
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_abort_while_a_step_is_in_flight(llama_dir, prompts):
    llm = LLM(llama_dir, **SMALL, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        processed, sp = engine.prepare({"prompt_token_ids": p}, params)
        engine.add_request(str(i), processed, sp)
    for _ in range(3):
        engine.step()
    engine.abort_request(["1"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert set(finished) == {"0", "2"} and all(len(t) == 50 for t in finished.values())
    alone = LLM(llama_dir, **SMALL, async_scheduling=False)
    ref = alone.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert finished["0"] == ref[0].outputs[0].token_ids


def test_rows_freed_when_a_step_schedules_nothing(llama_dir, prompts):
    """One request ends while another's last token is in flight, so the next schedule has
    nothing to run: the runner must still hear of the ended one (its row would leak, and a
    full batch would then have no row for a new request)."""
    llm = LLM(llama_dir, **{**SMALL, "max_num_seqs": 2}, async_scheduling=True)
    for _ in range(3):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 5)]
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        held = set(llm.llm_engine.runner.batch.index)
        assert held == llm.llm_engine.scheduler._finished_ids

"""The split between the engine core (token ids) and the front end (text, stop strings,
outputs) on a real engine: a stop string the front end finds ends the request in the core
too, with finish reason "stop" in the statistics; the core is reached through its client."""

from __future__ import annotations

import pytest
from oracle import prompt_ids

from jllm import SamplingParams
from jllm.engine.core_client import InprocClient


class FinishedLog:
    """A stat logger keeping the finished-request statistics."""

    def __init__(self) -> None:
        self.finished = []

    def record(self, step, sched) -> None:
        self.finished += step.finished


def test_a_stop_string_found_in_the_front_end_ends_the_request_in_the_core(llama_llm):
    engine = llama_llm.llm_engine
    kv = engine.scheduler.kv_cache
    greedy = dict(temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": prompt_ids(1, 9, seed=4)[0]}
    full = llama_llm.generate(prompt, SamplingParams(max_tokens=40, **greedy), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    log = FinishedLog()
    engine.core.stat_loggers.append(log)
    try:
        processed, params = engine.prepare(
            prompt, SamplingParams(max_tokens=40, stop=[stop], **greedy)
        )
        engine.add_request("cut", processed, params)
        last = None
        while last is None:
            last = next((o for o in engine.step() if o.finished), None)
            # The step that found it also ended it in the core: nothing left to run.
        assert not engine.has_unfinished_requests()
    finally:
        engine.core.stat_loggers.remove(log)
    got = last.outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == text[: text.index(stop)]
    assert kv.num_free_blocks == kv.num_blocks - 1  # its blocks are back
    assert engine.core.parents == {} and not engine.output_processor.parents
    (stats,) = log.finished
    assert stats.finish_reason == "stop"
    # Without async scheduling the core had computed exactly the tokens the user sees.
    assert stats.num_generation_tokens == len(got.token_ids)


def test_reset_prefix_cache_is_a_utility_call(llama_llm, monkeypatch):
    """LLM.reset_prefix_cache reaches the core through its client's call_utility."""
    calls = []
    inner = InprocClient.call_utility

    def record(self, name, *args):
        calls.append(name)
        return inner(self, name, *args)

    monkeypatch.setattr(InprocClient, "call_utility", record)
    assert llama_llm.reset_prefix_cache() is True
    assert calls == ["reset_prefix_cache"]
    client = llama_llm.llm_engine.engine_core
    for name in ("no_such_utility", "_update", "max_model_len"):
        with pytest.raises(ValueError, match=name):
            client.call_utility(name)

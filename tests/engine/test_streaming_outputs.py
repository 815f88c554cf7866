"""DELTA outputs (what the server streams): the pieces add up to the final output, and text
that could start a stop string is held back rather than sent and retracted."""

from __future__ import annotations

import pytest

from jllm.sampling_params import RequestOutputKind, SamplingParams


def run(engine, rid, prompt, params):
    processed, params = engine.prepare(prompt, params)
    engine.add_request(rid, processed, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("n", [1, 2])
def test_deltas_add_up_to_final(llama_llm, n):
    engine = llama_llm.llm_engine
    base = dict(n=n, temperature=0.8, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)
    final = run(engine, f"final{n}", "Streaming test", SamplingParams(**base))[-1]
    deltas = run(
        engine,
        f"delta{n}",
        "Streaming test",
        SamplingParams(**base, output_kind=RequestOutputKind.DELTA),
    )
    assert len(deltas) >= 12 and deltas[-1].finished
    for c in final.outputs:
        pieces = [d for out in deltas for d in out.outputs if d.index == c.index]
        assert "".join(p.text for p in pieces) == c.text
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert [lp for p in pieces for lp in p.logprobs] == c.logprobs
        assert pieces[-1].finish_reason == "length"
        assert all(p.finish_reason is None for p in pieces[:-1])


def test_stop_string_is_held_back(llama_llm):
    engine = llama_llm.llm_engine
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    text = run(engine, "full", "Hold back", SamplingParams(**greedy))[-1].outputs[0].text
    stop = text[8:12]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        outs = run(
            engine,
            f"stop{kind}",
            "Hold back",
            SamplingParams(**greedy, stop=[stop], output_kind=kind),
        )
        shown = [c.text for o in outs for c in o.outputs]
        assert all(stop not in t for t in shown)
        streamed = "".join(shown) if kind == RequestOutputKind.DELTA else shown[-1]
        assert streamed == text[: text.index(stop)]
        assert outs[-1].outputs[0].stop_reason == stop

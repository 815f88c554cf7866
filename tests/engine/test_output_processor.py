"""The front end's output processor, fed core outputs by hand: what a user sees of text, stop
strings, logprobs, n sequences and output kinds is what the engine showed when it built
outputs on the engine thread, checked against the tokenizer's own full decode."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from jllm.engine.output_processor import OutputProcessor
from jllm.engine.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from jllm.runner.sampled import SampledToken
from jllm.sampling_params import RequestOutputKind, SamplingParams

TEXT = "The answer is forty-two. Then more text follows, and it goes on."


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def add(proc, rid="r", prompt=(1, 2, 3), **params) -> None:
    request = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        seed=0,
        arrival_time=100.0,
    )
    proc.add_request(request, "prompt text")


def step(proc, *outputs, at=101.0):
    return proc.process_outputs(EngineCoreOutputs(outputs=list(outputs), timestamp=at))


def out(rid, tokens, **fields) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=list(tokens), **fields)


def run(proc, rid, ids, per_step=1, last=None, **fields):
    """Feed `ids` as core outputs of `per_step` tokens, the last with finish `last`; every
    processed step."""
    steps = []
    for at in range(0, len(ids), per_step):
        chunk = ids[at : at + per_step]
        final = at + per_step >= len(ids)
        reason = last if final else None
        steps.append(step(proc, out(rid, chunk, finish_reason=reason, **fields)))
    return steps


def final(steps):
    return [o for s in steps for o in s.request_outputs if o.finished][-1]


@pytest.mark.parametrize("per_step", [1, 3], ids=["decode", "verified drafts"])
def test_text_is_the_full_decode(tok, per_step):
    ids = tok.encode(TEXT)
    proc = OutputProcessor(tok)
    add(proc, max_tokens=len(ids))
    got = final(run(proc, "r", ids, per_step, last="length")).outputs[0]
    assert got.text == tok.decode(ids) and got.token_ids == ids
    assert got.finish_reason == "length" and got.stop_reason is None
    assert not proc.has_unfinished_requests()


def cut_at(tok, ids: list[int], stops: list[str], include: bool):
    """The reference: the first token whose prefix decodes to text holding a stop string,
    the string that completes earliest there (ties to the list's order), the text cut there."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        found = [(text.index(s) + len(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            end, _, stop = min(found)
            return ids[:n], text[: end if include else end - len(stop)], stop
    raise AssertionError("no stop string is in the text")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("per_step", [1, 4], ids=["decode", "verified drafts"])
@pytest.mark.parametrize(
    "stops", [["forty-two"], ["never", "two."], ["follows", "forty"], ["goes", "on."]]
)
def test_a_stop_string_ends_the_sequence_here(tok, stops, per_step, include):
    """The sequence ends at the token completing a stop string: its text cut there, the
    tokens the core sent after it dropped, and the core asked to end it (finish "stop")."""
    ids = tok.encode(TEXT)
    proc = OutputProcessor(tok)
    add(proc, max_tokens=100, stop=stops, include_stop_str_in_output=include)
    steps = run(proc, "r", ids, per_step)
    want_ids, want_text, want_stop = cut_at(tok, ids, stops, include)
    got = final(steps).outputs[0]
    assert (got.text, got.token_ids) == (want_text, want_ids)
    assert got.finish_reason == "stop" and got.stop_reason == want_stop
    aborts = [a for s in steps for a in s.reqs_to_abort]
    assert aborts == ["r"]  # once; the outputs after it are ignored
    ended = -(-len(want_ids) // per_step)  # the step that carried the stop
    assert all(not s.request_outputs and not s.reqs_to_abort for s in steps[ended:])


@pytest.mark.parametrize("include", [False, True])
def test_the_cores_eos_or_stop_token_shows_only_when_included(tok, include):
    ids = tok.encode("Hello world")
    eos = tok.eos_token_id
    proc = OutputProcessor(tok)
    add(proc, max_tokens=10, include_stop_str_in_output=include, skip_special_tokens=False)
    got = final(run(proc, "r", [*ids, eos], last="stop")).outputs[0]
    assert got.text == tok.decode([*ids, eos] if include else ids, skip_special_tokens=False)
    assert got.token_ids == [*ids, eos] and got.finish_reason == "stop"
    assert got.stop_reason is None


def test_the_last_allowed_token_completing_a_stop_string_ends_as_stop(tok):
    """vLLM's rule: a stop string wins over the core's "length" on the token that completes
    it (the max_tokens-th): finish "stop" with the string, the text cut there, and nothing
    sent back to abort (the core has ended the request)."""
    ids = tok.encode("one two three")
    proc = OutputProcessor(tok)
    add(proc, max_tokens=len(ids), stop=["three"])
    steps = run(proc, "r", ids, last="length")
    got = final(steps).outputs[0]
    assert got.text == "one two " and got.finish_reason == "stop" and got.stop_reason == "three"
    assert not any(s.reqs_to_abort for s in steps)


def test_the_stop_string_completing_earliest_wins(tok):
    """Two stop strings completed by one token's text: the one that ends first, whatever
    the list's order (vLLM's `check_stop_strings`); ties go to the list's order."""
    ids = tok.encode("one two three")
    proc = OutputProcessor(tok)
    add(proc, max_tokens=10, stop=["hree", "th"])  # " three" completes "th" first
    got = final(run(proc, "r", ids)).outputs[0]
    assert (got.text, got.stop_reason) == ("one two ", "th")
    proc = OutputProcessor(tok)
    add(proc, rid="s", max_tokens=10, stop=["two", "o two"])  # both end at one place
    got = final(run(proc, "s", ids)).outputs[0]
    assert (got.text, got.stop_reason) == ("one ", "two")


@pytest.mark.parametrize("n", [1, 2])
def test_deltas_add_up_and_hold_back_a_possible_stop(tok, n):
    ids = tok.encode(TEXT)
    proc = OutputProcessor(tok)
    stop = "follows"
    add(proc, n=n, max_tokens=100, stop=[stop, "zzzz"], output_kind=RequestOutputKind.DELTA)
    pieces = {i: [] for i in range(n)}
    rids = ["r"] if n == 1 else [f"{i}_r" for i in range(n)]
    for token in ids:
        # Sequence 1 moves every other step only: a DELTA output names who moved.
        movers = [rid for j, rid in enumerate(rids) if j == 0 or token % 2]
        for o in step(proc, *(out(rid, [token]) for rid in movers)).request_outputs:
            for c in o.outputs:
                pieces[c.index].append(c)
    whole = tok.decode(ids)
    assert "".join(c.text for c in pieces[0]) == whole[: whole.index(stop)]
    assert all(stop[:-1] not in c.text for c in pieces[0])
    assert pieces[0][-1].finish_reason == "stop"
    assert all(c.finish_reason is None for c in pieces[0][:-1])


def test_final_only_waits_for_every_sequence(tok):
    ids = tok.encode("Hello world again")
    proc = OutputProcessor(tok)
    add(proc, n=2, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    got = []
    for i, token in enumerate(ids):
        reason = "length" if i == len(ids) - 1 else None
        first = out("0_r", [token], finish_reason=reason)
        got += step(proc, first).request_outputs
    assert got == []  # sequence 1 runs on
    (done,) = step(proc, out("1_r", ids[::-1], finish_reason="length")).request_outputs
    assert [c.text for c in done.outputs] == [tok.decode(ids), tok.decode(ids[::-1])]
    assert [c.index for c in done.outputs] == [0, 1] and done.finished


def sampled(token, logprob, top):
    ids = np.array([t for t, _ in top])
    lps = np.array([lp for _, lp in top], np.float32)
    rank = 1 + sum(lp > logprob for _, lp in top)
    return SampledToken(token, logprob, rank, ids, lps)


def test_logprob_entries_with_text(tok):
    a, b, c = tok.encode(" cat dog fish")[:3]
    proc = OutputProcessor(tok)
    add(proc, max_tokens=2, logprobs=1)
    step(proc, out("r", [a], new_logprobs=[sampled(a, -0.5, [(a, -0.5), (b, -1.5)])]))
    lp = [sampled(c, -2.0, [(b, -0.25), (c, -2.0)])]
    (o,) = step(proc, out("r", [c], finish_reason="length", new_logprobs=lp)).request_outputs
    first, second = o.outputs[0].logprobs
    assert list(first) == [a] and first[a].rank == 1 and first[a].decoded_token == tok.decode([a])
    assert list(second) == [c, b]  # the sampled token first, then the top 1
    assert (second[c].rank, second[b].rank) == (2, 1)
    assert second[b].decoded_token == tok.decode([b])
    assert o.outputs[0].cumulative_logprob == pytest.approx(-2.5)


def test_prompt_logprobs_once_per_delta_stream(tok):
    prompt = tok.encode("a b c d")
    proc = OutputProcessor(tok)
    add(proc, prompt=prompt, max_tokens=3, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
    n = len(prompt) - 1
    top = np.zeros((n, 1), np.int64), np.zeros((n, 1), np.float32)
    chunk = (1, np.full(n, -1.0), np.ones(n, np.int64), *top)
    outs = step(proc, out("r", [5], new_prompt_logprobs=chunk)).request_outputs
    outs += step(proc, out("r", [6])).request_outputs
    assert outs[0].prompt_logprobs[0] is None
    assert [list(e) for e in outs[0].prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    assert outs[1].prompt_logprobs is None


def test_the_cores_error_fails_the_request_without_text(tok):
    proc = OutputProcessor(tok)
    add(proc, n=2, max_tokens=5)
    step(proc, out("0_r", tok.encode("Hi")), out("1_r", tok.encode("Yo")))
    (o,) = step(proc, out("1_r", [], finish_reason="error")).request_outputs
    assert o.finished and [c.finish_reason for c in o.outputs] == ["error", "error"]
    assert [c.text for c in o.outputs] == ["", ""] and o.outputs[0].token_ids == tok.encode("Hi")
    assert step(proc, out("0_r", [], finish_reason="error")).request_outputs == []
    assert not proc.has_unfinished_requests()


def test_a_failure_here_fails_its_request_alone(tok, monkeypatch):
    proc = OutputProcessor(tok)
    add(proc, "bad", max_tokens=5)
    add(proc, "good", max_tokens=1)
    detok = proc.sequences["bad"].detokenizer

    def broken(token):
        raise RuntimeError("a tokenizer bug")

    monkeypatch.setattr(detok, "update", broken)
    got = step(proc, out("bad", [5]), out("good", [6], finish_reason="length"))
    assert got.reqs_to_fail == ["bad"] and got.reqs_to_abort == []
    bad, good = sorted(got.request_outputs, key=lambda o: o.request_id)
    assert bad.outputs[0].finish_reason == "error" and good.outputs[0].finish_reason == "length"


def test_metrics_and_what_the_request_carries(tok):
    proc = OutputProcessor(tok)
    add(proc, max_tokens=2)
    fields = dict(num_cached_tokens=16, first_scheduled_time=100.5)
    step(proc, out("r", [5], **fields), at=101.0)
    (o,) = step(proc, out("r", [6], finish_reason="length", **fields), at=102.0).request_outputs
    m = o.metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time) == (100.0, 100.5, 101.0)
    assert m.finished_time == 102.0 and o.num_cached_tokens == 16
    assert o.prompt == "prompt text" and o.prompt_token_ids == [1, 2, 3]


def test_an_abort_forgets_the_request(tok):
    proc = OutputProcessor(tok)
    add(proc, n=2, max_tokens=5)
    proc.abort_requests(["r"])
    assert not proc.has_unfinished_requests() and not proc.sequences
    assert step(proc, out("0_r", [5])).request_outputs == []

"""Structured outputs end to end on a tiny random model, whose raw output is noise: only the
grammar can make it valid. Every output is checked by an independent oracle (`jsonschema`
for schemas, `re.fullmatch` for regexes, membership for choices, Python's own parser for
the arithmetic grammar), at temperature 1.0 over many seeds, with both grammar backends;
free requests beside constrained ones keep their exact outputs; drafts verified under a
grammar change nothing; a grammar being compiled holds up no other request."""

from __future__ import annotations

import ast
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams, StructuredOutputsParams
from jllm.sampling_params import GuidedDecodingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "pattern": "^[a-z ]{1,5}$"},
    },
    "required": ["color", "count", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-\d{3}"
CHOICES = ["yes", "no", 'ma"ybe é']
GRAMMAR = 'root ::= "(" [1-9] [0-9]? ("+" [1-9] [0-9]?)* ")"'
SEEDS = range(12)


def constraints():
    return {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", text), text
        assert isinstance(ast.literal_eval(text[1:-1].replace("+", ",") + ","), tuple)


def params(so, seed, **kw):
    kw = {"temperature": 1.0, "max_tokens": 80, **kw}
    return SamplingParams(seed=seed, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def guidance_llm(llama_dir):
    return LLM(llama_dir, **SMALL, structured_outputs_config={"backend": "guidance"})


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_every_output_follows_its_grammar(backend, llama_llm, guidance_llm):
    llm = llama_llm if backend == "xgrammar" else guidance_llm
    kinds = constraints()
    prompts, all_params, expect = [], [], []
    for i, (kind, so) in enumerate(kinds.items()):
        for seed in SEEDS:
            prompts.append({"prompt_token_ids": prompt_ids(1, 4 + seed % 5, seed=seed + i)[0]})
            all_params.append(params(so, seed))
            expect.append(kind)
    outs = llm.generate(prompts, all_params, use_tqdm=False)
    for kind, out in zip(expect, outs, strict=True):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (kind, o.text)  # EOS once the grammar can end
        check(kind, o.text)
    backends = {p.structured_outputs._backend for p in all_params}
    assert backends == {None}  # the caller's params are not modified
    # The noise the grammar tames: the same seeds without it give no valid JSON.
    free = llm.generate(prompts[:4], [params(None, s) for s in range(4)], use_tqdm=False)
    for out in free:
        with pytest.raises(ValueError):
            json.loads(out.outputs[0].text)


def test_json_object_and_the_older_names(llama_llm):
    """json_object: a JSON object; `guided_decoding=GuidedDecodingParams(...)` is vLLM's
    older spelling of the same request."""
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(6, 5, seed=3)]
    obj = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outs = llama_llm.generate(
        prompts, [params(obj, s, max_tokens=200) for s in range(6)], use_tqdm=False
    )
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished
    for text in finished:
        assert isinstance(json.loads(text), dict)
    for o in outs:  # unfinished ones are a prefix of a JSON object
        assert o.outputs[0].text.startswith("{")
    old = SamplingParams(
        temperature=1.0, seed=0, max_tokens=80, guided_decoding=GuidedDecodingParams(regex=REGEX)
    )
    new = params(StructuredOutputsParams(regex=REGEX), 0)
    a, b = llama_llm.generate([prompts[0]] * 2, [old, new], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    check("regex", a.outputs[0].text)


def test_free_requests_keep_their_outputs_beside_constrained_ones(llama_llm):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(8, 6, seed=5)]
    free = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)
    ]
    alone = llama_llm.generate(prompts[:4], free, use_tqdm=False)
    so = constraints()
    mixed_params = free + [params(so["json"], s) for s in range(2)] + [params(so["regex"], 9)] * 2
    mixed = llama_llm.generate(prompts, mixed_params, use_tqdm=False)
    for a, m in zip(alone, mixed[:4], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    for out, kind in zip(mixed[4:], ["json", "json", "regex", "regex"], strict=True):
        check(kind, out.outputs[0].text)


def test_bad_constraints_are_refused_and_the_engine_runs_on(llama_llm):
    bad = [
        (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar"),
    ]
    for so, kind in bad:
        with pytest.raises(ValueError, match=f"Invalid {kind} for structured outputs"):
            llama_llm.generate("Hi", params(so, 0), use_tqdm=False)
    with pytest.raises(ValueError, match="regex must be a string"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(ValueError, match="only use one kind"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams()
    out = llama_llm.generate("Hi", params(constraints()["choice"], 1), use_tqdm=False)
    check("choice", out[0].outputs[0].text)


def test_engine_options(llama_dir):
    with pytest.raises(ValueError, match="not supported by jllm"):
        LLM(llama_dir, **SMALL, structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ValueError, match="Unknown structured_outputs_config keys"):
        LLM(llama_dir, **SMALL, structured_outputs_config={"bakend": "xgrammar"})


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_drafts_under_a_grammar_change_nothing(backend, llama_llm, guidance_llm, llama_dir):
    """Verification rows get one bitmask row per draft, each from the matcher advanced over
    the drafts before it and rolled back: drafts that are the true continuation are all
    accepted, wrong ones (which the grammar mostly refuses) never are, and the output is the
    same as without drafts."""
    plain_llm = llama_llm if backend == "xgrammar" else guidance_llm
    K = 3

    class Oracle:
        """Proposes the next K tokens of the plain output (or each plus one: wrong)."""

        def __init__(self, expected, wrong):
            self.expected, self.wrong, self.proposed = expected, wrong, 0

        def propose(self, req, num_running=1):
            out = self.expected[tuple(req.prompt_token_ids)]
            drafts = out[req.num_output_tokens : req.num_output_tokens + K]
            self.proposed += len(drafts)
            return [(t + 1) % 49152 for t in drafts] if self.wrong else drafts

    prompts = prompt_ids(6, 7, seed=8)
    so = constraints()
    all_params = [params(so[k], s) for s, k in enumerate(["json", "regex", "grammar"] * 2)]
    all_params[1] = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so["json"])
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = [o.outputs[0] for o in plain_llm.generate(inputs, all_params, use_tqdm=False)]
    expected = {tuple(p): list(o.token_ids) for p, o in zip(prompts, plain, strict=True)}
    spec = LLM(
        llama_dir,
        **SMALL,
        num_lookahead_slots=K,
        async_scheduling=False,
        structured_outputs_config={"backend": backend},
    )
    for wrong in (False, True):
        proposer = Oracle(expected, wrong=wrong)
        spec.llm_engine.core.proposer = proposer
        outs = spec.generate(inputs, all_params, use_tqdm=False)
        assert proposer.proposed > 0
        for p, o in zip(plain, outs, strict=True):
            assert o.outputs[0].token_ids == p.token_ids
    for p, kind in zip(plain, ["json", "json", "grammar", "json", "regex", "grammar"], strict=True):
        check(kind, p.text)


def test_async_scheduling_gives_the_same_outputs(llama_dir, llama_llm):
    """With async scheduling the steps of a grammar request run one at a time, and free
    requests beside it are unaffected."""
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(4, 6, seed=12)]
    so = constraints()
    all_params = [
        params(so["json"], 1),
        SamplingParams(temperature=1.0, seed=2, max_tokens=30, ignore_eos=True),
        params(so["grammar"], 3),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
    ]
    sync = llama_llm.generate(prompts, all_params, use_tqdm=False)
    async_llm = LLM(llama_dir, **SMALL, async_scheduling=True)
    got = async_llm.generate(prompts, all_params, use_tqdm=False)
    for a, b in zip(sync, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_grammar_being_compiled_holds_up_nobody(llama_llm):
    """The grammar compiles on the manager's thread; until it is ready its request waits
    outside the scheduler while the others run to completion."""
    manager = llama_llm.llm_engine.structured
    release, inner = threading.Event(), manager._backends_compile

    def held(backend, p):
        assert release.wait(60)
        return inner(backend, p)

    manager._backends_compile = held
    try:
        engine = llama_llm.llm_engine
        free = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        # A constraint no other test compiles, so the cache cannot answer.
        slow = params(StructuredOutputsParams(regex="[x-z]{3}"), 0)
        for rid, p in (("slow", slow), ("free", free)):
            engine.add_request(rid, *engine.prepare({"prompt_token_ids": [5, 6, 7]}, p))
        finished = []
        while "free" not in finished:
            finished += [o.request_id for o in engine.step() if o.finished]
        assert "slow" not in finished and engine.has_unfinished_requests()
        release.set()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    assert o.request_id == "slow"
                    assert re.fullmatch("[x-z]{3}", o.outputs[0].text)
    finally:
        manager._backends_compile = inner
        release.set()


def test_bitmask_rows_follow_the_drafts(llama_llm):
    """The manager's rows for a verification row: row j is the mask after drafts 0..j-1,
    compared with a fresh matcher advanced over them; the matcher is left unchanged."""
    engine = llama_llm.llm_engine
    manager = engine.structured
    so = StructuredOutputsParams(regex=REGEX)
    so = manager.validate(so)
    compiled = manager.compile(so).result()
    tok = engine.tokenizer
    drafts = tok.encode("ab-12", add_special_tokens=False)
    m = manager.matcher(so, compiled)
    rows = manager.bitmask(m, drafts)
    for j in range(len(drafts) + 1):
        fresh = manager.matcher(so, compiled)
        for t in drafts[:j]:
            assert fresh.accept(t)
        want = np.full((1, manager.width), -1, np.int32)
        fresh.fill(want, 0)
        assert (rows[j] == want[0]).all()
    after = np.full((1, manager.width), -1, np.int32)
    m.fill(after, 0)
    assert (after[0] == rows[0]).all()
    # The drafts the engine keeps: the prefix the grammar accepts, matcher unchanged.
    bad = tok.encode("zz", add_special_tokens=False)
    assert manager.valid_drafts(m, drafts + bad) == drafts
    assert manager.valid_drafts(m, bad + drafts) == []
    again = np.full((1, manager.width), -1, np.int32)
    m.fill(again, 0)
    assert (again[0] == rows[0]).all()
    # A draft the grammar refuses: its own row masks it, later rows stay all ones.
    rows = manager.bitmask(m, bad)
    bit = (rows[0, bad[0] // 32] >> (bad[0] % 32)) & 1
    assert bit == 0 and (rows[1:] == -1).all()

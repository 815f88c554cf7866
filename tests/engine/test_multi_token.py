"""Several tokens per request per step: a request's row may verify draft tokens, the step
returns up to k+1 tokens for it, and only accepted tokens enter the output and the prefix
cache. Drafts come from test proposers (the n-gram proposer: test_spec_decode.py):
`Oracle` proposes the true continuation (every draft accepted), `Wrong` a wrong one (none).
The oracle is the plain engine's own output."""

from __future__ import annotations

import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from jllm.engine.kv_cache_manager import block_key

K = 3
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
    SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    ),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
]


class Oracle:
    """Proposes the next K tokens of the known output of the request's prompt."""

    def __init__(self, expected: dict[tuple, list[int]], wrong: bool = False, vocab=49152):
        self.expected, self.wrong, self.vocab = expected, wrong, vocab
        self.proposed = 0

    def propose(self, req, num_running=1):
        out = self.expected[tuple(req.prompt_token_ids)]
        drafts = out[req.num_output_tokens : req.num_output_tokens + K]
        if self.wrong:
            drafts = [(t + 1) % self.vocab for t in drafts]
        self.proposed += len(drafts)
        return drafts


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


class StepCounter:
    def __init__(self, runner):
        self.steps, self.inner = 0, runner.execute
        runner.execute = self

    def __call__(self, out):
        self.steps += 1
        return self.inner(out)


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids(5, 9, seed=11)


@pytest.fixture(scope="module")
def plain(llama_llm, prompts):
    return run(llama_llm, prompts, MIXED)


@pytest.fixture(scope="module")
def spec_llm(llama_dir):
    return LLM(llama_dir, **SMALL, num_lookahead_slots=K, async_scheduling=False)


def expected_of(prompts, plain):
    return {tuple(p): list(o.token_ids) for p, o in zip(prompts, plain, strict=True)}


@pytest.mark.parametrize("wrong", [False, True], ids=["all-accepted", "none-accepted"])
def test_outputs_equal_the_plain_engine(spec_llm, prompts, plain, wrong):
    """Greedy, seeded, penalized and logprob requests give the plain engine's tokens (and
    logprobs) whether every draft is accepted or none is; accepted drafts save steps."""
    proposer = Oracle(expected_of(prompts, plain), wrong=wrong)
    core = spec_llm.llm_engine.core
    core.proposer = proposer
    counter = StepCounter(spec_llm.llm_engine.runner)
    try:
        got = run(spec_llm, prompts, MIXED)
    finally:
        core.proposer = None
        spec_llm.llm_engine.runner.execute = counter.inner
    assert proposer.proposed > 0
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    for g, p in zip(got[-1].logprobs, plain[-1].logprobs, strict=True):
        assert g.keys() == p.keys()
        for t in g:
            assert g[t].logprob == pytest.approx(p[t].logprob, abs=1e-4)
    # 20 tokens: 1 from the prefill, then 4 per step when all K=3 drafts are accepted
    longest = 1 + (-(-19 // (K + 1)) if not wrong else 19)
    assert counter.steps == longest


def test_stop_and_max_tokens_inside_an_accepted_run(spec_llm, prompts, plain):
    """A stop token or max_tokens falling inside a run of accepted drafts ends the output
    there: what the step sampled after it is dropped."""
    greedy = plain[0].token_ids
    stop_at = greedy[6]  # the 7th token: inside the second verification row
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    spec_llm.llm_engine.core.proposer = Oracle(expected_of(prompts, plain))
    try:
        got = run(spec_llm, [prompts[0], prompts[0]], params)
    finally:
        spec_llm.llm_engine.core.proposer = None
    first = greedy.index(stop_at)
    assert got[0].token_ids == greedy[: first + 1]
    assert got[0].finish_reason == "stop" and got[0].stop_reason == stop_at
    assert got[1].token_ids == greedy[:7] and got[1].finish_reason == "length"


def test_prefix_cache_holds_only_accepted_tokens(spec_llm, llama_llm, prompts, plain):
    """After rejected drafts wrote their KV, every cached block is a block of a real
    sequence, and a new request reusing those blocks gives the output it gives without
    the cache."""
    kv = spec_llm.llm_engine.scheduler.kv_cache
    assert kv.reset_prefix_cache()
    spec_llm.llm_engine.core.proposer = Oracle(expected_of(prompts, plain), wrong=True)
    try:
        got = run(spec_llm, prompts[:1], MIXED[:1])
    finally:
        spec_llm.llm_engine.core.proposer = None
    seq = prompts[0] + got[0].token_ids
    S = kv.block_size
    keys, parent = set(), None
    for i in range(len(seq) // S):
        parent = block_key(parent, seq[i * S : (i + 1) * S])
        keys.add(parent)
    cached = kv.pools[0].cached  # the one KV-cache group
    assert cached and set(cached) <= keys
    # A continuation of the whole sequence hits those blocks and matches the plain engine.
    before = kv.prefix_hits
    follow = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hit = run(spec_llm, [seq], [follow])[0].token_ids
    assert kv.prefix_hits - before >= (len(seq) - 1) // S * S
    assert hit == run(llama_llm, [seq], [follow])[0].token_ids


@pytest.mark.parametrize(
    "settings",
    [{"attention_backend": "xla"}, {"max_num_seqs": 4, "max_num_batched_tokens": 64}],
    ids=["xla", "tiles-and-decode-rows"],
)
def test_verification_rows_on_each_layout(llama_dir, prompts, plain, settings):
    """Verification rows run as decode rows of one query each (the xla backend's decode
    path), and, past the largest decode bucket (4 rows), in tiles beside them in one step."""
    llm = LLM(llama_dir, **{**SMALL, **settings}, num_lookahead_slots=K, async_scheduling=False)
    proposer = Oracle(expected_of(prompts, plain))
    llm.llm_engine.core.proposer = proposer
    got = run(llm, prompts, MIXED)
    assert proposer.proposed > 0
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]

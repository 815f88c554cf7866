"""`logit_bias`, `allowed_token_ids` and `bad_words` end to end, against effects computed by
hand from the engine's own raw logprobs (the log-softmax of the model's logits, so a gap
between two logprobs is the gap between their logits)."""

from __future__ import annotations

import pytest
from oracle import prompt_ids

from jllm import SamplingParams

PROMPT = {"prompt_token_ids": prompt_ids(1, 12, seed=31)[0]}
OTHER = {"prompt_token_ids": prompt_ids(1, 9, seed=32)[0]}


def run(llm, prompts, **params):
    params = SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **params})
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(llama_llm):
    """Greedy output of PROMPT with the top-20 raw logprobs of every step."""
    return run(llama_llm, [PROMPT], temperature=0, logprobs=20)[0]


def ranked(step_logprobs) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in step_logprobs.items()), key=lambda x: -x[1])


def test_plus_100_forces_a_token_and_minus_100_bans_one(llama_llm, plain):
    forced = 1234
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = run(llama_llm, [PROMPT], logit_bias={forced: 100}, **params)[0]
        assert out.token_ids == [forced] * 8
    first = plain.token_ids[0]
    out = run(llama_llm, [PROMPT], temperature=0, logit_bias={first: -100})[0]
    assert out.token_ids[0] == ranked(plain.logprobs[0])[1][0]  # the runner-up


def test_bias_is_added_to_the_logits(llama_llm, plain):
    (top, top_lp), (second, second_lp) = ranked(plain.logprobs[0])[:2]
    gap = top_lp - second_lp
    # String keys, as JSON gives them, are token ids too.
    below = run(llama_llm, [PROMPT], temperature=0, logit_bias={str(second): gap - 1e-3})[0]
    above = run(llama_llm, [PROMPT], temperature=0, logit_bias={second: gap + 1e-3})[0]
    assert below.token_ids[0] == top and above.token_ids[0] == second
    # Logprobs stay the model's raw ones, as in vLLM.
    raw = run(llama_llm, [PROMPT], temperature=0, logprobs=1, logit_bias={second: gap + 1e-3})[0]
    assert raw.logprobs[0][second].logprob == pytest.approx(second_lp, abs=1e-4)


def test_allowed_token_ids(llama_llm, plain):
    top = [t for t, _ in ranked(plain.logprobs[0])]
    allowed = [top[6], top[2], top[4]]
    out = run(llama_llm, [PROMPT], temperature=0, allowed_token_ids=allowed)[0]
    assert out.token_ids[0] == top[2]
    sampled = run(llama_llm, [PROMPT], temperature=1.0, seed=0, allowed_token_ids=allowed)[0]
    assert set(sampled.token_ids) <= set(allowed)


def test_neighbours_are_unaffected(llama_llm):
    alone = run(llama_llm, [OTHER], temperature=0)[0].token_ids
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={7: 100})
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llama_llm.generate([PROMPT, OTHER, PROMPT], [biased, plain, biased], use_tqdm=False)
    mixed = [o.outputs[0].token_ids for o in outs]
    assert mixed == [[7] * 8, alone, [7] * 8]


def first_word(tok, out, n):
    """The first output position k whose n tokens come back from their text as vLLM
    tokenizes a bad word (the word alone, and with a leading space when that has as many
    tokens), with that text."""
    for k in range(len(out) - n):
        word = tok.decode(out[k : k + n]).lstrip()
        plain = tok.encode(word, add_special_tokens=False)
        spaced = tok.encode(" " + word, add_special_tokens=False)
        if out[k : k + n] == plain or (out[k : k + n] == spaced and len(spaced) == len(plain)):
            return k, word
    pytest.fail(f"no {n}-token word of the output tokenizes back to itself")


@pytest.mark.parametrize("n", [1, 2])
def test_bad_words(llama_llm, plain, n):
    """A bad word's last token is masked right after the rest of it (a word of one token:
    always)."""
    out = plain.token_ids
    k, word = first_word(llama_llm.get_tokenizer(), out, n)
    got = run(llama_llm, [PROMPT], temperature=0, bad_words=[word])[0].token_ids
    assert got[: k + n - 1] == out[: k + n - 1] and got[k + n - 1] != out[k + n - 1]
    assert all(got[i : i + n] != out[k : k + n] for i in range(len(got) - n + 1))


@pytest.mark.parametrize(
    "params, message",
    [
        ({"logit_bias": {10**9: 1.0}}, "out-of-vocab"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias must map token ids"),
        ({"logit_bias": {1: float("nan")}}, "finite"),
        ({"allowed_token_ids": []}, "empty"),
        ({"allowed_token_ids": [-1]}, "out-of-vocab"),
        ({"bad_words": [3]}, "list of strings"),
    ],
)
def test_bad_values_are_refused(llama_llm, params, message):
    with pytest.raises(ValueError, match=message):
        run(llama_llm, [PROMPT], **params)

"""`LLM.beam_search` against transformers' beam search on a tiny model: the same top beam
(EOS ignored, so every beam has max_tokens and the length penalty does not reorder them),
cumulative logprobs against teacher forcing, and EOS handling by hand."""

from __future__ import annotations

import pytest
import torch
import transformers
from oracle import prompt_ids, teacher_forced_logprobs

from jllm import BeamSearchParams, SamplingParams
from jllm.beam_search import BeamSearch, BeamSearchOutput, beam_search_score
from jllm.outputs import CompletionOutput, Logprob, RequestOutput

MAX_TOKENS = 6


def hf_beams(model_dir, prompt, width):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,  # no EOS, as ignore_eos
            early_stopping=True,
            length_penalty=1.0,
            pad_token_id=0,
        )
    return model, [seq[len(prompt) :].tolist() for seq in out]


@pytest.mark.parametrize("width", [2, 4])
def test_top_beams_match_transformers(llama_llm, llama_dir, width):
    prompts = prompt_ids(2, 9, seed=60)
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llama_llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(prompts, outs, strict=True):
        model, want = hf_beams(llama_dir, prompt, width)
        got = [seq.tokens[len(prompt) :] for seq in out.sequences]
        assert len(got) == width and got[0] == want[0]
        assert sorted(map(tuple, got)) == sorted(map(tuple, want))
        for seq in out.sequences:
            assert seq.tokens[: len(prompt)] == prompt and seq.finish_reason == "length"
            ref = teacher_forced_logprobs(model, prompt, seq.tokens[len(prompt) :])
            cum = sum(ref[i, t].item() for i, t in enumerate(seq.tokens[len(prompt) :]))
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert len(seq.logprobs) == MAX_TOKENS
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    # The best beam is what greedy search cannot beat.
    greedy = llama_llm.generate(
        {"prompt_token_ids": prompts[0]},
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ref = teacher_forced_logprobs(model, prompts[0], greedy.token_ids)
    greedy_cum = sum(ref[i, t].item() for i, t in enumerate(greedy.token_ids))
    assert outs[0].sequences[0].cum_logprob >= greedy_cum - 1e-3


def fake_step(entries):
    """RequestOutputs whose step logprobs are the given {token: logprob} dicts."""
    return [
        RequestOutput(
            "x",
            None,
            [],
            None,
            [CompletionOutput(0, "", [], None, [{t: Logprob(lp) for t, lp in e.items()}])],
            True,
        )
        for e in entries
    ]


def test_eos_completes_a_beam_and_length_penalty_ranks():
    """By hand: width 2, EOS = 9. Step 1 from the prompt: 9 (EOS, completed at -0.1),
    5 (-0.5), 6 (-1.0). Step 2: beam 5 -> 7 (-0.2), beam 6 -> 8 (-0.1)."""
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    search = BeamSearch("p", [1, 2], params, eos_ids={9})
    search.advance(fake_step([{9: -0.1, 5: -0.5, 6: -1.0}]))
    assert [b.tokens for b in search.beams] == [[1, 2, 5], [1, 2, 6]]
    assert [b.tokens for b in search.completed] == [[1, 2, 9]]
    search.advance(fake_step([{7: -0.2}, {8: -0.1}]))
    assert search.done
    best = search.best()
    # Scores: [9]: -0.1 / 1; [5, 7]: -0.7 / 2 = -0.35; [6, 8]: -1.1 / 2 = -0.55.
    assert [b.tokens[2:] for b in best] == [[9], [5, 7]]
    assert best[0].finish_reason == "stop" and best[1].finish_reason == "length"
    assert beam_search_score(2, -0.7, 1.0) == pytest.approx(-0.35)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)


def test_salted_beams_share_only_their_salt(llama_llm):
    """Every beam of a salted prompt runs under its salt: the blocks the search fills are
    found by the same salt, never by an unsalted request (nor another salt)."""
    prompt = prompt_ids(1, 40, seed=61)[0]
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    assert llama_llm.reset_prefix_cache()
    llama_llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], params)
    one = SamplingParams(temperature=0, max_tokens=1)

    def cached(**salt):
        out = llama_llm.generate({"prompt_token_ids": prompt, **salt}, one, use_tqdm=False)
        return out[0].num_cached_tokens

    assert cached() == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") >= 32

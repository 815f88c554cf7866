"""The LLM API end to end on a tiny model: prompt forms, sampling, seeds, n, stops, errors."""

from __future__ import annotations

import pytest
from oracle import prompt_ids

from jllm import LLM, SamplingParams


def test_prompt_forms_and_order(llama_llm):
    tok = llama_llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    text = "The quick brown fox"
    by_text = llama_llm.generate(text, greedy, use_tqdm=False)[0]
    assert by_text.prompt == text
    assert by_text.prompt_token_ids == tok.encode(text)
    by_ids = llama_llm.generate({"prompt_token_ids": tok.encode(text)}, greedy, use_tqdm=False)
    assert by_ids[0].outputs[0].token_ids == by_text.outputs[0].token_ids
    by_dict = llama_llm.generate([{"prompt": text}], greedy, use_tqdm=False)[0]
    assert by_dict.outputs[0].token_ids == by_text.outputs[0].token_ids
    out = by_text.outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    # One SamplingParams per prompt, outputs in input order.
    many = llama_llm.generate(
        ["a", "bb", "ccc"],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3)],
        use_tqdm=False,
    )
    assert [o.prompt for o in many] == ["a", "bb", "ccc"]
    assert [len(o.outputs[0].token_ids) for o in many] == [1, 2, 3]
    assert [o.request_id for o in many] == sorted((o.request_id for o in many), key=int)


def test_seed_gives_same_text_whatever_the_batch(llama_llm):
    p = {"prompt_token_ids": prompt_ids(1, 9, seed=2)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llama_llm.generate(p, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in prompt_ids(4, 5, seed=9)]
    mixed = llama_llm.generate(
        others + [p],
        [SamplingParams(temperature=0.8, max_tokens=20)] * 4 + [seeded],
        use_tqdm=False,
    )
    assert mixed[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16)
    assert llama_llm.generate(p, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_shares_prompt_and_differs(llama_llm):
    p = {"prompt_token_ids": prompt_ids(1, 40, seed=4)[0]}
    kv = llama_llm.llm_engine.scheduler.kv_cache
    hits = kv.prefix_hits
    out = llama_llm.generate(p, SamplingParams(n=3, temperature=1.0, max_tokens=8), use_tqdm=False)
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in comps}) > 1
    # The siblings reuse the first sequence's full prompt blocks.
    assert kv.prefix_hits - hits >= 2 * 32


def test_stop_strings_tokens_and_lengths(llama_llm):
    greedy = dict(temperature=0, ignore_eos=True)
    p = "Once upon a time"
    full = llama_llm.generate(p, SamplingParams(max_tokens=20, **greedy), use_tqdm=False)[0]
    full = full.outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    cut = llama_llm.generate(p, SamplingParams(max_tokens=20, stop=[stop], **greedy), False)[0]
    cut = cut.outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llama_llm.generate(
        p,
        SamplingParams(max_tokens=20, stop=stop, include_stop_str_in_output=True, **greedy),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    # stop_token_ids: stop on the 4th generated token.
    tid = full.token_ids[3]
    first = full.token_ids.index(tid)
    by_id = llama_llm.generate(
        p, SamplingParams(max_tokens=20, stop_token_ids=[tid], **greedy), use_tqdm=False
    )[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tid
    assert by_id.token_ids == full.token_ids[: first + 1]
    # min_tokens suppresses the stop id until enough tokens exist.
    later = llama_llm.generate(
        p,
        SamplingParams(max_tokens=20, min_tokens=first + 2, stop_token_ids=[tid], **greedy),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(later.token_ids) >= first + 2
    assert tid not in later.token_ids[: first + 2]


def test_eos_stops_unless_ignored(llama_llm):
    eos = llama_llm.get_tokenizer().eos_token_id
    # ignore_eos=True never stops early, so every output runs to max_tokens.
    outs = llama_llm.generate(
        [{"prompt_token_ids": q} for q in prompt_ids(6, 4, seed=11)],
        SamplingParams(temperature=1.5, max_tokens=30, ignore_eos=True, seed=0),
        use_tqdm=False,
    )
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    stopped = llama_llm.generate(
        [{"prompt_token_ids": q} for q in prompt_ids(6, 4, seed=11)],
        SamplingParams(temperature=1.5, max_tokens=30, seed=0, stop_token_ids=[eos]),
        use_tqdm=False,
    )
    for o in stopped:
        ids = o.outputs[0].token_ids
        assert eos not in ids[:-1]
        assert (ids[-1] == eos) == (o.outputs[0].finish_reason == "stop")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"prompt_logprobs": -3}, "prompt_logprobs"),
        ({"logprobs": -2}, "logprobs"),
    ],
)
def test_invalid_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_requests_leave_engine_serving(llama_llm):
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = llama_llm.generate("hello", good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="maximum model length of 512"):
        llama_llm.generate(["hello", {"prompt_token_ids": [5] * 600}], good, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llama_llm.generate("hello", SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llama_llm.generate(["a", "b"], [good], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llama_llm.generate({"prompt_token_ids": [10**6]}, good, use_tqdm=False)
    assert not llama_llm.llm_engine.has_unfinished_requests()
    assert llama_llm.generate("hello", good, use_tqdm=False)[0].outputs[0].token_ids == before


def test_engine_arguments_are_checked(llama_dir, tmp_path):
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(llama_dir, not_an_arg=1)
    with pytest.raises(ValueError, match="quantization"):
        LLM(llama_dir, quantization="awq")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(llama_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=100_000)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing-model"))


def test_chat_single_and_batch(llama_llm):
    tok = llama_llm.get_tokenizer()
    conv = [{"role": "user", "content": "Hi there"}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one = llama_llm.chat(conv, greedy, use_tqdm=False)
    expected_prompt = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert one[0].prompt == expected_prompt
    assert one[0].prompt_token_ids == tok.encode(expected_prompt, add_special_tokens=False)
    two = llama_llm.chat([conv, conv + [{"role": "assistant", "content": "Yo"}]], greedy, False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    custom = llama_llm.chat(conv, greedy, use_tqdm=False, chat_template="{{ 'X: ' }}")
    assert custom[0].prompt == "X: "


def test_cache_salt_separates_prefix_cache_hits(llama_llm):
    ids = prompt_ids(1, 40, seed=11)[0]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def cached(**salt):
        out = llama_llm.generate({"prompt_token_ids": ids, **salt}, greedy, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = cached(cache_salt="alice")
    assert first[0] == 0
    assert cached(cache_salt="alice") == (32, first[1])  # same tenant: its full blocks hit
    assert cached(cache_salt="bob") == (0, first[1])  # another tenant: nothing shared
    assert cached() == (0, first[1])  # no salt: nothing shared with salted requests


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "hi", "cache_salt": 5}, "cache_salt"),
        ({"prompt": "hi", "salt": "x"}, "Unknown prompt field 'salt'"),
        ({"prompt": "hi", "multi_modal_data": {}}, "this model takes text only"),
        ({"prompt": "hi", "multi_modal_uuids": {}}, "'multi_modal_uuids' is not supported"),
    ],
)
def test_bad_prompt_dicts_are_refused(llama_llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llama_llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)


def test_priority_scheduling(llama_dir, llama_llm):
    """One sequence at a time: requests start in priority order (ties by arrival), and
    their outputs are what they are alone."""
    from oracle import SMALL

    llm = LLM(llama_dir, **{**SMALL, "max_num_seqs": 1, "scheduling_policy": "priority"})
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(4, 6, seed=40)]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False, priority=[3, 0, 7, 0])
    starts = [o.metrics.first_scheduled_time for o in outs]
    assert sorted(range(4), key=lambda i: starts[i]) == [1, 3, 0, 2]
    alone = llama_llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    with pytest.raises(ValueError, match="lengths of prompts"):
        llm.generate(prompts, greedy, priority=[1])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(llama_dir, scheduling_policy="lifo", **SMALL)


def test_reset_prefix_cache(llama_llm):
    """vLLM's `LLM.reset_prefix_cache()`: the next run of a prompt hits nothing; refused
    (False, nothing forgotten) while a request holds blocks."""
    prompt = {"prompt_token_ids": prompt_ids(1, 40, seed=77)[0]}
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llama_llm.generate(prompt, greedy, use_tqdm=False)[0]
    hit = llama_llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 32
    assert llama_llm.reset_prefix_cache()
    cold = llama_llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == first.outputs[0].token_ids
    engine = llama_llm.llm_engine
    engine.add_request("held", *engine.prepare(prompt, greedy))
    engine.step()  # admitted: it holds blocks now
    assert not llama_llm.reset_prefix_cache()
    while engine.has_unfinished_requests():
        engine.step()
    assert llama_llm.reset_prefix_cache()

"""The embedded SmolLM2-135M-Instruct GGUF end to end against transformers.

The oracle is transformers' LlamaForCausalLM holding the same dequantized weights (the loader
tests check those bit for bit against transformers' own GGUF reader). The exact comparisons
run the engine in float32; the default dtype (bf16 on an AMX CPU) is checked teacher-forced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import transformers
from oracle import (
    same_outputs,
    spec_counts,
    teacher_forced_logprobs,
    with_metrics,
    worst_teacher_forced_gaps,
)

from jllm import LLM, SamplingParams
from jllm.engine.platform import cpu_bf16_isa
from jllm.model_loader import resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the moon.",
]
MAX_TOKENS = 24


ARGS = dict(
    dtype="float32",
    max_num_seqs=4,
    max_num_batched_tokens=128,
    kv_cache_memory_bytes=64 << 20,
    max_model_len=1024,  # what 64 MiB holds of one request (the start-up check)
    enforce_eager=True,
    disable_log_stats=True,
)


@pytest.fixture(scope="module")
def smollm():
    return LLM(**ARGS)


@pytest.fixture(scope="module")
def source():
    """The embedded file, parsed once for the module (its tokenizer's metadata takes seconds)."""
    return resolve_model(None)


@pytest.fixture(scope="module")
def oracle(source):
    """transformers' model on the embedded file's weights, built once for the module (each
    build dequantizes every tensor); generation ignores EOS."""
    model = hf_model(source)
    model.generation_config.eos_token_id = None
    return model


def hf_model(source):
    config = transformers.LlamaConfig(**source.hf_config.to_dict())
    model = transformers.LlamaForCausalLM(config).eval()
    state = {name: torch.from_numpy(w.copy()) for name, w in source.iter_weights()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm, oracle):
    tok = smollm.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = smollm.chat(convs, params, use_tqdm=False)
    for conv, out in zip(convs, outs, strict=True):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        assert out.prompt_token_ids == list(ids)
        with torch.no_grad():
            ref = oracle.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow
def test_smollm2_stops_on_end_of_turn(smollm):
    out = smollm.chat(
        [{"role": "user", "content": "Say hello."}],
        SamplingParams(temperature=0, max_tokens=200),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == smollm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in out.text


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm):
    """9 query heads and 3 kv heads over 3 fake CPU devices (tests/conftest.py)."""
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = smollm.chat(convs, params, use_tqdm=False)
    tp3 = LLM(tensor_parallel_size=3, **ARGS)
    assert tp3.llm_engine.runner.kv_cache[0].addressable_shards[0].data.shape[3] == 2
    got = tp3.chat(convs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.slow
def test_smollm2_two_stages_match_one(smollm):
    """30 layers as two pipeline stages of 15 over 2 fake CPU devices: the same greedy
    tokens and logprobs as one device (uneven splits: tests/sharding/)."""
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = smollm.chat(convs, params, use_tqdm=False)
    pp2 = LLM(pipeline_parallel_size=2, **ARGS)
    assert pp2.llm_engine.runner.kv_cache[0].addressable_shards[0].data.shape[0] == 15
    got = pp2.chat(convs, params, use_tqdm=False)
    same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in want])


@pytest.mark.slow
def test_smollm2_default_dtype_against_fp32_oracle(oracle):
    """`LLM()` as a user starts it: bf16 on an AMX CPU (Q4_1 weights count as 16-bit). Its
    greedy tokens stay the float32 oracle's argmax or within bf16's error of it."""
    llm = LLM(**{**ARGS, "dtype": "auto"})
    assert llm.llm_engine.dtype == (jnp.bfloat16 if cpu_bf16_isa() else jnp.float32)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.chat(convs, params, use_tqdm=False)
    runs = [(out.prompt_token_ids, out.outputs[0]) for out in outs]
    gap, error = worst_teacher_forced_gaps(oracle, runs)
    print(f"worst choice gap {gap:.3f}, worst logprob error {error:.3f}")
    assert gap <= 0.2 and error <= 0.3, (gap, error)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow
def test_seeded_chat_same_text_alone_cached_and_batched(smollm):
    """The reported case: a seeded top-p request run alone three times (the second and third
    hit the prefix cache, so their last step has fewer rows) and inside a batch of three
    gives one text."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS)
    story = "Tell me a story about a dragon who learns to fly over mountains and rivers."
    conv = [{"role": "user", "content": story}]
    assert smollm.reset_prefix_cache()
    runs = [smollm.chat(conv, params, use_tqdm=False)[0] for _ in range(3)]
    assert runs[0].num_cached_tokens == 0 and runs[1].num_cached_tokens > 0
    others = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    batched = smollm.chat([others[0], conv, others[1]], params, use_tqdm=False)[1]
    texts = {o.outputs[0].text for o in runs} | {batched.outputs[0].text}
    assert len(texts) == 1, texts


@pytest.mark.slow
def test_smollm2_structured_outputs_validate(smollm):
    """The real model at temperature 1.0 under a JSON schema, a regex and a choice: every
    output of every seed validates (jsonschema, re.fullmatch, membership)."""
    import json
    import re

    import jsonschema

    from jllm import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "country": {"type": "string", "maxLength": 20},
            "capital": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000},
        },
        "required": ["country", "capital", "population_millions"],
        "additionalProperties": False,
    }
    cases = [
        # Compact JSON: at temperature 1.0 free whitespace between tokens can run to
        # max_tokens.
        (
            "Describe France as JSON.",
            StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        ),
        ("What is 12 times 12?", StructuredOutputsParams(regex=r"[0-9]{1,4}")),
        ("Is the sky green?", StructuredOutputsParams(choice=["Yes", "No"])),
    ]
    convs, params = [], []
    for question, so in cases:
        for seed in range(6):
            convs.append([{"role": "user", "content": question}])
            params.append(
                SamplingParams(temperature=1.0, seed=seed, max_tokens=100, structured_outputs=so)
            )
    outs = smollm.chat(convs, params, use_tqdm=False)
    for i, out in enumerate(outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        if i < 6:
            # strict=False: xgrammar lets bounded strings hold raw control characters.
            jsonschema.validate(json.loads(o.text, strict=False), schema)
        elif i < 12:
            assert re.fullmatch(r"[0-9]{1,4}", o.text)
        else:
            assert o.text in ("Yes", "No")


@pytest.mark.slow
def test_smollm2_ngram_speculation_copies_and_changes_nothing(smollm):
    """A request to repeat a text: n-gram drafts from the prompt are mostly accepted, and the
    greedy chat and a seeded sampled chat equal the engine's without speculation."""
    text = (
        "The engine keeps a paged KV cache, batches requests continuously, splits long "
        "prompts into chunks and caches shared prefixes. Each step runs one compiled "
        "program over a flat batch of prefill and decode rows."
    )
    chat = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    params = [
        SamplingParams(temperature=0, max_tokens=48),
        SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=48),
    ]
    expected = [smollm.chat(chat, p, use_tqdm=False)[0].outputs[0] for p in params]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    llm = LLM(**ARGS, speculative_config={**spec, "prompt_lookup_min": 2})
    got = [llm.chat(chat, p, use_tqdm=False)[0].outputs[0] for p in params]
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids and g.text == e.text
    assert text[:40] in got[0].text  # it did copy
    prom = with_metrics(llm, "smollm2")
    llm.chat(chat, params[0], use_tqdm=False)
    _, drafted, accepted = spec_counts(prom)
    assert accepted > 0.5 * drafted > 0


@pytest.mark.slow
def test_smollm2_from_its_4bit_weights(oracle, source):
    """The embedded SmolLM2 kept as Q4_1 (its Q8_0 embedding also the tied lm_head): in
    float32 its greedy chat is transformers' on gguf-py's dequantized weights and its
    logprobs within 1e-3 of them; the weights take about a third of the dequantized bf16."""
    llm = LLM(quantization="gguf", **ARGS)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = llm.chat(convs, params, use_tqdm=False)
    runs = [(out.prompt_token_ids, out.outputs[0]) for out in outs]
    gap, error = worst_teacher_forced_gaps(oracle, runs)
    print(f"worst choice gap {gap:.2e}, worst logprob error {error:.2e}")
    assert gap == 0.0 and error < 1e-3, (gap, error)
    assert "Paris" in outs[0].outputs[0].text
    stored = sum(a.nbytes for a in jax.tree.leaves(llm.llm_engine.runner.state))
    assert stored < 0.4 * 2 * source.num_params  # bf16 would take 2 bytes each


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3"])  # e5m2 measured once: see below
def test_smollm2_with_an_fp8_kv_cache(kv_cache_dtype, oracle):
    """float32 compute over a float8 KV cache against transformers (float32 throughout),
    teacher-forced on the engine's own greedy chat: the logprob error that rounding K/V to
    float8 costs, bounded, and the answer still right. (e5m2, run the same way once, within
    the bounds given for it; its kernels and engine path are tested on tiny models.)"""
    llm = LLM(kv_cache_dtype=kv_cache_dtype, **ARGS)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = llm.chat(convs, params, use_tqdm=False)
    runs = [(out.prompt_token_ids, out.outputs[0]) for out in outs]
    gap, worst = worst_teacher_forced_gaps(oracle, runs)
    errors = [
        abs(gen.logprobs[i][t].logprob - ref[i, t].item())
        for prompt, gen in runs
        for ref in [teacher_forced_logprobs(oracle, prompt, gen.token_ids)]
        for i, t in enumerate(gen.token_ids)
    ]
    mean = sum(errors) / len(errors)
    print(
        f"{kv_cache_dtype}: choice gap {gap:.3f}, logprob error mean {mean:.3f} worst {worst:.3f}"
    )
    # measured (Zen 4): e4m3 gap 0.186, mean 0.048, worst 0.288; e5m2 gap 0.186, mean 0.099,
    # worst 0.833 (a near tie: the chosen token 0.19 nats below the top in both). On an AVX2
    # Zen 3, e4m3: gap 0.508 and mean 0.050-0.060 with the C++ kernel and the XLA attention
    # alike, worst 0.41-0.71 as the summation order changed. Rounding to float8 is not
    # continuous: a float32 difference in the last bit moves a K/V value by a whole float8
    # step where it sits at a rounding boundary, so the single worst token and the near tie
    # move by tenths of a nat between machines; the mean is the tight bound.
    assert gap < 0.75 and mean < (0.08 if kv_cache_dtype == "fp8_e4m3" else 0.15)
    assert worst < (1.0 if kv_cache_dtype == "fp8_e4m3" else 1.5)
    assert "Paris" in outs[0].outputs[0].text

"""The batch-invariant mode (`batch_invariant=True`, vLLM's VLLM_BATCH_INVARIANT=1): a
request's tokens and logprobs are the same bits alone, in one batch, in the reversed batch,
chunked at a 32-token budget, preempted, at max_num_seqs=3 and from the prefix cache; and the
logprob a decode step reports equals the prompt logprob of the same token when the sequence
is prefilled. The embedded SmolLM2 in bf16 (head dim 64: the attention kernel's vector
routine), a tiny Llama in float32 (head dim 16: its scalar one) and a tiny Mixtral in
float32 (its router and experts), 12 requests each, greedy and seeded. The kernels' own
properties are in tests/pallas_kernels/test_batch_invariant_kernels.py, the fixed-order ops'
in tests/models/test_invariant_ops.py."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import prompt_ids

from jllm import LLM, SamplingParams
from jllm.models import f32_matmul

BASE = dict(
    max_num_seqs=16,
    max_num_batched_tokens=256,
    kv_cache_memory_bytes=32 << 20,
    max_model_len=512,
    enforce_eager=True,
    disable_log_stats=True,
    batch_invariant=True,
)


def params(i: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded at temperature 0.8; the sampled token's
    logprob always."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=0.8, seed=i, max_tokens=10, ignore_eos=True, logprobs=0)


PROMPTS = prompt_ids(6, 5, seed=11) + prompt_ids(4, 23, seed=12)
SHARED = PROMPTS[-1][:17]
PROMPTS += [SHARED + [101, 102], SHARED + [7, 8, 9, 10, 11]]  # a shared 16-token block


def run(llm, order):
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[i]} for i in order],
        [params(i) for i in order],
        use_tqdm=False,
    )
    result = {}
    for i, out in zip(order, outs, strict=True):
        seq = out.outputs[0]
        pairs = zip(seq.logprobs, seq.token_ids, strict=True)
        bits = np.array([d[t].logprob for d, t in pairs], np.float32)
        result[i] = (list(seq.token_ids), bits.view(np.int32).tolist())
    return result


@pytest.fixture(scope="module", params=["smollm2-bf16", "tiny-float32", "mixtral-float32"])
def model(request, tiny_models):
    if request.param == "smollm2-bf16":
        return dict(model=None, dtype="bfloat16")
    arch = "llama" if request.param == "tiny-float32" else "mixtral"
    return dict(model=tiny_models[arch], dtype="float32")


@pytest.fixture(scope="module")
def engine(model):
    return LLM(**model, **BASE)


@pytest.fixture(scope="module")
def alone(engine):
    return {i: run(engine, [i])[i] for i in range(len(PROMPTS))}


def test_a_batch_in_any_order_and_a_prefix_cache_rerun_equal_each_request_alone(engine, alone):
    every = list(range(len(PROMPTS)))
    assert run(engine, every) == alone
    assert run(engine, every[::-1]) == alone
    hits = engine.llm_engine.scheduler.kv_cache.prefix_hits
    assert run(engine, every) == alone  # every full block is cached now
    assert engine.llm_engine.scheduler.kv_cache.prefix_hits > hits


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 32},
        {"num_gpu_blocks_override": 6, "max_num_batched_tokens": 32},
        {"max_num_seqs": 3},
        {"async_scheduling": True},
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 3,
            }
        },
    ],
    ids=["chunked-32", "preempted", "max-num-seqs-3", "async", "ngram"],
)
def test_other_layouts_equal_each_request_alone(model, alone, settings):
    llm = LLM(**model, **{**BASE, **settings})
    assert run(llm, list(range(len(PROMPTS)))) == alone
    if "num_gpu_blocks_override" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_a_sequence_of_n2_equals_the_same_seed_alone(engine, alone):
    """Sequence j of an n=2 request draws with seed + j: the first is request i's own."""
    i = 1  # seeded: params(1)'s fields, two sequences
    pair = SamplingParams(temperature=0.8, seed=i, max_tokens=10, ignore_eos=True, logprobs=0, n=2)
    out = engine.generate([{"prompt_token_ids": PROMPTS[i]}], pair, use_tqdm=False)[0]
    first = out.outputs[0]
    pairs = zip(first.logprobs, first.token_ids, strict=True)
    bits = np.array([d[t].logprob for d, t in pairs], np.float32).view(np.int32).tolist()
    assert (list(first.token_ids), bits) == alone[i]


def test_decode_logprobs_equal_the_prefilled_sequences_prompt_logprobs(engine, alone):
    for i in range(0, len(PROMPTS), 3):
        tokens, bits = alone[i]
        full = PROMPTS[i] + tokens
        once = SamplingParams(max_tokens=1, prompt_logprobs=0)
        out = engine.generate([{"prompt_token_ids": full}], once, use_tqdm=False)[0]
        start = len(PROMPTS[i])
        lps = [out.prompt_logprobs[start + j][t].logprob for j, t in enumerate(tokens)]
        assert np.array(lps, np.float32).view(np.int32).tolist() == bits


def test_where_it_is_not_built_it_is_refused(llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="cpu_kernel"):
        LLM(llama_dir, **{**BASE, "attention_backend": "xla"})
    with pytest.raises(ValueError, match="one device"):
        LLM(llama_dir, **{**BASE, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="quantized weights or LoRA"):
        LLM(llama_dir, **{**BASE, "enable_lora": True})
    with pytest.raises(ValueError, match="quantized weights or LoRA"):
        LLM(llama_dir, **{**BASE, "quantization": "fp8"})
    monkeypatch.setattr(f32_matmul, "applies", lambda dtype: False)  # a CPU without FMA
    with pytest.raises(ValueError, match="C\\+\\+ layer products"):
        LLM(llama_dir, **{**BASE, "dtype": "float32"})

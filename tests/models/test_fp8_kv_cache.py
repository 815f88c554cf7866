"""kv_cache_dtype="fp8" / "fp8_e4m3" / "fp8_e5m2": the engine stores K/V as float8 (scale
1.0, as vLLM without calculated scales). Every attention backend reads the same float8
cache the same way (the kernels against the kit's reference: tests/pallas_kernels), the
cache holds twice the tokens of a 16-bit one in the same memory, and the error against the
float cache is that of rounding K/V to float8, bounded here teacher-forced (prompt logprobs)."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from jllm.runner.compile_guard import count_compiles

PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(3, 40, seed=4)]


def prompt_logprobs(llm) -> np.ndarray:
    """Each prompt token's logprob given the ones before (one prefill, read from the cache
    it has just written), all prompts concatenated."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    values = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids, lps = prompt["prompt_token_ids"][1:], out.prompt_logprobs[1:]
        for token, lp in zip(ids, lps, strict=True):
            values.append(lp[token].logprob)
    return np.asarray(values)


@pytest.fixture(scope="module")
def float_logprobs(llama_dir):
    return prompt_logprobs(LLM(llama_dir, dtype="float32", **SMALL))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_on_every_backend(llama_dir, float_logprobs, kv_cache_dtype):
    runs = {}
    for backend in ("cpu_kernel", "xla", "pallas_gpu_interpret"):
        args = {**SMALL, "attention_backend": backend, "max_num_batched_tokens": 32}
        llm = LLM(llama_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, **args)
        runner = llm.llm_engine.runner
        assert runner.kv_cache[0].dtype == np.uint8  # on the CPU: the float8 bytes
        want = "float8_e4m3fn" if kv_cache_dtype == "fp8" else "float8_e5m2"
        assert runner.layout.kv_fp8 == want
        runs[backend] = prompt_logprobs(llm)
    if kv_cache_dtype == "fp8":  # and the cache split over two devices on its kv heads
        llm = LLM(llama_dir, dtype="float32", kv_cache_dtype="fp8", tensor_parallel_size=2, **SMALL)
        runs["cpu_kernel, TP 2"] = prompt_logprobs(llm)
    for backend, lps in runs.items():  # the same float8 values, the same math
        np.testing.assert_allclose(lps, runs["cpu_kernel"], atol=2e-4, err_msg=backend)
    # e4m3 keeps 3 mantissa bits, e5m2 2: K/V off by up to 6% / 12% of their size. This
    # tiny model's wide random weights make sharp attention (prompt logprobs about -13):
    # measured 1.5% (e4m3) and 2.7% (e5m2) of their size on average.
    error = np.abs(runs["cpu_kernel"] - float_logprobs).mean() / np.abs(float_logprobs).mean()
    assert 0 < error < (0.03 if kv_cache_dtype == "fp8" else 0.05), error


def test_fp8_cache_holds_twice_the_tokens(llama_dir):
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8_e4m3"), ("float32", "auto")):
        llm = LLM(llama_dir, dtype=dtype, kv_cache_dtype=kv, **SMALL)
        blocks[dtype, kv] = llm.llm_engine.runner.layout.num_blocks
    assert blocks["bfloat16", "fp8_e4m3"] == 2 * blocks["bfloat16", "auto"]
    assert blocks["bfloat16", "auto"] == 2 * blocks["float32", "auto"]


def test_no_compile_after_warmup_with_an_fp8_cache(llama_dir):
    small = dict(max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=False)
    llm = LLM(llama_dir, kv_cache_dtype="fp8", **{**SMALL, **small})
    params = [SamplingParams(temperature=t, max_tokens=6, seed=1) for t in (0, 0.8, 1)]
    with count_compiles() as events:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert events == []


def test_unknown_kv_cache_dtype_is_refused(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(llama_dir, kv_cache_dtype="int4")

"""Every bucket is compiled at start-up: a varied workload afterwards compiles nothing."""

from __future__ import annotations

import pytest
from oracle import prompt_ids

from jllm import LLM, SamplingParams
from jllm.runner.compile_guard import CompileAfterWarmupError, count_compiles


@pytest.mark.slow
def test_no_compile_after_warmup(llama_dir):
    llm = LLM(
        llama_dir,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        disable_log_stats=True,
    )
    runner = llm.llm_engine.runner
    assert runner.compile_guard
    assert sorted(runner.table.details("forward")) == sorted(runner.layout.shapes())
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(7, 3, seed=1)]
    prompts.append({"prompt_token_ids": prompt_ids(1, 150, seed=2)[0]})  # chunked
    mixed = [
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=20, max_tokens=12, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, max_tokens=5, logprobs=3),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, max_tokens=7),
        SamplingParams(n=2, temperature=0.7, max_tokens=6, stop=["the"]),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10, frequency_penalty=0.3),
        SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4),
    ]
    with count_compiles() as events:
        outs = llm.generate(prompts, mixed, use_tqdm=False)
        outs += llm.chat([{"role": "user", "content": "hi"}], mixed[1], use_tqdm=False)
    assert len(outs) == 9
    assert events == []


@pytest.mark.slow
def test_buckets_compiled_on_threads(llama_dir):
    """The accelerator path of `compile_all` (several buckets compiling at once, as on a GPU
    host) compiles every bucket: a workload afterwards compiles nothing."""
    llm = LLM(
        llama_dir,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        disable_log_stats=True,
        enforce_eager=True,
    )
    runner = llm.llm_engine.runner
    runner.enforce_eager, runner.compile_workers = False, 2
    runner.compile_all()
    assert set(runner.table.details("forward")) == set(runner.layout.shapes())
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(5, 3, seed=1)]
    prompts.append({"prompt_token_ids": prompt_ids(1, 70, seed=2)[0]})  # chunked
    with count_compiles() as events:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), False
        )
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 6
    assert events == []


def test_guard_refuses_unknown_bucket(llama_llm):
    runner = llama_llm.llm_engine.runner
    runner.compile_guard = True
    try:
        with pytest.raises(CompileAfterWarmupError):
            runner.forward_for((3, 3))
    finally:
        runner.compile_guard = False


@pytest.mark.slow
def test_no_compile_after_warmup_with_prompt_embeds(llama_dir):
    """enable_prompt_embeds widens every step's inputs (a row per token slot), compiled at
    start-up like the rest: embeddings prompts, chunked and beside token prompts, compile
    nothing afterwards."""
    import numpy as np

    llm = LLM(
        llama_dir,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_model_len=128,
        enable_prompt_embeds=True,
        disable_log_stats=True,
    )
    assert llm.llm_engine.runner.compile_guard
    rows = np.random.default_rng(0).normal(0, 0.25, (70, 64)).astype(np.float32)
    prompts = [{"prompt_embeds": rows}, {"prompt_embeds": rows[:5]}]
    prompts.append({"prompt_token_ids": prompt_ids(1, 9, seed=3)[0]})
    with count_compiles() as events:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert events == []


def test_the_tables_compiler_options_reach_xla():
    """An eager GPU engine compiles later steps without XLA's autotuner (the cache holds the
    memory it would time candidates in): the table's options go to every compile."""
    import jax
    import jax.numpy as jnp

    from jllm.runner.executables import ExecutableTable

    table = ExecutableTable(jax.make_mesh((1,), ("model",), devices=jax.devices()[:1]))
    lower = jax.jit(lambda x: x * 2).lower
    x = jnp.ones(4)
    assert table.get("plain", 0, lambda: lower(x))(x).tolist() == [2.0] * 4
    table.compiler_options = {"xla_embed_ir_in_executable": True}  # one every backend takes
    assert table.get("with options", 0, lambda: lower(x))(x).tolist() == [2.0] * 4
    table.compiler_options = {"no_such_xla_option": 1}
    with pytest.raises(Exception, match="no_such_xla_option"):
        table.get("a bad option", 0, lambda: lower(x))

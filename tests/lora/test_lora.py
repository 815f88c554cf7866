"""Multi-LoRA against PEFT: adapters made by PEFT on the tiny Llama (random, non-zero B),
served from one engine mixed with the base model in one batch; each request's greedy tokens
and logprobs are transformers' with that adapter merged (`merge_and_unload`), in float32."""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import transformers
from flax import nnx
from lora_oracle import ADAPTERS, assert_each_matches_merged, lora_requests, oracle
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest


@pytest.fixture(scope="module")
def lora_llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, **SMALL)


def test_mixed_batch_matches_merged_peft(lora_llm, adapters, llama_dir):
    """One batch: base, all8, attn4 (two adapters on the device at once, max_loras=2), then
    a second call with mlp16 (a third adapter: a slot is reused), the same prompts under
    different adapters; every request equals its merged model."""
    prompts = prompt_ids(6, 9, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    names = [None, "all8", "attn4", "all8", None, "attn4"]
    requests = {
        name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(ADAPTERS)
    }
    lora = [None if n is None else requests[n] for n in names]
    outs = lora_llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    for name in (None, "all8", "attn4"):
        idx = [i for i, n in enumerate(names) if n == name]
        model_dir = llama_dir if name is None else adapters[name][1]
        assert oracle(model_dir, [prompts[i] for i in idx], [outs[i] for i in idx]) < 2e-3
    assert outs[1].lora_request == requests["all8"] and outs[0].lora_request is None
    # the same prompt under different adapters gives different tokens
    assert outs[1].outputs[0].token_ids != outs[0].outputs[0].token_ids

    same = [prompts[1]] * 3
    lora = [requests["mlp16"], requests["all8"], None]
    outs2 = lora_llm.generate([{"prompt_token_ids": p} for p in same], params, False, lora)
    assert oracle(adapters["mlp16"][1], same[:1], outs2[:1]) < 2e-3
    assert outs2[1].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert oracle(llama_dir, same[2:], outs2[2:]) < 2e-3


def test_more_adapters_than_slots_in_one_call(lora_llm, adapters):
    """Three adapters and the base in one call with two slots: a request whose adapter has
    no slot waits for one, none is lost and each still matches its merged model."""
    prompts = prompt_ids(4, 7, seed=8)
    names = ["all8", "attn4", "mlp16", None]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    lora = lora_requests(names, adapters)
    outs = lora_llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    for i, name in enumerate(names[:3]):
        assert oracle(adapters[name][1], prompts[i : i + 1], outs[i : i + 1]) < 2e-3


def test_prefix_cache_never_crosses_adapters(lora_llm, adapters):
    """A prompt cached under one adapter is no hit for another adapter or the base, and a
    hit under the same adapter."""
    prompt = {"prompt_token_ids": prompt_ids(1, 40, seed=11)[0]}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    a = LoRARequest("all8", 1, adapters["all8"][0])
    b = LoRARequest("attn4", 2, adapters["attn4"][0])
    first = lora_llm.generate(prompt, params, False, a)[0]
    again = lora_llm.generate(prompt, params, False, a)[0]
    other = lora_llm.generate(prompt, params, False, b)[0]
    base = lora_llm.generate(prompt, params, False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_bad_adapters_are_clear_errors(lora_llm, adapters, llama_dir, tmp_path):
    params = SamplingParams(max_tokens=2)
    bad = tmp_path / "bad"
    shutil.copytree(adapters["all8"][0], bad)
    config = json.loads((bad / "adapter_config.json").read_text())

    def check(match, request):
        with pytest.raises(ValueError, match=match):
            lora_llm.generate("hi", params, False, request)

    check("is not a directory", LoRARequest("x", 9, str(tmp_path / "missing")))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    check("greater than max_lora_rank 16", LoRARequest("x", 9, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
    check(r"target modules \['lm_head'\]", LoRARequest("x", 9, str(bad)))
    (bad / "adapter_config.json").write_text("{not json")
    check("adapter_config.json", LoRARequest("x", 9, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    check("DoRA", LoRARequest("x", 9, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps(config))
    (bad / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    check("cannot be read", LoRARequest("x", 9, str(bad)))
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("x", 0, str(bad))
    # the engine still serves
    assert lora_llm.generate("hi", params, False)[0].outputs[0].token_ids


def test_adapter_for_another_model_is_refused(lora_llm, tmp_path):
    other = transformers.LlamaConfig(
        vocab_size=lora_llm.llm_engine.model_config.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(other), peft.LoraConfig(r=4, target_modules=["q_proj"])
    )
    model.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="an adapter for another model"):
        lora_llm.generate(
            "hi", SamplingParams(max_tokens=2), False, LoRARequest("o", 5, str(tmp_path / "other"))
        )


def test_lora_needs_enable_lora(llama_llm, adapters):
    with pytest.raises(ValueError, match="enable_lora=True"):
        llama_llm.generate(
            "hi", SamplingParams(max_tokens=2), False, LoRARequest("a", 1, adapters["all8"][0])
        )


def test_engine_arguments_checked():
    from jllm.config import EngineArgs

    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(max_lora_rank=12)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(max_loras=4, max_cpu_loras=2)
    assert EngineArgs(max_loras=3).max_cpu_loras == 3


def test_tensor_parallel_and_no_compile_after_warmup(llama_dir, adapters):
    """TP = 2 on fake devices (A and B split as their projections: the test checks the
    output, the sharding is the rules'), every bucket compiled at start-up with the slot
    arrays in the step, and a workload that swaps adapters through the slots compiles
    nothing: writing a slot is one executable compiled at start-up."""
    from jllm.runner.compile_guard import count_compiles

    llm = LLM(
        llama_dir,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=16,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        disable_log_stats=True,
    )
    runner = llm.llm_engine.runner
    (q_b,) = [
        v.get_value() for p, v in nnx.to_flat_state(runner.state) if p[-2:] == ("q_proj", "lora_b")
    ]
    assert "model" in tuple(q_b.sharding.spec)  # B of a column-parallel projection is split
    prompts = prompt_ids(3, 7, seed=21)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    names = ["mlp16", "all8", None]
    lora = lora_requests(names, adapters)
    with count_compiles() as events:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    assert events == []
    assert_each_matches_merged(llama_dir, adapters, names, prompts, outs)


def test_chunked_prefill_and_preemption_keep_the_adapter(llama_dir, adapters):
    """Prompts longer than the step budget (chunked prefill) and a block pool too small for
    every request at once (preemption, then recompute, possibly into another slot): each
    request still equals its merged model."""
    small = {**SMALL, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, num_gpu_blocks_override=10, **small)
    names = ["all8", "attn4", None, "mlp16"]
    prompts = prompt_ids(4, 30, seed=31)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    lora = lora_requests(names, adapters)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_each_matches_merged(llama_dir, adapters, names, prompts, outs)


def test_fully_sharded_loras(llama_dir, adapters):
    """fully_sharded_loras at TP = 2: A of a column-parallel projection splits on its rank
    and B of a row-parallel one on its output (besides the halves the weights imply), and
    the outputs still equal the merged models."""
    llm = LLM(
        llama_dir,
        enable_lora=True,
        max_loras=2,
        fully_sharded_loras=True,
        tensor_parallel_size=2,
        **SMALL,
    )
    specs = {
        p[-2:]: tuple(v.get_value().sharding.spec)
        for p, v in nnx.to_flat_state(llm.llm_engine.runner.state)
        if p[-1] in ("lora_a", "lora_b")
    }
    assert specs["q_proj", "lora_a"][-1] == "model"  # [L, S, D, R]: the rank
    assert specs["q_proj", "lora_b"][3] == "model"  # [L, S, R, N, H]: the heads
    assert specs["o_proj", "lora_a"][2] == "model"  # [L, S, N, H, R]: the heads
    assert specs["down_proj", "lora_b"][-1] == "model"  # [L, S, R, D]: the output
    prompts = prompt_ids(3, 7, seed=41)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    names = ["all8", "mlp16", None]
    lora = lora_requests(names, adapters)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    assert_each_matches_merged(llama_dir, adapters, names, prompts, outs)


def test_beam_search_with_an_adapter(lora_llm, adapters):
    """LLM.beam_search with a lora_request per prompt gives the beams of the same search on
    the merged model (a second engine over PEFT's merged folder)."""
    from jllm import BeamSearchParams

    prompts = [{"prompt_token_ids": p} for p in prompt_ids(2, 8, seed=51)]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    lora = [LoRARequest("all8", 1, adapters["all8"][0]), None]
    got = lora_llm.beam_search(prompts, params, lora_request=lora)
    merged = LLM(adapters["all8"][1], **SMALL)
    want = merged.beam_search(prompts[:1], params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in want[0].sequences]
    for a, b in zip(got[0].sequences, want[0].sequences, strict=True):
        assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-3)
    base = lora_llm.beam_search(prompts[1:], params)
    assert [s.tokens for s in got[1].sequences] == [s.tokens for s in base[0].sequences]


def test_data_parallel_shards_share_the_slots(llama_dir, adapters):
    """DP = 2 on fake devices: both shards' requests draw adapters from the engine's one set
    of slots (here one slot, so the shards wait for each other's adapter to leave it), and
    each request's tokens and logprobs are its merged model's."""
    llm = LLM(
        llama_dir,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=16,
        data_parallel_size=2,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enforce_eager=True,
        disable_log_stats=True,
    )
    prompts = prompt_ids(6, 7, seed=22)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    names = ["mlp16", "all8", None, "all8", "mlp16", None]
    lora = lora_requests(names, adapters)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    assert_each_matches_merged(llama_dir, adapters, names, prompts, outs)
    shards = llm.llm_engine.scheduler.shards
    assert all(s.kv_cache.prefix_queries > 0 for s in shards)

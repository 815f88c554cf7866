"""Data parallelism on fake CPU devices: DP = 2 (and DP = 2 x TP = 2) gives, per request,
one replica's tokens and logprobs (float32) for dense, sliding-window and MoE models, with
penalties, logit bias, seeds, prompt logprobs, structured outputs, chunked prefill,
preemption within a shard and async scheduling; requests spread over both shards' caches,
a prefix goes back to the shard that holds it, and what does not split yet is refused by
name."""

from __future__ import annotations

import pytest
from flax import nnx
from oracle import SMALL, assert_matches, eager, generate, prompt_ids, same_outputs, save_copier

from jllm import LLM, SamplingParams
from jllm.sampling_params import StructuredOutputsParams

PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(5, 7) + prompt_ids(3, 40, seed=2)]
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
    SamplingParams(
        temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=1, presence_penalty=0.5
    ),
    SamplingParams(
        temperature=0.8,
        seed=5,
        max_tokens=6,
        ignore_eos=True,
        prompt_logprobs=1,
        logit_bias={5: 3.0},
        logprobs=0,
    ),
    SamplingParams(
        temperature=0.7, top_k=20, seed=9, max_tokens=7, ignore_eos=True, repetition_penalty=1.3
    ),
] * 2
MIXED = MIXED[: len(PROMPTS)]


def outputs(llm, prompts=PROMPTS, params=MIXED):
    return llm.generate(prompts, params, use_tqdm=False)


def same(got, expected) -> None:
    same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in expected])
    for g, e in zip(got, expected, strict=True):
        if e.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        for lg, le in zip(g.prompt_logprobs, e.prompt_logprobs, strict=True):
            if le is not None:
                assert lg.keys() == le.keys()
                assert all(abs(lg[t].logprob - le[t].logprob) <= 1e-4 for t in le)


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {
        arch: outputs(LLM(tiny_models[arch], **SMALL))
        for arch in ("llama", "llama-h8kv2", "mistral-window", "mixtral", "llama-l4")
    }


def shards_used(llm) -> list[int]:
    """How many prompt tokens each data shard looked up in its prefix cache."""
    return [s.kv_cache.prefix_queries for s in llm.llm_engine.scheduler.shards]


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", {}),
        ("llama-h8kv2", {"tensor_parallel_size": 2}),
        ("mistral-window", {"max_num_batched_tokens": 32}),  # windows crossed in chunks
        ("mixtral", {"tensor_parallel_size": 2}),
        ("llama-l4", {"pipeline_parallel_size": 2}),
    ],
    ids=["dense", "dp2xtp2", "sliding-window-chunked", "moe-tp2", "dp2xpp2"],
)
def test_two_shards_equal_one_replica(tiny_models, reference, arch, extra):
    llm = LLM(tiny_models[arch], data_parallel_size=2, **(SMALL | extra))
    same(outputs(llm), reference[arch])
    assert all(n > 0 for n in shards_used(llm)), "both shards served requests"
    engine = llm.llm_engine
    (cache,) = engine.runner.kv_cache
    tp = extra.get("tensor_parallel_size", 1) * extra.get("pipeline_parallel_size", 1)
    assert len(cache.sharding.device_set) == 2 * tp
    # Each shard's devices hold its own blocks: the block axis is split in two.
    blocks = engine.scheduler.shards[0].kv_cache.pools[0].num_blocks
    assert cache.shape[1] == 2 * blocks
    assert cache.addressable_shards[0].data.shape[1] == blocks


def test_experts_split_over_data_and_model(tiny_models, reference):
    """DP = 2 x TP = 2 with expert parallelism: Mixtral's 8 experts, 2 per device over all
    4 devices; each shard's tokens reach every expert (gathered over the shards, the
    partial outputs reduced and scattered back) and the outputs are one replica's."""
    llm = LLM(
        tiny_models["mixtral"],
        data_parallel_size=2,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        **SMALL,
    )
    same(outputs(llm), reference["mixtral"])
    runner = llm.llm_engine.runner
    (gate,) = [
        v.get_value()
        for p, v in nnx.to_flat_state(runner.state)
        if p[-2:] == ("experts", "gate_proj")
    ]
    experts = gate.shape[1]  # [L, E, D, F]
    assert experts == 8 and gate.addressable_shards[0].data.shape[1] == experts // 4
    assert len({s.device for s in gate.addressable_shards}) == 4
    hlo = runner.forward_for(runner.layout.shapes()[0]).as_text()
    assert "all-gather" in hlo and "reduce-scatter" in hlo
    assert all(n > 0 for n in shards_used(llm))
    with pytest.raises(ValueError, match="tensor_parallel_size x data_parallel_size"):
        LLM(tiny_models["mixtral"], data_parallel_size=3, enable_expert_parallel=True, **SMALL)


def test_async_scheduling_and_preemption_within_a_shard(tiny_models, reference):
    """Too few blocks for the shard's requests at once: it preempts and recomputes, and the
    outputs are still one replica's; the same with the async loop."""
    small = SMALL | {"num_gpu_blocks_override": 12}
    llm = LLM(tiny_models["llama"], data_parallel_size=2, **small)
    same(outputs(llm), reference["llama"])
    assert llm.llm_engine.scheduler.num_preemptions > 0
    llm = LLM(tiny_models["llama"], data_parallel_size=2, async_scheduling=True, **SMALL)
    same(outputs(llm), reference["llama"])


def test_prefix_goes_to_the_shard_that_holds_it(tiny_models):
    """A prompt whose prefix one shard cached goes there and hits it, whatever the load."""
    llm = LLM(tiny_models["llama"], data_parallel_size=2, **SMALL)
    long = prompt_ids(1, 64, seed=7)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([{"prompt_token_ids": long}], greedy, use_tqdm=False)
    before = [kv.prefix_hits for kv in llm.llm_engine.scheduler.kv_cache.managers]
    followers = [long + tail for tail in prompt_ids(4, 5, seed=8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in followers], greedy, use_tqdm=False)
    assert all(o.num_cached_tokens == 64 for o in outs)
    managers = llm.llm_engine.scheduler.kv_cache.managers
    hits = [kv.prefix_hits - b for kv, b in zip(managers, before, strict=True)]
    assert sorted(hits) == [0, 4 * 64]


def test_load_is_spread_round_robin(tiny_models):
    """Equal requests on empty shards alternate (vLLM's balancing by waiting and running)."""
    llm = LLM(tiny_models["llama"], data_parallel_size=2, **SMALL)
    engine = llm.llm_engine
    for i, p in enumerate(prompt_ids(6, 9, seed=3)):
        engine.add_request(
            str(i), *engine.prepare({"prompt_token_ids": p}, SamplingParams(max_tokens=2))
        )
    owners = [engine.scheduler.owner[f"{i}"] for i in range(6)]
    assert sorted(owners) == [0, 0, 0, 1, 1, 1]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.owner == {}


def test_structured_outputs_on_both_shards(tiny_models):
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    params = [SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=choice)] * 4
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(4, 6, seed=4)]
    one = LLM(tiny_models["llama"], **SMALL).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_models["llama"], data_parallel_size=2, **SMALL)
    two = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in two] == [o.outputs[0].text for o in one]
    assert all(o.outputs[0].text in ("yes", "no", "maybe") for o in two)
    assert all(n > 0 for n in shards_used(llm))


def test_ngram_speculation_on_both_shards(tiny_models, reference):
    """n-gram drafts verified in each shard's rows: the outputs are still one replica's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(tiny_models["llama"], data_parallel_size=2, speculative_config=spec, **SMALL)
    repeating = [{"prompt_token_ids": [5, 6, 7, 8] * 6} for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    one = LLM(tiny_models["llama"], **SMALL).generate(repeating, greedy, use_tqdm=False)
    same(llm.generate(repeating, greedy, use_tqdm=False), one)
    same(outputs(llm), reference["llama"])
    assert all(n > 0 for n in shards_used(llm))


def test_abort_before_a_shard_has_it(tiny_models):
    """A request aborted while its grammar compiles (no shard holds it yet) ends, and the
    engine is left with nothing to do."""
    llm = LLM(tiny_models["llama"], data_parallel_size=2, **SMALL)
    engine = llm.llm_engine
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(max_tokens=4, structured_outputs=choice)
    engine.add_request("g", *engine.prepare({"prompt_token_ids": [5, 6, 7]}, params))
    engine.abort_request(["g"])
    assert engine.core.parents == {} and engine.scheduler.owner == {}
    while engine.has_unfinished_requests():
        engine.step()


def test_no_compile_after_warmup(tiny_models, reference):
    llm = LLM(tiny_models["llama"], data_parallel_size=2, **(SMALL | {"enforce_eager": False}))
    assert llm.llm_engine.runner.compile_guard
    same(outputs(llm), reference["llama"])


def test_sleep_pause_and_weight_updates_reach_every_shard(tiny_models, tmp_path):
    """RL's calls act on both shards: a level-1 sleep frees and wakes both caches and gives
    the same outputs; an update serves the new weights on both (their cached prefixes are
    no longer hits); pause "abort" then resume."""
    llm = LLM(tiny_models["llama"], data_parallel_size=2, enable_sleep_mode=True, **SMALL)
    prompts = prompt_ids(4, 20)
    before = generate(llm, prompts)
    llm.sleep(level=1)
    assert llm.wake_up() is True
    after = generate(llm, prompts)
    same_outputs([o.outputs[0] for o in after], [o.outputs[0] for o in before], 1e-5)
    assert all(n > 0 for n in shards_used(llm))
    model = eager(save_copier(tiny_models["llama"], tmp_path / "copier"))
    llm.start_weight_update()
    llm.update_weights((k, v.numpy()) for k, v in model.state_dict().items())
    llm.finish_weight_update("copier")
    updated = generate(llm, prompts)
    assert all(o.num_cached_tokens == 0 for o in updated)
    assert_matches(model, prompts, updated)
    llm.llm_engine.core.pause_scheduler("abort")
    llm.llm_engine.core.resume_scheduler()
    assert_matches(model, prompts, generate(llm, prompts))


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"enable_return_routed_experts": True}, "routed experts"),
        ({"attention_backend": "xla"}, "the xla attention backend"),
        ({"speculative_config": {"model": "x", "num_speculative_tokens": 2}}, "a draft model"),
        ({"kv_offloading_size": 0.01}, "host KV tier"),
    ],
)
def test_what_does_not_split_is_refused_by_name(tiny_models, extra, named):
    with pytest.raises(ValueError, match=f"data_parallel_size=2 is not supported .*{named}"):
        LLM(tiny_models["llama"], data_parallel_size=2, **(SMALL | extra))


def test_more_devices_than_there_are(tiny_models):
    with pytest.raises(ValueError, match="data_parallel_size=4 x tensor_parallel_size=4"):
        LLM(tiny_models["llama"], data_parallel_size=4, tensor_parallel_size=4, **SMALL)
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        LLM(tiny_models["llama"], data_parallel_size=0, **SMALL)


def test_server_with_two_shards(tiny_models):
    """`--data-parallel-size 2` through the openai client: concurrent requests answer as one
    replica's engine, and /metrics has each shard's queue, KV usage and prefix counts under
    its engine label."""
    import concurrent.futures

    import httpx
    import openai
    from openai_server import MODEL_NAME, serving

    prompts = [f"Count with me: {i}, {i + 1}," for i in range(6)]
    expected = LLM(tiny_models["llama"], **SMALL).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
    )
    with serving(tiny_models["llama"], "--data-parallel-size", "2") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def complete(prompt):
            r = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0.0
            )
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(complete, prompts))
        assert texts == [o.outputs[0].text for o in expected]
        text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        for engine in ("0", "1"):
            assert f'{name}{{engine="{engine}"' in text, (name, engine)
    queries = {
        line.split('engine="')[1][0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_queries_total")
    }
    assert queries.keys() == {"0", "1"} and all(v > 0 for v in queries.values())


def test_vllm_multi_node_flags_map_onto_nodes():
    """vLLM's multi-node data-parallel flags give jllm's nodes (one cluster whose data axis
    spans them); external load balancing is refused, as are sizes that do not divide."""
    from jllm.config import EngineArgs

    args = EngineArgs(
        data_parallel_size=4,
        data_parallel_size_local=2,
        data_parallel_start_rank=2,
        data_parallel_address="10.0.0.1",
        data_parallel_rpc_port=13345,
    )
    assert (args.nnodes, args.node_rank) == (2, 1)
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 13345)
    with pytest.raises(ValueError, match="divide data_parallel_size=4"):
        EngineArgs(data_parallel_size=4, data_parallel_size_local=3)
    with pytest.raises(ValueError, match="multiple of data_parallel_size_local=2"):
        EngineArgs(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=1)
    with pytest.raises(ValueError, match="external load balancing"):
        EngineArgs(data_parallel_size=2, data_parallel_rank=1)

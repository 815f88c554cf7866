"""`enable_return_routed_experts` (vLLM's, for RL routing replay): each finished sequence's
`routed_experts` [prompt + output - 1 - start, layers, top-k] equals the experts transformers'
routers chose when the same sequence is run teacher-forced (float32; dense layers zeros), for
greedy and sampled outputs, and the record crosses the rest of the engine: chunked prefill,
prefix-cache hits (from an earlier request, and from one scheduled in the same step),
preemption, the host KV tier, n-gram speculation, n > 1, async scheduling, TP with expert
parallelism, `routed_experts_prompt_start`, stop strings; what it cannot serve is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import SMALL, eager, prompt_ids

from jllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def oracle_routes(model, seq: list[int]) -> np.ndarray:
    """The experts transformers' routers choose for `seq` [len, layers, k], sorted per
    token (jllm's top-k order is the same, but equal weights may swap); zeros for a dense
    layer's."""
    layers = model.model.layers
    k = model.config.num_experts_per_tok
    chosen = [None] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and type(gate).__name__.endswith("TopKRouter"):

            def keep(module, args, out, i=i):
                chosen[i] = out[2].numpy()

            hooks.append(gate.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for hook in hooks:
            hook.remove()
    zeros = np.zeros((len(seq), k), np.int64)
    return np.sort(np.stack([zeros if c is None else c for c in chosen], 1), -1)


def check(model, prompts, outs, start: int = 0) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        for completion in out.outputs:
            seq = list(prompt) + list(completion.token_ids)[:-1]
            got = completion.routed_experts
            assert got is not None and got.dtype == np.uint8
            assert got.shape == (len(seq) - start, len(model.model.layers), 2)
            np.testing.assert_array_equal(np.sort(got, -1), oracle_routes(model, seq)[start:])


def run(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_routed_experts_match_transformers_and_come_back_from_the_prefix_cache(tiny_models, arch):
    """16-token chunks; the same prompt twice in one call (the second hits blocks the same
    step computes), then every prompt again from the prefix cache. Qwen3-MoE has a dense
    layer among its sparse ones."""
    path = tiny_models[arch]
    llm = LLM(
        path,
        **{**SMALL, "max_num_batched_tokens": 16},
        dtype="float32",
        enable_return_routed_experts=True,
    )
    model = eager(path)
    prompts = prompt_ids(3, 20) + prompt_ids(1, 37, seed=1)
    prompts.append(prompts[-1])
    first = run(llm, prompts)
    check(model, prompts, first)
    again = run(llm, prompts)
    assert all(o.num_cached_tokens >= 16 for o in again)
    check(model, prompts, again)


SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=7, ignore_eos=True)


@pytest.mark.parametrize(
    "settings, params",
    [
        ({"max_num_batched_tokens": 16, "num_gpu_blocks_override": 8}, GREEDY),
        ({"num_gpu_blocks_override": 12, "kv_offloading_size": 0.01}, GREEDY),
        (
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3,
                }
            },
            GREEDY,
        ),
        ({"async_scheduling": True}, SAMPLED),
        ({"async_scheduling": False}, SAMPLED),
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, GREEDY),
    ],
    ids=["chunked-preempting", "host-tier", "ngram", "n2-async", "n2-sync", "tp2-ep"],
)
def test_routed_experts_cross_the_engine(tiny_models, settings, params):
    path = tiny_models["mixtral"]
    llm = LLM(path, **{**SMALL, **settings}, dtype="float32", enable_return_routed_experts=True)
    model = eager(path)
    prompts = prompt_ids(4, 24, seed=5)
    check(model, prompts, run(llm, prompts, params))
    if "kv_offloading_size" in settings:  # the blocks go to host memory and come back
        run(llm, prompt_ids(4, 24, seed=6), params)
        again = run(llm, prompts, params)
        assert llm.llm_engine.scheduler.kv_cache.host.loads > 0
        check(model, prompts, again)


def test_prompt_start_and_stop_strings_cut_the_record(tiny_models):
    path = tiny_models["mixtral"]
    llm = LLM(path, **SMALL, dtype="float32", enable_return_routed_experts=True)
    model = eager(path)
    prompts = prompt_ids(2, 20, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    full = run(llm, prompts, params)
    start = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, routed_experts_prompt_start=5
    )
    check(model, prompts, run(llm, prompts, start), start=5)
    # A stop string found by the front end: the record ends with the tokens kept.
    whole = full[0].outputs[0]
    stop = llm.get_tokenizer().decode(whole.token_ids[2:4])
    stopped = run(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=6, stop=[stop]))
    kept = stopped[0].outputs[0]
    assert kept.finish_reason == "stop" and len(kept.token_ids) < len(whole.token_ids)
    check(model, prompts[:1], stopped)
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        SamplingParams(routed_experts_prompt_start=-1)
    too_far = SamplingParams(max_tokens=2, routed_experts_prompt_start=21)
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        run(llm, prompts[:1], too_far)
    assert run(llm, prompts[:1])[0].outputs[0].routed_experts is not None


def test_what_the_record_cannot_serve_is_refused(tiny_models):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(tiny_models["llama"], **SMALL, enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(
            tiny_models["mixtral"],
            **SMALL,
            pipeline_parallel_size=2,
            enable_return_routed_experts=True,
        )
    plain = LLM(tiny_models["mixtral"], **SMALL)
    assert run(plain, prompt_ids(1, 10))[0].outputs[0].routed_experts is None

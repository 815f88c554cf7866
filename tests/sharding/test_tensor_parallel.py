"""Tensor parallelism on fake CPU devices: greedy tokens with TP = 2, 4, 8 equal TP = 1,
each device holds 1/N of the split weights and of the KV cache, vLLM's head rules and
errors, and no compile after warm-up."""

from __future__ import annotations

import jax
import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from sharding import kv_head_replicas

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(3, 6) + prompt_ids(1, 40, seed=2)]


def greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def shard_fraction(array) -> float:
    shard = array.addressable_shards[0].data
    return shard.size / array.size


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {
        arch: greedy(LLM(tiny_models[arch], **SMALL)) for arch in ("llama-h8kv2", "llama-h8kv8")
    }


def test_fake_devices_available():
    assert jax.device_count() >= 8, "tests/conftest.py sets 8 fake CPU devices"


@pytest.mark.parametrize("arch", ["llama-h8kv2", "llama-h8kv8"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_greedy_equals_tp1(tiny_models, reference, arch, tp):
    llm = LLM(tiny_models[arch], tensor_parallel_size=tp, **SMALL)
    assert greedy(llm) == reference[arch]
    engine = llm.llm_engine
    kv_heads = engine.model_config.num_kv_heads
    assert kv_heads == max(tp, {"llama-h8kv2": 2, "llama-h8kv8": 8}[arch])
    # Every device holds 1/tp of the cache (its kv heads) ...
    (cache,) = engine.runner.kv_cache  # one KV-cache group
    assert len(cache.sharding.device_set) == tp
    assert cache.addressable_shards[0].data.shape[3] == 2 * kv_heads // tp
    assert shard_fraction(cache) == pytest.approx(1 / tp)
    # ... and of every weight with a head, MLP or vocabulary axis (norms are replicated).
    params = {
        jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_leaves_with_path(engine.runner.state)
    }
    split = {k: v for k, v in params.items() if "norm" not in k}
    assert len(split) == 8  # embed, q, k, v, o, gate, up, down
    for name, w in split.items():
        assert shard_fraction(w) == pytest.approx(1 / tp), name
    for name in set(params) - set(split):
        assert shard_fraction(params[name]) == 1.0, name


def test_query_heads_must_divide():
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible .* \(2\)"):
        kv_head_replicas(9, 3, 2)
    with pytest.raises(ValueError, match=r"key/value heads \(6\) must be divisible"):
        kv_head_replicas(12, 6, 4)
    assert kv_head_replicas(9, 3, 3) == 1
    assert kv_head_replicas(8, 2, 8) == 4


def test_bad_tp_is_a_clear_error(tiny_models):
    with pytest.raises(ValueError, match="attention heads"):
        LLM(tiny_models["llama"], tensor_parallel_size=8, **SMALL)  # 4 heads
    with pytest.raises(ValueError, match="exceeds the"):
        LLM(tiny_models["llama"], tensor_parallel_size=16, **SMALL)


def test_no_compile_after_warmup_with_tp(tiny_models, reference):
    from jllm.runner.compile_guard import count_compiles

    args = {**SMALL, "enforce_eager": False, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    llm = LLM(tiny_models["llama-h8kv2"], tensor_parallel_size=4, **args)
    assert llm.llm_engine.runner.compile_guard
    with count_compiles() as events:
        got = greedy(llm)
        llm.generate(
            PROMPTS,
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5),
            use_tqdm=False,
        )
    assert got == reference["llama-h8kv2"]
    assert events == []


def test_pallas_kernel_through_the_engine_with_tp(tiny_models, reference):
    """The whole engine on the Pallas kernel (interpret mode) under shard_map, TP = 2."""
    args = {**SMALL, "attention_backend": "pallas_interpret"}
    llm = LLM(tiny_models["llama-h8kv2"], tensor_parallel_size=2, **args)
    assert greedy(llm) == reference["llama-h8kv2"]


def test_qwen3_tp2_equals_tp1(tiny_models):
    """Per-head q/k norms under a head-split mesh."""
    tp1 = greedy(LLM(tiny_models["qwen3"], **SMALL))
    assert greedy(LLM(tiny_models["qwen3"], tensor_parallel_size=2, **SMALL)) == tp1

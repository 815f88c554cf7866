"""The shared decoder (jllm/models/decoder.py): how layer kinds are planned into scanned
segments, a model split into several segments (and several KV-cache groups) answering as the
one-scan model does, and the optional embedding scale and final soft cap."""

from __future__ import annotations

import dataclasses
import itertools
import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from oracle import SMALL, TINY, prompt_ids, same_outputs

from jllm import LLM, SamplingParams
from jllm.models.decoder import (
    KVCacheGroup,
    Segment,
    layer_rows,
    plan_segments,
    segment_rows,
)
from jllm.models.llama import LlamaConfig, LlamaForCausalLM
from jllm.models.rope import RopeConfig


def covers(segments, kinds) -> bool:
    """The segments, expanded in order, are the kinds."""
    out = []
    for s in segments:
        assert s.first == len(out)
        out += list(s.pattern) * s.repeats
    return tuple(out) == tuple(kinds)


def test_plan_of_one_kind_is_one_scan():
    assert plan_segments([None] * 30) == (Segment((None,), 30, 0),)


def test_plan_of_repeating_patterns():
    # Gemma 3 (1B): 26 layers, five sliding-window layers then one global, from the start.
    gemma3 = ["local"] * 5 + ["global"]
    kinds = (gemma3 * 5)[:26]
    assert plan_segments(kinds) == (
        Segment(tuple(gemma3), 4, 0),
        Segment(("local",), 2, 24),
    )
    # Gemma 2: alternating.
    assert plan_segments(["local", "global"] * 13) == (Segment(("local", "global"), 13, 0),)
    # Qwen3-MoE with mlp_only_layers=[0]: one dense layer, then sparse ones.
    assert plan_segments(["dense"] + ["moe"] * 47) == (
        Segment(("dense",), 1, 0),
        Segment(("moe",), 47, 1),
    )


def test_plan_covers_any_kinds():
    rng = random.Random(0)  # 500 random sequences; the plan must reproduce each in order
    for _ in range(500):
        kinds = [
            rng.choice("ab" if rng.random() < 0.5 else "abc") for _ in range(rng.randint(1, 40))
        ]
        segments = plan_segments(kinds)
        assert covers(segments, kinds)
        assert all(s.repeats >= 2 or len(s.pattern) == 1 for s in segments)


@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory, tokenizer_dir):
    config = transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": 7, "tie_word_embeddings": True}
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("seven") / "llama-7"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


def test_segments_answer_as_one_scan(seven_layers, monkeypatch):
    """The same checkpoint with its 7 layers planned as one scan, and as ((a, b) x 3, (a,)):
    two segments, a scan body of two layers, each stack of three layers loaded from every
    other checkpoint layer; then with each kind a KV-cache group of its own. Greedy tokens
    and logprobs agree."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(3, 9, seed=2)]
    settings = {**SMALL, "dtype": "float32", "max_num_batched_tokens": 16}  # chunked prefill

    one = LLM(seven_layers, **settings)
    assert "layers" in one.llm_engine.runner.state
    expected = [o.outputs[0] for o in one.generate(prompts, params, use_tqdm=False)]

    pattern = ("a", "b") * 3 + ("a",)
    monkeypatch.setattr(LlamaForCausalLM, "layer_kinds", classmethod(lambda cls, cfg: pattern))
    split = LLM(seven_layers, **settings)
    state = split.llm_engine.runner.state
    assert "layers" not in state and len(state["blocks"]) == 2
    assert state["blocks"][0][1]["mlp"]["up_proj"]["weight"].get_value().shape[0] == 3
    got = [o.outputs[0] for o in split.generate(prompts, params, use_tqdm=False)]
    same_outputs(got, expected)  # logprobs to 1e-4: the plans fuse (and round) differently

    # Each kind's layers a KV-cache group of their own (b's a sliding window longer than any
    # context here): two caches of 4 and 3 layers, two block pools and tables; the same
    # answers, and again from the prefix cache.
    monkeypatch.setattr(
        LlamaForCausalLM,
        "attention_kind",
        classmethod(lambda cls, cfg, kind: None if kind == "a" else 4096),
    )
    groups = LLM(seven_layers, **settings)
    engine = groups.llm_engine
    assert [c.shape[0] for c in engine.runner.kv_cache] == [4, 3]
    assert engine.scheduler.kv_cache.num_groups == 2
    for _ in range(2):
        got = [o.outputs[0] for o in groups.generate(prompts, params, use_tqdm=False)]
        same_outputs(got, expected)
    assert engine.scheduler.kv_cache.prefix_hits > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CappedConfig(LlamaConfig):
    embed_scale: float | None = None
    final_logit_softcap: float | None = None


def tiny_config(**extra) -> CappedConfig:
    head_dim = 16
    return CappedConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope=RopeConfig.from_hf(transformers.LlamaConfig(head_dim=head_dim), head_dim),
        tie_word_embeddings=False,
        max_position_embeddings=64,
        **extra,
    )


def test_embed_scale_and_final_soft_cap():
    plain = LlamaForCausalLM(tiny_config(), jnp.float32, nnx.Rngs(0))
    capped = LlamaForCausalLM(
        tiny_config(embed_scale=5.5, final_logit_softcap=1.0), jnp.float32, nnx.Rngs(0)
    )
    ids = jnp.array([3, 7, 96])
    np.testing.assert_allclose(capped.embed(ids), 5.5 * np.asarray(plain.embed(ids)), rtol=1e-6)
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)) * 40, jnp.float32)
    raw = np.asarray(plain.compute_logits(hidden))
    assert np.abs(raw).max() > 2.0  # the cap bites
    np.testing.assert_allclose(capped.compute_logits(hidden), np.tanh(raw), rtol=1e-5)
    assert list(itertools.islice(plain.segments, 1)) == [Segment((None,), 2, 0)]


def test_each_layer_finds_its_row_in_its_group():
    """A layer's group and row, computed in the scan from its segment and repeat index, are
    its group and its rank among that group's layers, for Gemma-like patterns and random
    ones."""
    rng = random.Random(1)
    gemma3 = (["local"] * 5 + ["global"]) * 5
    cases = [gemma3[:26], ["local", "global"] * 13, ["dense"] + ["moe"] * 7]
    cases += [[rng.choice("abc") for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for kinds in cases:
        order = list(dict.fromkeys(kinds))
        groups = [KVCacheGroup(k, tuple(i for i, x in enumerate(kinds) if x == k)) for k in order]
        rows = layer_rows(groups)
        for seg in plan_segments(kinds):
            for j, (g, row, per_repeat) in enumerate(segment_rows(seg, rows)):
                for k in range(seg.repeats):
                    i = seg.first + k * len(seg.pattern) + j
                    assert groups[g].spec == kinds[i]
                    assert groups[g].layers[row + k * per_repeat] == i

"""Speculative decoding with a draft model (`spec_decode/draft_model.py`), against the engine
without speculation (the oracle): the same tokens and logprobs for greedy, seeded-sampled,
penalized and logprob requests, under chunked prefill, preemption, prefix caching and
TP = 2, beside requests that finish mid-run.

Drafts: the target itself (every draft is the target's own draw under the same key, so all
are accepted: this checks the draft's cache, positions and keys step by step), the "copier"
under a random target (almost every draft rejected), and a softer copier under the copier
(some accepted, some not, at temperature 1: both paths of the coupled draw)."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from oracle import (
    SMALL,
    SPEC_SETTING_IDS,
    SPEC_SETTINGS,
    prompt_ids,
    save_edited,
    spec_counts,
    with_metrics,
)
from oracle import same_outputs as same

from jllm import LLM, SamplingParams
from jllm.runner.compile_guard import count_compiles
from jllm.spec_decode import SpeculativeConfig

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=13, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_k=30, seed=3, max_tokens=17, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=22, ignore_eos=True, min_p=0.05),
]
PROMPTS = prompt_ids(6, 9, seed=31)
# The draft applies no penalties (as vLLM's drafters): not always accepted, even as itself.
PENALIZED = SamplingParams(
    temperature=0.0, max_tokens=21, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5
)


def draft(path: str, k: int = 3, **extra) -> dict:
    return {"model": path, "num_speculative_tokens": k, **extra}


def run(llm, params=PARAMS, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def expected(llama_dir):
    return run(LLM(llama_dir, **SMALL))


@pytest.mark.parametrize("settings", SPEC_SETTINGS, ids=SPEC_SETTING_IDS)
def test_self_draft_is_always_accepted(llama_dir, expected, settings):
    """The target as its own draft: outputs unchanged, and every draft accepted, greedy or
    sampled (the same model drawing with the same key), however the tokens reached the
    draft's cache (chunks, recompute after preemption, prefix-cache hits)."""
    llm = LLM(llama_dir, **{**SMALL, "speculative_config": draft(llama_dir), **settings})
    prom = with_metrics(llm)
    same(run(llm), expected)
    drafts, drafted, accepted = spec_counts(prom)
    assert drafts > 10 and drafted >= drafts
    assert accepted == drafted
    if settings.get("num_gpu_blocks_override"):
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if not settings:  # again, from the prefix cache: its blocks hold the draft's K/V too
        kv = llm.llm_engine.scheduler.kv_cache
        hits = kv.prefix_hits
        same(run(llm), expected)
        assert kv.prefix_hits > hits
        assert spec_counts(prom)[2] == spec_counts(prom)[1]


@pytest.mark.parametrize(
    "settings", [{}, {"num_gpu_blocks_override": 12}], ids=["plain", "preempting"]
)
def test_disagreeing_draft_changes_nothing(llama_dir, copier_dir, expected, settings):
    """A draft that almost never agrees with the target: the target's tokens still. Also a
    penalized request, whose drafts (the target itself, without penalties) are sometimes
    rejected."""
    llm = LLM(llama_dir, **{**SMALL, "speculative_config": draft(copier_dir, k=4), **settings})
    prom = with_metrics(llm)
    same(run(llm), expected)
    penalized = run(LLM(llama_dir, **SMALL), [PENALIZED], PROMPTS[:1])
    same(run(llm, [PENALIZED], PROMPTS[:1]), penalized)
    self_draft = LLM(llama_dir, **{**SMALL, "speculative_config": draft(llama_dir), **settings})
    same(run(self_draft, [PENALIZED], PROMPTS[:1]), penalized)
    drafts, drafted, accepted = spec_counts(prom)
    assert drafts > 10 and accepted < 0.2 * drafted


def hotter(llama_dir: str, path, factor: float) -> str:
    """The tiny Llama with its final norm's weight times `factor`: every logit times
    `factor`, the target's distribution at temperature 1 / factor."""
    return save_edited(llama_dir, path, lambda model: model.model.norm.weight.mul_(factor))


def test_sampled_tokens_are_the_targets_for_every_seed(llama_dir, tmp_path):
    """Exactness in distribution: for each of many seeds a sampled request gives the same
    tokens with a draft model as without (test_seeded_sampling checks the engine's draws
    against the model's distribution), for a draft the target follows only sometimes: the
    target at a higher temperature, at temperature 1."""
    soft = hotter(llama_dir, tmp_path / "hotter", 0.8)
    prompt = prompt_ids(1, 12, seed=5)[0]
    n = 48
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in range(n)
    ]
    plain = run(LLM(llama_dir, **SMALL), params, [prompt] * n)
    assert len({tuple(o.token_ids) for o in plain}) > n // 2  # the seeds draw apart
    llm = LLM(llama_dir, **{**SMALL, "speculative_config": draft(soft, k=3)})
    prom = with_metrics(llm)
    same(run(llm, params, [prompt] * n), plain)
    _, drafted, accepted = spec_counts(prom)
    assert 0.2 * drafted < accepted < 0.9 * drafted  # both accepted and rejected drafts


def other_shape(path, tokenizer_dir: str, **shape) -> str:
    """A random tiny Llama of the target's vocabulary with other layer counts and heads."""
    config = transformers.LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.25,
        **shape,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


NARROW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
NARROW.update(num_attention_heads=2, num_key_value_heads=1)  # head_dim 16, 1 kv head
WIDE = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=3)
WIDE.update(num_attention_heads=4, num_key_value_heads=4)  # head_dim 32, 4 kv heads


@pytest.mark.parametrize(
    "shape, settings",
    [
        (NARROW, {}),
        (NARROW, {"tensor_parallel_size": 2}),  # its one kv head replicated to the mesh
        (WIDE, {"attention_backend": "xla"}),  # 4x the target's K/V bytes per token
    ],
    ids=["narrow", "narrow-tp2", "wide-xla"],
)
def test_draft_of_another_shape(llama_dir, tokenizer_dir, expected, tmp_path, shape, settings):
    """A draft with other layers, heads and head size than the target: its own cache shape
    in a KV-cache group of its own (its own block pool and tables, as many blocks as the
    target's group: a block's bytes are both models'), the xla backend's chunk counts sized
    for the larger K/V per token, and the target's tokens."""
    path = other_shape(tmp_path / "draft", tokenizer_dir, **shape)
    llm = LLM(llama_dir, **{**SMALL, "speculative_config": draft(path), **settings})
    same(run(llm), expected)
    runner, target = llm.llm_engine.runner, llm.llm_engine.model_config
    c, d = target, runner.draft.config
    per_token = [2 * m.num_kv_heads * m.head_dim * 4 for m in (c, d)]
    assert runner.draft.layout.kv_token_bytes == per_token[1]
    assert runner.layout.kv_token_bytes == max(per_token)
    tp = settings.get("tensor_parallel_size", 1)
    per_block = sum(m.num_layers * 16 * p // tp for m, p in zip((c, d), per_token, strict=True))
    assert runner.layout.num_blocks == (32 << 20) // per_block
    (draft_cache,) = runner.draft.kv_cache  # the draft's one KV-cache group
    assert draft_cache.shape[:2] == (d.num_layers, runner.layout.num_blocks)
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.num_groups == len(runner.kv_groups) == 2  # the target's, then the draft's
    assert kv.num_free_blocks == kv.num_blocks - 1  # both groups given back


def test_disable_by_batch_size(llama_dir):
    spec = draft(llama_dir, disable_by_batch_size=3)
    llm = LLM(llama_dir, **{**SMALL, "speculative_config": spec})
    prom = with_metrics(llm)
    run(llm, PARAMS[:1] * 4, PROMPTS[:4])  # 4 requests >= 3, finishing together: no drafts
    assert spec_counts(prom)[0] == 0
    run(llm, PARAMS[:1], PROMPTS[:1])
    assert spec_counts(prom)[0] > 5  # alone: a draft every step


def test_config_and_refusals(llama_dir, tmp_path):
    c = SpeculativeConfig.create({"model": "/a/draft", "num_speculative_tokens": 2})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/a/draft", 2)
    with pytest.raises(ValueError, match="needs a 'model' path"):
        SpeculativeConfig.create({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'eagle' is not supported by jllm yet"):
        SpeculativeConfig.create({"method": "eagle", "model": "x", "num_speculative_tokens": 2})

    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    other = tmp_path / "other-vocab"
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    eagle = tmp_path / "eagle"
    shutil.copytree(llama_dir, eagle)
    cfg = json.loads((eagle / "config.json").read_text())
    (eagle / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["EagleLlamaForCausalLM"]})
    )
    refusals = [
        (draft(str(other)), "vocabulary \\(1000 tokens\\) differs"),
        (draft(str(eagle)), "EAGLE/Medusa drafts are not supported"),
        (draft(llama_dir, draft_tensor_parallel_size=2), "draft_tensor_parallel_size=2"),
        (draft(str(tmp_path / "missing")), "missing. does not exist"),
    ]
    for spec, message in refusals:
        with pytest.raises(ValueError, match=message):
            LLM(llama_dir, **{**SMALL, "speculative_config": spec})


@pytest.mark.slow
def test_no_compile_after_warmup_with_a_draft(llama_dir):
    llm = LLM(
        llama_dir,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        disable_log_stats=True,
        speculative_config=draft(llama_dir),
    )
    prom = with_metrics(llm)
    with count_compiles() as events:
        run(llm, PARAMS[:4], PROMPTS[:4])
    assert events == []
    assert spec_counts(prom)[2] > 0

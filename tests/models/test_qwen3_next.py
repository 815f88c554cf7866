"""Qwen3-Next and Qwen3.5's text models (gated DeltaNet layers beside gated full attention)
against transformers' torch path: tiny random models (float32, 4 layers: three linear, one
full; Qwen3-Next's experts with a shared one and a dense layer among them), 40-90 token
prompts, greedy tokens equal and each chosen token's logprob within 1e-4 of transformers'
teacher-forced one. Crosses: prefix hits from state snapshots, chunked prefill smaller than
a prompt (the state carried across chunks, decodes beside chunks) one step ahead, the packed
batch layout, preemption (the state slot freed, the request recomputed), tensor parallelism
(the linear layers split by head) with expert parallelism, the Pallas TPU and GPU kernels
interpreted, the host KV tier (blocks and state snapshots back from host memory), bf16 as
near float32 as transformers' bf16; n-gram speculation exact (the state put back after
rejected drafts), draft models refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from oracle import (
    SMALL,
    TINY,
    assert_matches,
    generate,
    oracle_tokens,
    prompt_ids,
    spec_counts,
    teacher_forced_logprobs,
    with_metrics,
    worst_teacher_forced_gaps,
)

from jllm import LLM, SamplingParams

VOCAB = 512
PROMPTS = prompt_ids(3, 40, vocab=VOCAB) + prompt_ids(1, 90, seed=1, vocab=VOCAB)

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # partial_rotary_factor 0.25 rotates 4 of its dims
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    linear_key_head_dim=16,
    linear_value_head_dim=16,  # Triton's smallest tile
    tie_word_embeddings=False,
    # The tiny models' lengths, norms, special ids and wide weights (oracle.TINY).
    **{k: TINY[k] for k in ("max_position_embeddings", "rms_norm_eps", "initializer_range")},
    **{k: TINY[k] for k in ("bos_token_id", "eos_token_id")},
)
EXPERTS = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
MODELS = {
    "qwen3_next": (
        transformers.Qwen3NextForCausalLM,
        EXPERTS | {"decoder_sparse_step": 1, "mlp_only_layers": [1]},
    ),
    "qwen3_5_text": (transformers.Qwen3_5ForCausalLM, {}),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeForCausalLM, EXPERTS),
}


def save_hybrid(model_type: str, root, tokenizer_dir: str, **overrides) -> str:
    """A tiny random model of `model_type` with non-trivial norms (1 + w around 1), decays
    (A_log, dt_bias) and gated norms; `overrides`: config fields."""
    cls, extra = MODELS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **extra | overrides)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):  # scales by 1 + w
                param.uniform_(-0.5, 0.5)
            elif name.endswith("dt_bias"):
                param.uniform_(-1.0, 1.0)
            elif name.endswith("A_log"):
                param.uniform_(-2.0, 0.5)
    path = root / model_type
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid")
    return {name: save_hybrid(name, root, tokenizer_dir) for name in MODELS}


@pytest.fixture(scope="module")
def oracles(hybrids) -> dict:
    return {
        name: transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        for name, path in hybrids.items()
    }


@pytest.mark.parametrize(
    "model_type, settings",
    [
        ("qwen3_next", {}),
        # A 16-token budget: every prompt is cut into chunks, decodes run beside them.
        ("qwen3_next", {"max_num_batched_tokens": 16, "async_scheduling": True}),
        # Rows packed back to back (the ragged kernels' layout) instead of on tiles.
        ("qwen3_next", {"max_num_batched_tokens": 32, "attention_backend": "cpu_kernel"}),
        # 7 usable blocks: two requests' 16 tokens each outgrow them.
        ("qwen3_next", {"num_gpu_blocks_override": 8}),
        ("qwen3_next", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
        ("qwen3_5_text", {"max_num_batched_tokens": 16}),
        ("qwen3_5_moe_text", {}),
        # The Pallas kernels, interpreted: the delta rule's chunk and recurrent kernels and
        # the full layers' ragged attention, for TPU and for GPU.
        ("qwen3_next", {"attention_backend": "pallas_interpret", "max_num_batched_tokens": 32}),
        ("qwen3_5_text", {"attention_backend": "pallas_gpu_interpret"}),
    ],
    ids=[
        "next",
        "next-chunked-async",
        "next-packed",
        "next-preempting",
        "next-tp2-ep",
        "3.5-chunked",
        "3.5-moe",
        "next-pallas-tpu",
        "3.5-pallas-gpu",
    ],
)
def test_matches_transformers(hybrids, oracles, model_type, settings):
    llm = LLM(hybrids[model_type], **{**SMALL, "dtype": "float32", **settings})
    tokens = 16 if "num_gpu_blocks_override" in settings else 8
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    outs = generate(llm, PROMPTS, params)
    assert_matches(oracles[model_type], PROMPTS, outs)
    if "num_gpu_blocks_override" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if settings == {}:  # prefix caching: the 90-token prompt's state at 64 is a hit
        again = generate(llm, PROMPTS, params)
        assert_matches(oracles[model_type], PROMPTS, again)
        assert [o.num_cached_tokens for o in again] == [0, 0, 0, 64]


@pytest.mark.parametrize("settings", [{}, {"tensor_parallel_size": 2}], ids=["plain", "tp2"])
def test_host_tier_brings_back_blocks_and_state_snapshots(hybrids, oracles, settings):
    """Small device pools (2 requests, 15 attention blocks, 4 state slots) and a host tier:
    a 90-token prompt's blocks and its state snapshot at 64 are evicted by four other
    prompts and stored in host memory; the prompt again hits 64 tokens there (attention
    blocks and the snapshot loaded back) and equals the oracle."""
    pools = dict(max_num_seqs=2, num_gpu_blocks_override=16, kv_offloading_size=0.01)
    llm = LLM(hybrids["qwen3_next"], **{**SMALL, "dtype": "float32", **pools, **settings})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    first = prompt_ids(1, 90, seed=7, vocab=VOCAB)
    generate(llm, first, params)
    generate(llm, prompt_ids(4, 70, seed=8, vocab=VOCAB), params)
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.host.stores and kv.state_host.stores
    again = generate(llm, first, params)
    assert_matches(oracles["qwen3_next"], first, again)
    assert again[0].num_cached_tokens == 64
    assert kv.host.loads == 4 and kv.state_host.loads == 1


def test_bf16_as_near_float32_as_transformers_bf16(hybrids, oracles):
    """bf16 moves this tiny model's logprobs far (its random norms and decays amplify the
    rounding): transformers' own bf16 run lands up to ~1.7 nats from float32. jllm's bf16
    run must be no further from float32 than transformers' bf16 run, teacher-forced on each
    one's own greedy tokens (within 1.5x and 0.1 nats)."""
    path = hybrids["qwen3_next"]
    prompts = prompt_ids(4, 5, vocab=VOCAB) + prompt_ids(1, 40, seed=1, vocab=VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm = LLM(path, **{**SMALL, "dtype": "bfloat16"})
    outs = generate(llm, prompts, params)
    ours = worst_teacher_forced_gaps(oracles["qwen3_next"], [
        (p, o.outputs[0]) for p, o in zip(prompts, outs, strict=True)
    ])  # fmt: skip
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    theirs = []
    for prompt, tokens in zip(prompts, oracle_tokens(bf16, prompts, 8), strict=True):
        logprobs = teacher_forced_logprobs(bf16, prompt, tokens)
        chosen = [{t: SimpleNamespace(logprob=logprobs[i, t].item())} for i, t in enumerate(tokens)]
        theirs.append((prompt, SimpleNamespace(token_ids=tokens, logprobs=chosen)))
    hf_choice, hf_logprob = worst_teacher_forced_gaps(oracles["qwen3_next"], theirs)
    assert ours[0] <= 1.5 * hf_choice + 0.1, (ours, hf_choice)
    assert ours[1] <= 1.5 * hf_logprob + 0.1, (ours, hf_logprob)


def test_lora_is_refused(hybrids):
    with pytest.raises(ValueError, match="LoRA adapters on a model with linear-attention"):
        LLM(hybrids["qwen3_5_text"], **SMALL, enable_lora=True)


def test_draft_models_are_refused(hybrids):
    spec = {"model": hybrids["qwen3_5_text"], "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="per-request state"):
        LLM(hybrids["qwen3_next"], **SMALL, speculative_config=spec)


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 16}, {"attention_backend": "xla"}],
    ids=["plain", "chunked", "tiles"],
)
def test_ngram_speculation_is_exact(hybrids, oracles, settings):
    """N-gram drafts where they partly hold: each prompt is P + G + P, G the model's own
    greedy continuation of P, so after the second P the drafts are G's tokens, which the
    model takes up to where the longer context changes its mind. The steps that reject
    drafts put the linear layers' state back to before the step and compute the row again:
    greedy tokens and logprobs equal transformers'; drafts were accepted and rejected."""
    oracle = oracles["qwen3_next"]
    bases = prompt_ids(3, 20, seed=6, vocab=VOCAB)
    prompts = [p + g + p for p, g in zip(bases, oracle_tokens(oracle, bases, 24), strict=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(
        hybrids["qwen3_next"],
        **{**SMALL, "dtype": "float32", "speculative_config": spec, **settings},
    )
    prom = with_metrics(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = generate(llm, prompts, params)
    assert_matches(oracle, prompts, outs)
    drafts, draft_tokens, accepted = spec_counts(prom)
    assert drafts > 0 and 0 < accepted < draft_tokens


# A long prompt, the next turn of its conversation (the prompt, 8 generated tokens and 20
# new ones), the prompt again, and an unrelated one.
LONG = prompt_ids(1, 150, seed=3, vocab=VOCAB)[0]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # Chunks of 16: snapshots at 64 and 128 as the chunks reach them; one step ahead.
        {"max_num_batched_tokens": 16, "async_scheduling": True},
        # 40 tokens each: the second batch's three requests outgrow 19 usable blocks.
        {"num_gpu_blocks_override": 20},
        {"tensor_parallel_size": 2},
    ],
    ids=["plain", "chunked-async", "preempting", "tp2"],
)
def test_prefix_hits_resume_from_state_snapshots(hybrids, oracles, settings):
    """The state after 128 tokens (the last multiple of mamba_block_size=64 the first
    request's prefill reaches) is snapshotted; a later turn of the conversation and the same
    prompt start from it (128 cached tokens) and still equal transformers; an unrelated
    prompt hits nothing. A twin admitted in the same step as the snapshot's writer does not
    read it before it is written."""
    llm = LLM(hybrids["qwen3_next"], **{**SMALL, "dtype": "float32", **settings})
    tokens = 40 if "num_gpu_blocks_override" in settings else 8
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    first = generate(llm, [LONG, LONG], params)  # twins: no hit on the state written beside
    assert_matches(oracles["qwen3_next"], [LONG, LONG], first)
    turn = LONG + list(first[0].outputs[0].token_ids) + prompt_ids(1, 20, seed=4, vocab=VOCAB)[0]
    other = prompt_ids(1, 70, seed=5, vocab=VOCAB)[0]
    prompts = [turn, LONG, other]
    outs = generate(llm, prompts, params)
    assert_matches(oracles["qwen3_next"], prompts, outs)
    assert [o.num_cached_tokens for o in outs] == [128, 128, 0]
    if "num_gpu_blocks_override" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_mamba_cache_mode_none_takes_no_hit(hybrids, oracles):
    llm = LLM(hybrids["qwen3_next"], **SMALL, dtype="float32", mamba_cache_mode="none")
    generate(llm, [LONG])
    outs = generate(llm, [LONG])
    assert_matches(oracles["qwen3_next"], [LONG], outs)
    assert outs[0].num_cached_tokens == 0


def test_tensor_parallel_must_divide_the_linear_key_heads(hybrids):
    with pytest.raises(ValueError, match=r"linear_num_key_heads=2\) must be divisible"):
        LLM(hybrids["qwen3_next"], **SMALL, tensor_parallel_size=4)

"""The oracles and settings tests share: tiny random transformers models saved as safetensors
directories, transformers' greedy generation, and small engine settings."""

from __future__ import annotations

import re
import shutil

import numpy as np
import torch
import transformers

from jllm import SamplingParams
from jllm.runner.input_batch import InputBatch
from jllm.scheduler_output import NewRequestData, SchedulerOutput

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    # Wide weights so random logits have clear winners: greedy comparisons stay stable.
    initializer_range=0.25,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # YaRN from 32 positions (the prompts run past them), as Qwen configures long contexts.
    "qwen2-yarn": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama3-untied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    # Per-head q/k norms, and a head dim (32) that is not hidden / heads (16).
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    # Biases on every projection (Llama's attention_bias and mlp_bias).
    "llama-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"attention_bias": True, "mlp_bias": True},
    ),
    # Tensor-parallel shapes: 8 query heads over 2 or 8 kv heads.
    "llama-h8kv2": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"num_attention_heads": 8, "num_key_value_heads": 2},
    ),
    "llama-h8kv8": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"num_attention_heads": 8, "num_key_value_heads": 8},
    ),
    # Four layers: pipeline stages of 1, 2 and 4 layers (tests/sharding/test_pipeline_parallel.py).
    "llama-l4": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"num_hidden_layers": 4}),
    # Head dim 64, as SmolLM2's: at block size 16 the CPU attention kernel runs decode rows
    # and prefill rows on two vectorized paths (the head dims above share its scalar path).
    # A small vocabulary, so that a request may ask for all of its logprobs.
    "llama-h64": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"head_dim": 64, "vocab_size": 1024},
    ),
    # Sliding windows shorter than the test prompts (WINDOW tokens), mixed with full layers.
    "mistral-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 24},
    ),
    "qwen2-window": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {
            "use_sliding_window": True,
            "sliding_window": 24,
            "max_window_layers": 1,  # layer 0 full, the rest sliding
            "num_hidden_layers": 3,
        },
    ),
    # Soft caps low enough to bind with these wide random weights; scores scaled by a
    # query_pre_attn_scalar that is not the head dim.
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 24,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    # Gemma 3's 2:1 pattern of local and global layers, each with its own RoPE (linear
    # scaling on the global ones).
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "num_hidden_layers": 6,
            "sliding_window": 24,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    # The same with 8 layers: the pattern twice, then a repeat cut short (two local layers);
    # pipeline stages hold whole repeats (tests/sharding/test_pipeline_parallel.py).
    "gemma3-cut": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "num_hidden_layers": 8,
            "sliding_window": 24,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 16,
        },
    ),
    # Mixtures of experts: 8 experts, 2 per token; Qwen3-MoE with a dense layer between
    # sparse ones (decoder_sparse_step 2 and mlp_only_layers), in both routings.
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48},
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [2],
            "norm_topk_prob": True,
        },
    ),
    # Qwen2-MoE: a shared expert beside the routed ones, q/k/v biases, unnormalised routing.
    "qwen2-moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
        },
    ),
    "qwen3-moe-unnormed": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    # LongRoPE (short factors up to 64 positions, long beyond) on a partial rotation, and a
    # window on every layer.
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {
            "sliding_window": 24,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.5, 2.0, 3.0, 5.0],
            },
        },
    ),
}


def save_tiny(arch: str, root, tokenizer_dir: str, dtype: torch.dtype = torch.float32) -> str:
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{"tie_word_embeddings": True, **TINY, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    path = root / (arch if dtype == torch.float32 else f"{arch}-{dtype}".replace("torch.", ""))
    model.to(dtype).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


def save_edited(model_dir: str, path, edit) -> str:
    """A copy of a transformers model directory with `edit(model)` applied to its weights
    (under no_grad), and its tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        edit(model)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{model_dir}/{name}", path)
    return str(path)


def save_copier(llama_dir: str, path) -> str:
    """The tiny Llama with its residual branches scaled down and its output projection set to
    10x the embeddings: the last token's own logit stands far above the rest."""

    def edit(model):
        embed = model.model.embed_tokens.weight
        embed.mul_(10.0)
        model.lm_head.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)

    return save_edited(llama_dir, path, edit)


# Engine settings for tiny models: small cache, few buckets, compile on first use.
SMALL = dict(
    kv_cache_memory_bytes=32 << 20,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    enforce_eager=True,
    disable_log_stats=True,
)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The oracle: transformers' greedy generation, one prompt at a time, EOS ignored."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may appear, no stop
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64 log-probabilities the model gives each next token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]


def worst_teacher_forced_gaps(model, runs) -> tuple[float, float]:
    """For (prompt ids, CompletionOutput with logprobs) pairs: the largest gap between a chosen
    token's and the top token's oracle logprob, and the largest error of a reported logprob."""
    gap = error = 0.0
    for prompt, gen in runs:
        ref = teacher_forced_logprobs(model, prompt, gen.token_ids)
        for step, token in enumerate(gen.token_ids):
            gap = max(gap, (ref[step].max() - ref[step, token]).item())
            error = max(error, abs(gen.logprobs[step][token].logprob - ref[step, token].item()))
    return gap, error


def assert_bf16_near_fp32(llm, model_dir: str, vocab: int = 49152) -> None:
    """A bf16 engine's greedy choices on a batch and on one prompt decoding alone (a 1-row
    step, padded to 2 rows) stay the float32 argmax or within bf16's error of it (0.1 nats),
    and its logprobs within 0.25: the same bf16 weights through transformers in float32,
    teacher-forced on the engine's tokens. bf16 keeps 8 significant bits: the hidden state is
    rounded in every layer, and logits of magnitude ~10 (tiny random models' weights are
    wide) carry errors of a few hundredths. `vocab`: the prompts' token range."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    batch = prompt_ids(4, 5, vocab=vocab) + prompt_ids(1, 40, seed=1, vocab=vocab)
    alone = prompt_ids(1, 23, seed=2, vocab=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in alone], params, use_tqdm=False)
    runs = [(p, o.outputs[0]) for p, o in zip(batch + alone, outs, strict=True)]
    worst_choice, worst_logprob = worst_teacher_forced_gaps(model, runs)
    assert worst_choice <= 0.1, worst_choice
    assert worst_logprob <= 0.25, worst_logprob


def prompt_ids(n: int, length: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 7 * i,), generator=g).tolist() for i in range(n)]


# Engine settings a speculative engine is checked under against the plain engine.
SPEC_SETTINGS = [
    {},
    {"max_num_batched_tokens": 16, "enable_prefix_caching": False},  # chunked prefill
    {"num_gpu_blocks_override": 12},  # preemption
    {"tensor_parallel_size": 2},
]
SPEC_SETTING_IDS = ["plain", "chunked", "preempting", "tp2"]


def mixed_step(max_pages: int, block_size: int):
    """One step of four requests as the runner's input batch and the scheduler's output:
    two decodes (after 29 and 40 cached tokens), a 17-token chunk after 20 cached, and a
    fresh 9-token prefill, each in its own blocks (12 apart from block 1)."""
    out, batch = SchedulerOutput(), InputBatch(8, 64, max_pages)
    for i, (computed, new) in enumerate([(29, 1), (40, 1), (20, 17), (0, 9)]):
        blocks = list(range(1 + 12 * i, 1 + 12 * i + -(-(computed + new) // block_size)))
        ids = list(range(1, computed + new + 1))
        batch.add(NewRequestData(f"r{i}", ids, [], SamplingParams(), i, None, (blocks,), computed))
        out.num_scheduled_tokens[f"r{i}"] = new
    return batch, out


def same_outputs(got, expected, logprob_tol: float = 1e-4) -> None:
    """Two engines' CompletionOutputs agree: tokens, finish reasons, and logprobs (the same
    top ids, values within `logprob_tol`)."""
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids
        assert g.finish_reason == e.finish_reason
        if e.logprobs:
            for lg, le in zip(g.logprobs, e.logprobs, strict=True):
                assert lg.keys() == le.keys()
                for t in le:
                    assert abs(lg[t].logprob - le[t].logprob) <= logprob_tol


def with_metrics(llm, name: str = "tiny"):
    """A PrometheusStatLogger attached to `llm`'s engine, to read its counters from."""
    from jllm.metrics.prometheus import PrometheusStatLogger

    prom = PrometheusStatLogger(name, llm.llm_engine.max_model_len)
    llm.llm_engine.core.stat_loggers.append(prom)
    return prom


def spec_counts(prom) -> list[float]:
    """Speculative decoding's counters: drafts, draft tokens, accepted tokens."""
    return [
        prometheus_value(prom, f"vllm:spec_decode_num_{name}_total")
        for name in ("drafts", "draft_tokens", "accepted_tokens")
    ]


def prometheus_value(prom, name: str, label: str = "") -> float:
    """A metric's value from a PrometheusStatLogger's exposition (the first sample of `name`
    whose labels contain `label`)."""
    for line in prom.exposition().decode().splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not exported")


def weight_copies(hlo: str, dtype: str, shape) -> list[str]:
    """Instructions of a compiled HLO module whose result has one layer's weight shape, of
    HLO element type `dtype` ("bf16", "f32"): the layer scan's copies out of the stack."""
    pattern = re.compile(rf"= {dtype}\[{','.join(map(str, shape))}\]")
    return [line.strip() for line in hlo.splitlines() if pattern.search(line)]


def eager(model_dir: str, **config):
    """transformers' model in float32 with eager attention (exact, and soft caps apply)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", **config
    ).eval()


def oracle_tokens(model, prompts, max_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def assert_matches(model, prompts, outs) -> None:
    """Greedy tokens equal the oracle's, and each chosen token's logprob is within 1e-4 of
    the oracle's, teacher-forced on those tokens."""
    expected = oracle_tokens(model, prompts, len(outs[0].outputs[0].token_ids))
    assert [o.outputs[0].token_ids for o in outs] == expected
    for prompt, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        ref = teacher_forced_logprobs(model, prompt, gen.token_ids)
        got = [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
        want = [ref[i, t].item() for i, t in enumerate(gen.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)


# The engine crosses a family's test runs against transformers (assert_crosses_match).
CROSSES = [
    {},
    # A 16-token budget: every prompt is cut into chunks, decodes run beside them.
    {"max_num_batched_tokens": 16, "async_scheduling": True},
    # 13 usable blocks: the requests outgrow them with 40 tokens each.
    {"num_gpu_blocks_override": 14},
    {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    # The Pallas kernels, interpreted (TPU's; Triton's split in two, with the experts split
    # by width).
    {"attention_backend": "pallas_interpret", "max_num_batched_tokens": 32},
    {"attention_backend": "pallas_gpu_interpret", "tensor_parallel_size": 2},
    # n-gram drafts verified as rows beside the decodes; two pipeline stages.
    {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        }
    },
    {"pipeline_parallel_size": 2, "max_num_batched_tokens": 32},
]
CROSS_IDS = [
    "plain",
    "chunked-async",
    "preempting",
    "tp2-ep",
    "pallas-tpu",
    "pallas-gpu-tp2",
    "ngram",
    "pp2",
]


def assert_crosses_match(model_dir: str, oracle, prompts, settings: dict, cached: list) -> None:
    """A tiny model's engine under `settings` (float32) equal to `oracle` on `prompts`: 8
    greedy tokens, 40 with `num_gpu_blocks_override` (which must then preempt); with no
    settings the prompts again from the prefix cache, `cached` tokens each."""
    from jllm import LLM

    llm = LLM(model_dir, **{**SMALL, "dtype": "float32", **settings})
    tokens = 40 if "num_gpu_blocks_override" in settings else 8
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    assert_matches(oracle, prompts, generate(llm, prompts, params))
    if "num_gpu_blocks_override" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if settings == {}:
        again = generate(llm, prompts, params)
        assert_matches(oracle, prompts, again)
        assert [o.num_cached_tokens for o in again] == cached


def generate(llm, prompts, params=None):
    """Token-id prompts through `llm`; default greedy, 8 tokens, the chosen tokens' logprobs."""
    params = params or SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

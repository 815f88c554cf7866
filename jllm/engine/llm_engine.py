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
from jllm.engine.generation_config import (
    extra_eos_ids,
    generation_defaults,
    model_generation_config,
)
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.platform import (
    log_split,
    min_dot_rows,
    resolve_async_scheduling,
    resolve_backend,
    resolve_dtype,
)
from jllm.engine.processor import Processor
from jllm.engine.scheduler import Scheduler
from jllm.metrics.stats import LoggingStatLogger
from jllm.model_loader import resolve_model
from jllm.models import registry
from jllm.models.loader import load_model
from jllm.runner.compile_cache import enable_compilation_cache
from jllm.runner.inputs import BatchLayout
from jllm.runner.kv_cache import create_kv_cache
from jllm.runner.model_runner import ModelRunner
from jllm.sampling_params import SamplingParams
from sharding import kv_head_replicas, make_mesh

logger = logging.getLogger("jllm")

# Prefill chunks are laid out in tiles of this many tokens (see models/attention.py).
PREFILL_TILE = 16


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
        kv_cache, num_blocks = create_kv_cache(
            cfg,
            block_size=args.block_size,
            tp=tp,
            dtype=dtype,
            mesh=mesh,
            platform=platform,
            max_model_len=max_model_len,
            max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
            override=args.num_gpu_blocks_override,
            memory_bytes=args.kv_cache_memory_bytes,
            utilization=args.gpu_memory_utilization,
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
            num_spec_tokens=sched_cfg.num_lookahead_slots,
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
        self.extra_stop_ids = extra_eos_ids(gen_config, eos)
        self.default_sampling_params = generation_defaults(args.generation_config, gen_config)
        self.stat_loggers = [] if args.disable_log_stats else [LoggingStatLogger()]
        self.core = EngineCore(
            self.scheduler,
            self.runner,
            self.tokenizer,
            max_model_len,
            eos,
            self.stat_loggers,
            async_scheduling=resolve_async_scheduling(args.async_scheduling, platform),
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

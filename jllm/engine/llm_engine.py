"""`LLMEngine`: builds every part from `EngineArgs` and wires them together.

model on its mesh (engine/model_setup.py) -> model runner -> KV cache sized from memory
after profiling the largest step -> every bucket compiled -> block manager + scheduler ->
engine core. Policies live elsewhere: platform.py (dtype, backend, async scheduling),
generation_config.py, runner/kv_cache.py.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

from flax import nnx

from jllm import cpu_heap
from jllm.attention import get_backend
from jllm.config import EngineArgs, resolve_scheduler_config
from jllm.distributed import (
    ProcessLostError,
    exit_if_broken,
    initialize_distributed,
    open_step_channel,
)
from jllm.distributed.codec import MalformedMessage
from jllm.engine.core import EngineCore
from jllm.engine.core_client import InprocClient
from jllm.engine.data_parallel import DataParallelScheduler, check_data_parallel
from jllm.engine.encoder_cache import EncoderCache
from jllm.engine.generation_config import (
    eos_token_id,
    extra_eos_ids,
    generation_defaults,
    model_generation_config,
)
from jllm.engine.host_kv_tier import HostKVTier
from jllm.engine.kv_cache_manager import KVCacheManager, host_tier_groups
from jllm.engine.model_setup import load_draft_model, load_engine_model
from jllm.engine.multimodal import MultiModalProcessor, encoder_pages, encoder_slots
from jllm.engine.output_processor import OutputProcessor
from jllm.engine.outputs import EngineCoreRequest
from jllm.engine.platform import (
    check_batch_invariant,
    log_split,
    min_dot_rows,
    resolve_async_scheduling,
    resolve_backend,
    resolve_batch_invariant,
    select_platform,
)
from jllm.engine.processor import Processor
from jllm.engine.request import RequestStatus
from jllm.engine.routed_experts import RoutedExpertsRecord, routes_spec
from jllm.engine.scheduler import Scheduler
from jllm.kv_cache_interface import MambaSpec, MLAAttentionSpec, with_state_options
from jllm.logits_process import LogitsProcessorConfig, load_logits_processors
from jllm.lora.manager import LoraCache, LoraSlots
from jllm.metrics.stats import LoggingStatLogger
from jllm.model_loader.update import UpdateTarget
from jllm.models.packing import pack_stacked_weights, packs_here
from jllm.pooling_params import PoolingParams
from jllm.rl.transfer import TransferConfig
from jllm.runner.buckets import BatchLayout
from jllm.runner.compile_cache import enable_compilation_cache
from jllm.runner.encoder import ImageEncoder, PatchEncoder
from jllm.runner.host_kv import HostKVCache, host_tier_blocks
from jllm.runner.kv_cache import allocate_kv_caches, resolve_kv_cache_dtype, size_kv_cache
from jllm.runner.model_runner import ModelRunner
from jllm.runner.state_copies import StateCopies
from jllm.runner.weight_sync import WeightSync
from jllm.sampling_params import RequestOutputKind, SamplingParams
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS
from jllm.spec_decode import check_state_speculation, make_proposer
from jllm.structured_output import StructuredOutputManager
from sharding import replicated

logger = logging.getLogger("jllm")

# What runs a pooling request's prompt: one placeholder token, never sampled, ends it.
POOLING_SAMPLING = SamplingParams(
    max_tokens=1,
    temperature=0.0,
    detokenize=False,
    output_kind=RequestOutputKind.FINAL_ONLY,
)


def image_encoder(graphdef, vision, mm: MultiModalProcessor, budget: int, dtype, mesh):
    """(the runner's image encoder, the scheduler's encoder cache) of a vision model: one
    page per image for images of one size, pages of `tokens_per_image` tokens for images cut
    at their own size (the largest the engine's max_pixels allows)."""
    if not getattr(vision, "variable", False):
        slots, per_step = encoder_slots(vision.tokens_per_image, budget)
        encoder = ImageEncoder(graphdef, vision, slots, per_step, dtype, replicated(mesh))
        return encoder, EncoderCache(slots, vision.tokens_per_image)
    page, max_patches = vision.tokens_per_image, mm.max_patches
    pages = encoder_pages(page, max_patches // vision.unit, budget, mm.max_images)
    encoder = PatchEncoder(graphdef, vision, pages, max_patches, dtype, replicated(mesh))
    return encoder, EncoderCache(pages, page)


def check_prompt_embeds(args: EngineArgs, vision, draft) -> None:
    """enable_prompt_embeds where jllm runs it: not beside images (both replace token
    embeddings) nor with a draft model (which would see only the placeholder ids)."""
    if not args.enable_prompt_embeds:
        return
    if vision is not None:
        raise ValueError("enable_prompt_embeds is not supported with image inputs yet.")
    if draft is not None:
        raise ValueError(
            "enable_prompt_embeds is not supported with a speculative draft model (it would "
            "read the placeholder token ids); n-gram speculation works."
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
        platform = select_platform(args.device)
        invariant = resolve_batch_invariant(
            args.batch_invariant,
            platform,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
        )
        m = load_engine_model(args, platform)
        # The stacked bf16 projections in the CPU kernel's packed panels, once (packing.py);
        # `m` rebound so that nothing keeps the unpacked arrays.
        packed = {}
        if packs_here(m.mesh, m.dtype, invariant):
            graphdef, state, packed = pack_stacked_weights(m.graphdef, m.state)
            m = dataclasses.replace(m, graphdef=graphdef, state=state)
        # Linear-attention state: snapshots for the prefix cache, backups for speculation.
        interval = args.mamba_block_size if args.mamba_cache_mode == "align" else 0
        speculative = args.speculative_config is not None
        m.kv_caches = with_state_options(m.kv_caches, interval, speculative)
        loaded = time.perf_counter()
        cpu_heap.keep(platform)  # the step's temporaries stay mapped
        cfg, dtype, self.max_model_len = m.config, m.dtype, m.max_model_len
        # A pooling model's task and head (jllm/pooling/model.py); None: a generative model.
        self.pooling = m.pooling
        if m.pooling is not None and args.speculative_config is not None:
            raise ValueError("Speculative decoding does not apply to a pooling model.")
        self.model_config, self.dtype, self.tokenizer = cfg, dtype, m.tokenizer
        if args.max_logprobs > cfg.vocab_size:
            # A cap, as in vLLM: past the vocabulary it is the vocabulary (the sampler's
            # top-k cannot ask for more tokens than there are).
            args.max_logprobs = cfg.vocab_size
        backend = resolve_backend(
            args.attention_backend,
            platform,
            dtype,
            cfg.head_dim,
            args.block_size,
            fp8_cache=args.kv_cache_dtype != "auto",
            options=m.attention_options,
        )
        check_batch_invariant(invariant, backend, dtype, args)
        # The backend's batch layout: prefill rows in its tiles, or packed back to back.
        tile = get_backend(backend).prefill_tile
        sched_cfg = resolve_scheduler_config(args, self.max_model_len, tile)
        kv_dtype, kv_fp8 = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, platform)
        check_data_parallel(  # before a draft model loads
            args,
            tiles=tile is not None,
            vision=getattr(cfg, "vision", None),
            state=any(isinstance(g, MambaSpec) for g in m.kv_caches),
            pooling=m.pooling,
        )
        draft = None
        if args.speculative_config is not None:
            draft = load_draft_model(args, m, backend, platform, kv_dtype.itemsize)
        groups = (*m.kv_caches, *(() if draft is None else draft.kv_caches))
        check_state_speculation(args.speculative_config, groups)
        if args.enable_lora and any(isinstance(g, MambaSpec) for g in groups):
            raise ValueError(
                "LoRA adapters on a model with linear-attention layers (Qwen3-Next, Qwen3.5) "
                "are not supported by jllm yet."
            )
        if args.enable_lora and any(isinstance(g, MLAAttentionSpec) for g in groups):
            raise ValueError(  # kv_b_proj is split and absorbed: a delta on it is not applied
                "LoRA adapters on a model with multi-head latent attention (DeepSeek) are not "
                "supported by jllm yet."
            )
        vision = getattr(cfg, "vision", None)
        check_prompt_embeds(args, vision, draft)
        # enable_prompt_embeds: the rows' width, which the processor checks and steps carry
        self.embeds_dim = cfg.hidden_size if args.enable_prompt_embeds else 0
        token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
        layout = BatchLayout.create(
            args.block_size,
            0,  # blocks: set once the cache is sized
            tile or 1,
            self.max_model_len,
            sched_cfg.max_num_seqs,
            sched_cfg.max_num_batched_tokens,
            # The draft runs over the same flat batch: the larger of the two models' bytes
            # sizes the xla backend's KV chunk counts.
            kv_token_bytes=max(token_bytes, 0 if draft is None else draft.token_bytes),
            min_rows=min_dot_rows(dtype, platform),
            num_spec_tokens=sched_cfg.num_lookahead_slots,
            kv_fp8=kv_fp8,
            tiles=tile is not None,
            group_fields=tuple(spec.step_fields(kv_dtype) for spec in groups),
            image_tokens=0 if vision is None else vision.tokens_per_image,
            image_spans=vision is not None and vision.bidirectional,
            embeds_dim=self.embeds_dim,
            mrope=getattr(getattr(cfg, "rope", None), "mrope_rows", None) is not None,
        )
        if getattr(draft, "takes_hidden", False):  # MTP: each token's successor too
            layout = dataclasses.replace(layout, next_tokens=True)
        if draft is not None:
            draft.layout = dataclasses.replace(layout, kv_token_bytes=draft.token_bytes)
        encoder, encoder_cache, mm = None, None, None
        if vision is not None:
            mm = MultiModalProcessor(
                m.source.path,
                vision,
                args.limit_mm_per_prompt,
                args.mm_processor_kwargs,
                sched_cfg.max_num_batched_tokens,
                args.trust_remote_code,
                tokenizer=self.tokenizer,
            )
            encoder, encoder_cache = image_encoder(
                m.graphdef, vision, mm, sched_cfg.max_num_batched_tokens, dtype, m.mesh
            )
        routes = None
        if args.enable_return_routed_experts:
            routes = routes_spec(cfg, m.kv_caches, args.block_size, args.pipeline_parallel_size)
        self.logits_processors = load_logits_processors(
            args.logits_processors, LogitsProcessorConfig(cfg.vocab_size, sched_cfg.max_num_seqs)
        )
        self.runner = ModelRunner(
            m.graphdef,
            m.state,
            layout,
            cfg.vocab_size,
            sched_cfg.max_num_seqs,
            args.max_logprobs,
            backend,
            args.enforce_eager,
            m.mesh,
            m.kv_caches,
            self.logits_processors,
            draft,
            m.lora,
            encoder,
            logprobs_mode=args.logprobs_mode,
            routes=routes,
            invariant=invariant,
            pooling=None if m.pooling is None else m.pooling.pooling_type,
            data_parallel_size=args.data_parallel_size,
        )
        self.runner.packed_weights = packed
        sizing = time.perf_counter()
        specs, kv_config = size_kv_cache(
            [m.kv_caches] if draft is None else [m.kv_caches, draft.kv_caches],
            block_size=args.block_size,
            tp=args.tensor_parallel_size,
            pp=args.pipeline_parallel_size,
            dp=args.data_parallel_size,
            dtype=kv_dtype,
            mesh=m.mesh,
            platform=platform,
            max_model_len=self.max_model_len,
            max_num_seqs=sched_cfg.max_num_seqs,
            max_step_tokens=sched_cfg.max_num_batched_tokens + sched_cfg.num_lookahead_slots,
            override=args.num_gpu_blocks_override,
            memory_bytes=args.kv_cache_memory_bytes,
            utilization=args.gpu_memory_utilization,
            profile=self.runner.profile_step_bytes,
        )
        num_blocks = max(kv_config.num_blocks)  # the padding tokens' slot lies past every pool's
        host_tier = state_tier = None
        host_blocks, attention_pool = {}, 0
        if args.kv_offloading_size:
            attention, state = host_tier_groups(kv_config.specs)
            attention_pool = kv_config.pools[attention]
            shares = {attention_pool: 1}
            if state is not None:  # a snapshot for every run of attention blocks it ends
                interval = kv_config.specs[state].cache_interval // args.block_size
                shares = {attention_pool: interval, kv_config.pools[state]: 1}
            host_blocks = host_tier_blocks(args.kv_offloading_size, specs[0], shares, args.nnodes)
        if host_blocks:
            self.runner.host_kv = HostKVCache(host_blocks, specs[0], replicated(m.mesh))
            tiers = [
                HostKVTier(n, HostKVCache.block_bytes(specs[0][pool]))
                for pool, n in host_blocks.items()
            ]
            host_tier, state_tier = tiers[0], (tiers[1] if len(tiers) > 1 else None)
            logger.info(
                "Host KV tier: %s (%.2f GiB of this host's memory, every shard of the "
                "%d device(s)).",
                " and ".join(
                    f"{tier.num_blocks} {'blocks' if tier is host_tier else 'state snapshots'}"
                    for tier in tiers
                ),
                sum(tier.num_blocks * tier.block_bytes for tier in tiers) / 2**30,
                args.tensor_parallel_size,
            )
        state_pools = {
            g: kv_config.pools[g] for g, s in enumerate(m.kv_caches) if isinstance(s, MambaSpec)
        }
        if state_pools:  # the prefix cache's state snapshots, copied before a step
            copies = 2 * sched_cfg.max_num_seqs
            self.runner.state_copies = StateCopies(state_pools, copies, replicated(m.mesh))
        compiling = time.perf_counter()
        self._attach_kv_caches(specs, num_blocks, draft)  # the shapes the steps compile for
        if platform == "gpu":
            # XLA's GPU autotuner runs candidate kernels on the device while compiling, with
            # buffers of its own: the steps compile before the cache takes the memory.
            self.runner.compile_all()
            caches = allocate_kv_caches(specs)
            if args.enforce_eager:  # later compiles find the memory taken: XLA's defaults
                self.runner.table.compiler_options = {"xla_gpu_autotune_level": 0}
        else:
            # The caches are zeroed on a thread while the steps compile against their shapes.
            with ThreadPoolExecutor(1, "jllm-kv-cache") as pool:
                allocated = pool.submit(allocate_kv_caches, specs)
                self.runner.compile_all()
                caches = allocated.result()
        self._attach_kv_caches(caches, num_blocks, draft)
        if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
            log_split(m.mesh, m.state, caches[0], m.kv_replicas, m.stage_layers)
        compiled = time.perf_counter()
        self.channel = open_step_channel(args, self.rank)
        if self.channel is not None:
            # atexit runs last-registered first: the shutdown, then the exit that spares a
            # broken cluster JAX's barrier, then JAX's own clean-up.
            atexit.register(exit_if_broken, self.channel)
        if self.channel is not None and self.rank == 0:
            self.runner.channel = self.channel
            atexit.register(self.shutdown)
        kvs = [
            KVCacheManager(
                kv_config.num_blocks,
                args.block_size,
                args.enable_prefix_caching,
                kv_config.specs,
                pools=kv_config.pools,
                host=host_tier,
                state_host=state_tier,
                # Stages run a step's rows in micro-batches, not all writes before all reads.
                same_step_hits=args.pipeline_parallel_size == 1,
                # An MTP draft's cache entry at a block's end depends on the next block's
                # token.
                drop_last_hit=getattr(draft, "takes_hidden", False),
            )
            for _ in range(args.data_parallel_size)  # each data shard's own blocks
        ]
        self.lora_cache = None
        slots = None
        if m.lora is not None:
            self.lora_cache = LoraCache(
                m.lora.targets, cfg.num_layers, args.max_lora_rank, args.max_cpu_loras, m.lora.rows
            )
            slots = LoraSlots(args.max_loras)
        shards = [
            Scheduler(
                sched_cfg, kv, slots, encoder_cache, vision is not None and vision.bidirectional
            )
            for kv in kvs
        ]
        self.scheduler = shards[0] if len(shards) == 1 else DataParallelScheduler(shards)
        self.hf_config = m.source.hf_config
        self.eos_token_id = eos = eos_token_id(self.tokenizer, m.source.hf_config)
        gen_config = model_generation_config(m.source)
        self.extra_stop_ids = extra_eos_ids(gen_config, eos)
        self.default_sampling_params = generation_defaults(args.generation_config, gen_config)
        self.stat_loggers = [] if args.disable_log_stats else [LoggingStatLogger()]
        self.structured = None
        if self.tokenizer is not None:
            self.structured = StructuredOutputManager(
                self.tokenizer,
                cfg.vocab_size,
                self.eos_token_ids,
                args.structured_outputs_config,
            )
        self.transfer = TransferConfig(args.weight_transfer_config)
        self.weight_sync = WeightSync(
            self.runner,
            lambda: _update_target(m, args),
            specs,
            lambda caches: self._attach_kv_caches(caches, num_blocks, draft),
            sleep_mode=args.enable_sleep_mode,
        )
        self.core = EngineCore(
            self.scheduler,
            self.runner,
            self.max_model_len,
            eos,
            self.stat_loggers,
            async_scheduling=resolve_async_scheduling(
                args.async_scheduling, platform, args.speculative_config is not None
            ),
            structured=self.structured,
            proposer=make_proposer(args.speculative_config),
            weights=self.weight_sync,
            routes=None
            if routes is None
            else RoutedExpertsRecord(
                routes,
                kv_config.num_blocks[kv_config.pools[routes.group]],
                host_blocks.get(attention_pool, 0),
                attention_pool,
            ),
        )
        # The front end reaches the core only through its client (add, abort, outputs,
        # utility calls); each step's outputs are processed inline (LLM) unless AsyncLLM
        # sets `output_handler`, its output thread (engine/output_thread.py).
        self.engine_core = InprocClient(self.core)
        self.output_processor = OutputProcessor(self.tokenizer, m.pooling)
        self.output_handler = None
        self.processor = Processor(
            self.tokenizer,
            self.max_model_len,
            cfg.vocab_size,
            args.max_logprobs,
            mm,
            embeds_size=self.embeds_dim,
        )
        self._rng = random.Random(args.seed)
        done = time.perf_counter()
        logger.info(
            "Engine ready in %.1f seconds: loading the model %.1f s, sizing the KV cache "
            "(profile) %.1f s, compiling and allocating the cache %.1f s, the rest %.1f s.",
            done - start,
            loaded - start,
            compiling - sizing,
            compiled - compiling,
            (sizing - loaded) + (done - compiled),
        )

    def _attach_kv_caches(self, caches, num_blocks: int, draft) -> None:
        """The model's caches (and the draft's), real or their shapes while compiling."""
        self.runner.attach_kv_cache(caches[0], num_blocks)
        if draft is not None:
            draft.attach(caches[1], num_blocks)

    # ---- RL: weight updates and sleep, through the core between steps -----------------------
    def init_weight_transfer_engine(self, request=None) -> None:
        """vLLM's forms: {"init_info": {...}}, an object with `init_info`, or the init_info
        itself."""
        info = getattr(request, "init_info", request)
        if isinstance(info, dict) and set(info) == {"init_info"}:
            info = info["init_info"]
        self.transfer.init(info)

    def weight_tensors(self, weights) -> tuple:
        """What an `update_weights` chunk hands the core: (tensors at the checkpoint's names
        (read from the transfer backend's `update_info`, if that is what came), False), or
        (`get_weights()`'s state, True)."""
        if not self.transfer.initialized:
            raise RuntimeError("Call init_weight_transfer_engine before update_weights.")
        if isinstance(weights, nnx.State):
            return weights, True
        return self.transfer.tensors(weights), False

    def update_weights(self, weights) -> None:
        self.engine_core.call_utility("update_weights", *self.weight_tensors(weights))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of a multi-process engine: it takes no requests."""
        return self.rank != 0

    def shutdown(self) -> None:
        """Stop the grammar worker; process 0 of a multi-process engine: stop the other
        processes (also at exit)."""
        if self.structured is not None:
            self.structured.shutdown()
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
        except MalformedMessage as e:
            logger.error(
                "Process %d received a malformed step-channel message (%s); stopping. "
                "Process 0 reports this process's exit.",
                self.rank,
                e,
            )
            self.channel.hang_up()
            raise
        self.channel.hang_up()
        logger.info("Process 0 stopped; process %d is done.", self.rank)

    # ---- requests ------------------------------------------------------------------------
    def _lora(self, lora_request):
        if self.lora_cache is None:
            raise ValueError(
                f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} was "
                "requested, but LoRA is not enabled: start the engine with enable_lora=True."
            )
        return self.lora_cache.get(lora_request)

    def pooling_params(self, params: PoolingParams | None, task: str, api: str = "LLM.encode()"):
        """`params` for a `task` request ("embed", "classify") of a pooling model, checked
        and with the pooler config's defaults (ValueError with vLLM's messages)."""
        if self.pooling is None:
            raise ValueError(
                f"{api} is only supported for pooling models. Try passing `--runner pooling` "
                "to use the model as a pooling model."
            )
        if task not in self.pooling.supported_tasks:
            name = {"embed": "Embedding", "classify": "Classification"}.get(task, task)
            raise ValueError(
                f"{name} API is not supported by this model. Try converting the model using "
                f"`--convert {task}`."
            )
        params = PoolingParams() if params is None else params.clone()
        params.task = task
        return params.verify(self.pooling, self.args.model)

    def prepare(
        self, prompt, params: SamplingParams, lora_request=None, add_special_tokens: bool = True
    ):
        """Validate and tokenize without touching engine state (raises ValueError); with a
        `lora_request`, also load and check its adapter (the host cache keeps it).
        `add_special_tokens`: False for a chat template's output."""
        if self.is_follower:
            raise RuntimeError(
                f"This is process {self.rank} of a {self.args.nnodes}-process engine; only "
                "process 0 takes requests."
            )
        if isinstance(params, PoolingParams):
            processed = self.processor.process_prompt(
                prompt, POOLING_SAMPLING, add_special_tokens, pooling=True
            )
            if processed.prompt_embeds is not None:
                raise ValueError("Pooling models take text or token prompts, not prompt_embeds.")
            if lora_request is not None:
                processed.lora = self._lora(lora_request)
            return processed, params
        if self.pooling is not None:
            raise ValueError(
                "LLM.generate() is only supported for generative models. Try passing "
                "`--runner generate` to use the model as a generative model."
            )
        params = self._own_params(params)
        processed = self.processor.process_prompt(prompt, params, add_special_tokens)
        if lora_request is not None:
            processed.lora = self._lora(lora_request)
        for proc in self.logits_processors:
            proc.validate_params(params)
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("Structured outputs need a tokenizer (skip_tokenizer_init).")
            self.structured.resolve(params)
        if (
            params.prompt_logprobs is not None
            and not self.scheduler.config.enable_chunked_prefill
            and len(processed.prompt_token_ids) - 1 > PROMPT_LOGPROB_ROWS
        ):
            raise ValueError(
                f"prompt_logprobs of prompts longer than {PROMPT_LOGPROB_ROWS + 1} tokens need "
                "chunked prefill (enable_chunked_prefill=True)."
            )
        if self.core.async_scheduling and params.multi_token_bad_words:
            # The mask of such a word depends on the token the step in flight samples.
            raise ValueError(
                "bad_words of several tokens are not supported with async_scheduling yet "
                f"({params.bad_words!r}); start the engine with async_scheduling=False."
            )
        return processed, params

    def _own_params(self, params: SamplingParams) -> SamplingParams:
        """The request's own copy of `params`, with the generation config's extra EOS ids
        among its stop ids unless it ignores EOS."""
        params = params.clone()
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.extra_stop_ids
        return params

    @property
    def max_images_per_prompt(self) -> int:
        """The most images one prompt may carry: the model's `limit_mm_per_prompt`, 0 for a
        model that takes text only (chat messages are counted against it before any image
        is fetched)."""
        mm = self.processor.mm
        return 0 if mm is None else mm.max_images

    def continue_prompt(self, processed, token_ids: list[int], params: SamplingParams):
        """A prepared prompt continued as `token_ids` (its tokens, then generated ones: a
        beam of beam search), ready for `add_request`: its cache salt, LoRA adapter and images
        carry over, so the continuation shares the prompt's blocks and runs as it did."""
        params = self._own_params(params)
        if token_ids[: len(processed.prompt_token_ids)] != processed.prompt_token_ids:
            raise ValueError("A continuation must begin with the prompt's tokens.")
        self.processor.validate(token_ids, params)
        return dataclasses.replace(processed, prompt_token_ids=list(token_ids)), params

    def add_request(
        self,
        request_id: str,
        processed,
        params: SamplingParams,
        priority: int = 0,
        trace_headers: dict | None = None,
    ) -> None:
        """Admit a prepared request (ValueError if its id is already running). Its outputs
        come from `step()`, or from AsyncLLM's output thread when that handles them.
        `params`: SamplingParams, or a pooling model's verified PoolingParams."""
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = params, copy.copy(POOLING_SAMPLING)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=processed.prompt_token_ids,
            sampling_params=params,
            seed=seed,
            arrival_time=time.time(),
            cache_salt=processed.cache_salt,
            priority=priority,
            lora=processed.lora,
            mm_items=processed.mm_items,
            prompt_embeds=processed.prompt_embeds,
            pooling_params=pooling,
        )
        self.engine_core.add_request(request)
        outputs = self.output_handler or self.output_processor
        try:
            outputs.add_request(request, processed.prompt, trace_headers)
        except BaseException:
            self.engine_core.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        """End requests a client no longer waits for: no output."""
        self.engine_core.abort_requests(request_ids)
        (self.output_handler or self.output_processor).abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self):
        """One engine step; its `RequestOutput`s, processed inline (vLLM's LLMEngine.step),
        or none when AsyncLLM's output thread processes them. A stop string found here ends
        its sequence in the core too, before the next step."""
        outputs = self.engine_core.get_output()
        if self.output_handler is not None:
            self.output_handler.process_outputs(outputs)
            return []
        processed = self.output_processor.process_outputs(outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        self.engine_core.abort_requests(processed.reqs_to_fail, RequestStatus.FINISHED_ERROR)
        return processed.request_outputs

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a sequence: the tokenizer's EOS and the generation config's."""
        return set(self.extra_stop_ids) | {self.eos_token_id} - {None}


def _update_target(m, args) -> UpdateTarget:
    """What weight updates map onto; RuntimeError for an engine that takes none."""
    if m.source.kind == "gguf" or getattr(m.source, "checkpoint_quantization", None):
        raise RuntimeError(
            "This engine cannot take weight updates: its weights are a packed checkpoint's "
            "(GGUF, AWQ, GPTQ, FP8). Load the float checkpoint, with quantization='fp8' or "
            "'tpu_int8' to quantize each update."
        )
    if args.nnodes > 1:
        raise RuntimeError("Weight updates run on a single-process engine (nnodes=1) only.")
    return UpdateTarget(m.arch, m.config, m.dtype, m.mesh, m.kv_replicas, m.quantization)

"""From engine arguments to a model on its mesh: resolve the checkpoint, pick its module in
the registry, settle `max_model_len` and the dtype, load the tokenizer and the weights; and
a speculative draft model, on the target's mesh in the target's dtype."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.attention.options import describe, options_in
from jllm.config import EngineArgs
from jllm.engine.platform import resolve_backend, resolve_dtype
from jllm.model_loader import resolve_model
from jllm.model_loader.kv_scales import resolve_kv_scales
from jllm.model_loader.loader import load_model
from jllm.models import registry
from jllm.models.config import settle, sliding_window
from jllm.models.lora import adapter_rows, with_lora_slots
from jllm.models.pipeline import stage_layers, stage_plan
from jllm.pooling.model import HeadWeights, dummy_head, resolve_pooling
from jllm.quantization import resolve_quantization
from jllm.spec_decode.draft_model import DraftModel
from sharding import kv_head_replicas, make_mesh

logger = logging.getLogger("jllm")


@dataclasses.dataclass
class EngineModel:
    source: object  # the resolved checkpoint (model_loader.ModelSource)
    config: object  # the module's config, kv heads replicated to the mesh when needed
    dtype: jnp.dtype
    max_model_len: int
    mesh: jax.sharding.Mesh
    kv_replicas: int
    graphdef: object
    state: object
    tokenizer: object | None
    kv_caches: tuple  # each KV-cache group's spec (jllm/kv_cache_interface.py)
    # With enable_lora: the model's LoRA slots (jllm/lora/layers.py:LoraSpec).
    lora: object | None = None
    quantization: str | None = None  # the method the weights were loaded with
    stage_layers: tuple[int, ...] | None = None  # each pipeline stage's layers
    # Every layer's AttentionOptions (jllm/attention/options.py), which the backend must take
    attention_options: frozenset = frozenset()
    arch: object = None  # the family's Architecture (models/architecture.py)
    # A pooling model's task and head (jllm/pooling/model.py PoolingSpec); None: generative.
    pooling: object = None


def replicate_kv_heads(cfg, tp: int):
    """(cfg, factor): with fewer kv heads than devices each is repeated so that every device
    holds one (sharding.kv_head_replicas), and the config counts the repeats."""
    replicas = kv_head_replicas(cfg.num_heads, cfg.num_kv_heads, tp)
    if replicas > 1:
        cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * replicas)
    return cfg, replicas


def check_linear_heads(cfg, tp: int) -> None:
    """A linear-attention model splits its key heads (each with its value heads) over the
    devices, whole: their count must divide by `tp` (nothing is repeated, unlike kv heads)."""
    linear = getattr(cfg, "linear", None)
    if linear is not None and linear.num_key_heads % tp:
        raise ValueError(
            f"Linear-attention key heads (linear_num_key_heads={linear.num_key_heads}) must "
            f"be divisible by tensor_parallel_size ({tp})."
        )


def expert_parallel(cfg, enabled: bool, tp: int, dp: int = 1):
    """cfg with its experts placed whole over the `tp` devices of each of the `dp` data
    shards, `dp x tp` devices in all (`enable_expert_parallel`); a model without experts
    ignores the flag, as vLLM does."""
    moe = getattr(cfg, "moe", None)
    experts = 0 if moe is None else moe.num_experts
    if not enabled or not experts:
        if enabled:
            logger.info("enable_expert_parallel: the model has no experts; ignored.")
        return cfg
    if experts % (tp * dp):
        raise ValueError(
            f"enable_expert_parallel places {experts} experts on {tp * dp} devices: the "
            "expert count must be divisible by tensor_parallel_size"
            + (" x data_parallel_size." if dp > 1 else ".")
        )
    return dataclasses.replace(cfg, moe=dataclasses.replace(moe, expert_parallel=True))


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def apply_hf_overrides(hf, overrides: dict) -> None:
    """vLLM's hf_overrides on a transformers config, in place. RoPE fields go into
    `rope_parameters` (every layer type's, where the config has several): `rope_theta` sets
    the base, `rope_scaling` / `rope_parameters` update the scaling; a dict given for a
    sub-config (`text_config`) updates it; anything else is set as it is."""
    for key, value in overrides.items():
        if key in _ROPE_KEYS:
            params = dict(getattr(hf, "rope_parameters", None) or {})
            by_type = bool(params) and all(isinstance(v, dict) for v in params.values())
            for target in list(params.values()) if by_type else [params]:
                if key == "rope_theta":
                    target["rope_theta"] = float(value)
                elif isinstance(value, dict):
                    target.update(value)
                else:
                    raise ValueError(f"hf_overrides {key!r} must be a dict, got {value!r}.")
            hf.rope_parameters = params
            continue
        current = getattr(hf, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(hf, key, value)


def engine_devices(indexes: list[int] | None, count: int):
    """The devices of `indexes` (into jax.devices()), exactly DP x TP x PP of them; None:
    all."""
    if indexes is None:
        return None
    every = jax.devices()
    if len(indexes) != count or len(set(indexes)) != count:
        raise ValueError(
            f"devices={list(indexes)} must name {count} distinct devices (data_parallel_size "
            "x tensor_parallel_size x pipeline_parallel_size)."
        )
    if not all(isinstance(i, int) and 0 <= i < len(every) for i in indexes):
        raise ValueError(f"devices={list(indexes)}: indexes into the {len(every)} devices.")
    return [every[i] for i in indexes]


def load_engine_model(args: EngineArgs, platform: str) -> EngineModel:
    source = resolve_model(
        args.model,
        revision=args.revision,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        download_dir=args.download_dir,
        load_format=args.load_format,
    )
    if args.hf_overrides:
        apply_hf_overrides(source.hf_config, args.hf_overrides)
    pooling = resolve_pooling(
        args.runner, args.convert, args.pooler_config, source.hf_config, source.path
    )
    arch = registry.resolve(source.hf_config)
    cfg = arch.config(source.hf_config)
    if pooling is not None:
        if getattr(cfg, "vision", None) is not None:
            raise ValueError("Pooling runs text models only; this one is a vision model.")
        if pooling.pooling_type != "LAST" and (
            args.enable_chunked_prefill or args.enable_prefix_caching
        ):
            # vLLM's rule: MEAN and CLS read every prompt token in the step that ends the
            # prompt, so prompts are not split and not read from the prefix cache.
            logger.info(
                "%s pooling: chunked prefill and prefix caching are off.", pooling.pooling_type
            )
            args.enable_chunked_prefill = args.enable_prefix_caching = False
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # no LM head is built
    derived_len, key = cfg.max_position_embeddings, "max_position_embeddings"
    window = sliding_window(cfg)
    if args.disable_sliding_window and window is not None and window < derived_len:
        # vLLM's rule: without the window, no sequence may outgrow it.
        derived_len, key = window, "sliding_window, with disable_sliding_window"
    max_model_len = args.max_model_len or derived_len
    if max_model_len > derived_len:
        raise ValueError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len ({key}={derived_len} in the model's config)."
        )
    cfg = settle(cfg, max_model_len, args.disable_sliding_window)
    quantization = resolve_quantization(args.quantization, source)
    if source.kind == "orbax":  # converted weights are stored as they were quantized
        stored = source.orbax_meta.get("quantization")
        if args.quantization not in (None, stored):
            raise ValueError(
                f"{source.path} was converted with quantization={stored!r}, not "
                f"{args.quantization!r}; convert the model again to change it."
            )
        quantization = stored
    dtype = resolve_dtype(args.dtype, source.checkpoint_dtype, platform)
    logger.info(
        "Initializing jllm engine with config: model=%r, dtype=%s, quantization=%s, "
        "kv_cache_dtype=%s, max_model_len=%d, "
        "block_size=%d, enable_prefix_caching=%s, enable_chunked_prefill=%s, "
        "enforce_eager=%s, platform=%s, seed=%s",
        source.path,
        jnp.dtype(dtype).name,
        quantization,
        args.kv_cache_dtype,
        max_model_len,
        args.block_size,
        args.enable_prefix_caching,
        args.enable_chunked_prefill,
        args.enforce_eager,
        platform,
        args.seed,
    )
    tokenizer = None
    if not args.skip_tokenizer_init:
        tokenizer = source.load_tokenizer(
            args.tokenizer_mode, args.trust_remote_code, args.tokenizer_revision
        )
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    dp = args.data_parallel_size
    if args.nnodes > 1 and dp * tp * pp != jax.device_count():
        raise ValueError(
            f"With {args.nnodes} nodes the model must span all {jax.device_count()} devices "
            f"of the cluster; got data_parallel_size={dp} x tensor_parallel_size={tp} x "
            f"pipeline_parallel_size={pp}."
        )
    if pp > 1:
        whole = arch.module.segments_of(cfg)
        cfg = dataclasses.replace(cfg, **stage_plan(arch.module, cfg, pp))
        if source.kind == "orbax" and arch.module.segments_of(cfg) != whole:
            plan = cfg.stage_repeats or cfg.stage_segments
            raise ValueError(
                f"{source.path} is a converted checkpoint, whose layer stacks restore onto "
                f"stages of equal whole repeats of one layer pattern only; this split pads "
                f"them ({plan} repeats per stage): give the original checkpoint, or a "
                "pipeline_parallel_size that divides the layers."
            )
    devices = engine_devices(args.devices, dp * tp * pp)
    mesh = make_mesh(tp, devices, pipeline_parallel_size=pp, data_parallel_size=dp)
    cfg = expert_parallel(cfg, args.enable_expert_parallel, tp, dp)
    check_linear_heads(cfg, tp)
    cfg, replicas = replicate_kv_heads(cfg, tp)
    # Per-layer float8 KV-cache scales, from the checkpoint or quantization_param_path.
    scaled, file_scales = resolve_kv_scales(args, source, cfg.num_layers, arch.rename)
    if scaled:
        cfg = dataclasses.replace(cfg, kv_scales=True)
    weights = source
    if pooling is not None:
        ids = []
        if pooling.from_tokens:
            if tokenizer is None:
                raise ValueError("classifier_from_token needs the tokenizer.")
            ids = [tokenizer.convert_tokens_to_ids(t) for t in pooling.from_tokens]
        weights = HeadWeights(source, pooling, ids)
        if args.load_format == "dummy":
            dummy_head(pooling, cfg.hidden_size, args.seed or 0)
    graphdef, state = load_model(
        arch,
        cfg,
        weights,
        dtype,
        mesh,
        args.load_format,
        seed=args.seed or 0,
        kv_replicas=replicas,
        quantization=quantization,
        kv_scales=file_scales,
    )
    attention_options = options_in(nnx.merge(graphdef, state))
    lora = None
    if args.enable_lora:
        lora_dtype = dtype if args.lora_dtype == "auto" else jnp.dtype(args.lora_dtype)
        graphdef, state, lora = with_lora_slots(
            graphdef,
            state,
            args.max_loras,
            args.max_lora_rank,
            lora_dtype,
            mesh,
            replicas,
            args.fully_sharded_loras,
            adapter_rows(arch, cfg),
        )
    return EngineModel(
        source,
        cfg,
        jnp.dtype(dtype),
        max_model_len,
        mesh,
        replicas,
        graphdef,
        state,
        tokenizer,
        arch.module.kv_cache_specs(cfg),
        lora,
        quantization,
        stage_layers(arch.module, cfg) if arch.module.num_stages(cfg) > 1 else None,
        attention_options,
        arch,
        pooling,
    )


def load_draft_model(
    args: EngineArgs, target: EngineModel, backend: str, platform: str, kv_itemsize: int
):
    """The speculative draft model of `speculative_config` (a DraftModel), or None for
    another method. Checked against the target: the same vocabulary (its drafts are the
    target's token ids), positions up to the target's `max_model_len`, the same mesh and
    attention backend. Loaded by the same loader (`load_format`, quantization found in
    its checkpoint or `spec.quantization`) in the target's dtype. It runs over the target's
    flat batch (with its own KV-cache groups' metadata, built with the target's layout,
    which the engine gives it with its own `token_bytes`)."""
    spec = args.speculative_config
    if spec.method == "mtp":
        from jllm.spec_decode.mtp import load_mtp_draft

        return load_mtp_draft(spec, target, args, kv_itemsize)
    if spec.method != "draft_model":
        return None
    tp = args.tensor_parallel_size
    if args.pipeline_parallel_size > 1:
        raise ValueError(
            "A speculative draft model is not supported with pipeline_parallel_size > 1 yet."
        )
    if spec.draft_tensor_parallel_size not in (None, tp):
        raise ValueError(
            f"draft_tensor_parallel_size={spec.draft_tensor_parallel_size} is not supported: "
            f"jllm runs the draft model on the target's mesh (tensor_parallel_size={tp})."
        )
    if args.nnodes > 1:
        raise ValueError("A speculative draft model is not supported on several nodes yet.")
    source = resolve_model(
        spec.model,
        revision=spec.revision,
        trust_remote_code=args.trust_remote_code,
        download_dir=args.download_dir,
        load_format=args.load_format,
    )
    names = getattr(source.hf_config, "architectures", None) or []
    if any("eagle" in n.lower() or "medusa" in n.lower() for n in names):
        raise ValueError(
            f"The draft model {spec.model!r} is an {names[0]} head: EAGLE/Medusa drafts are "
            "not supported by jllm yet; give a full causal LM of the target's vocabulary."
        )
    arch = registry.resolve(source.hf_config)
    cfg = arch.config(source.hf_config)
    if cfg.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"The draft model's vocabulary ({cfg.vocab_size} tokens) differs from the target "
            f"model's ({target.config.vocab_size}): a draft model must share the target's "
            "tokenizer."
        )
    if cfg.max_position_embeddings < target.max_model_len:
        raise ValueError(
            f"The draft model handles {cfg.max_position_embeddings} positions, fewer than "
            f"max_model_len={target.max_model_len}: set max_model_len to at most that."
        )
    cfg, replicas = replicate_kv_heads(cfg, tp)
    quantization = resolve_quantization(spec.quantization, source)
    logger.info(
        "Speculative draft model %r: %d layers, quantization=%s.",
        source.path,
        cfg.num_layers,
        quantization,
    )
    graphdef, state = load_model(
        arch,
        cfg,
        source,
        target.dtype,
        target.mesh,
        args.load_format,
        seed=(args.seed or 0) + 1,
        kv_replicas=replicas,
        quantization=quantization,
    )
    options = options_in(nnx.merge(graphdef, state))
    draft_backend = resolve_backend(
        args.attention_backend,
        platform,
        target.dtype,
        cfg.head_dim,
        args.block_size,
        fp8_cache=args.kv_cache_dtype != "auto",
        options=options,
    )
    if draft_backend != backend:
        raise ValueError(
            f"The draft model needs attention backend {draft_backend!r} (head_dim "
            f"{cfg.head_dim}, attention options used: {describe(options)}), the target "
            f"{backend!r}: they must share one."
        )
    return DraftModel(
        graphdef,
        state,
        cfg,
        arch.module.kv_cache_specs(cfg),
        spec.num_speculative_tokens,
        spec.disable_by_batch_size,
        token_bytes=2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize,
    )

"""From engine arguments to a model on its mesh: resolve the checkpoint, pick its module in
the registry, settle `max_model_len` and the dtype, load the tokenizer and the weights."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jllm.config import EngineArgs
from jllm.engine.platform import resolve_dtype
from jllm.model_loader import resolve_model
from jllm.models import registry
from jllm.models.loader import load_model
from jllm.quantization import resolve_quantization
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


def load_engine_model(args: EngineArgs, platform: str) -> EngineModel:
    source = resolve_model(
        args.model,
        revision=args.revision,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        download_dir=args.download_dir,
        load_format=args.load_format,
    )
    arch = registry.resolve(source.hf_config)
    cfg = arch.config(source.hf_config)
    derived_len = cfg.max_position_embeddings
    max_model_len = args.max_model_len or derived_len
    if max_model_len > derived_len:
        raise ValueError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={derived_len} in the model's config)."
        )
    quantization = resolve_quantization(args.quantization, source)
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
    graphdef, state = load_model(
        arch,
        cfg,
        source,
        dtype,
        mesh,
        args.load_format,
        seed=args.seed or 0,
        kv_replicas=replicas,
        quantization=quantization,
    )
    return EngineModel(
        source, cfg, jnp.dtype(dtype), max_model_len, mesh, replicas, graphdef, state, tokenizer
    )

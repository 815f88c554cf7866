"""How many KV blocks fit, and the stacked cache array itself.

On TPU/GPU the cache takes `gpu_memory_utilization` of device memory less what the weights
use and what the largest step needs on top (the runner's `profile_step_bytes`: XLA's
memory analysis of the largest bucket, compiled against a stand-in cache). As in vLLM, the
utilization is a share of the whole device: on GPU, JAX's allocator holds only
`allocator_fraction()` of it (jllm raises JAX's default 0.75 to 0.95 at import, see
`jllm/__init__.py`), and the cache never asks for more than that limit. On CPU (no
memory stats) it takes an explicit size, `kv_cache_memory_bytes` (vLLM's CPU backend reads
VLLM_CPU_KVCACHE_SPACE; default 4 GiB).
`num_gpu_blocks_override` wins over both.

KV-cache groups (one per attention kind, `CacheSpec`) have pools of their own sizes: a
full-attention group holds a request's whole context, a sliding-window group only what its
window still sees (`engine/kv_cache_manager.py`). A sliding group's pool is capped at the
most that `max_num_seqs` requests can hold in it at once (`sliding_pool_cap`), and the
memory it does not need goes to the full-attention groups, which all get one count (a model
whose every layer slides has no cap: spare blocks keep more prefixes cached). Sized from
memory, every group must hold one request of `max_model_len` tokens, a sliding group by its
window, or start-up fails with the numbers (vLLM's check).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jllm.config import DEFAULT_CPU_KV_CACHE_BYTES
from jllm.engine.kv_cache_manager import max_blocks_per_request
from jllm.utils import cdiv
from pallas_kernels.ragged_paged_attention import kv_cache_shape
from sharding import named_sharding

logger = logging.getLogger(__name__)

CACHE_AXES = ("layers", "cache_blocks", "cache_slots", "cache_kv_heads", "head_dim")


@dataclass(frozen=True)
class CacheSpec:
    """One KV-cache group's stacked cache: how many layers it holds, their K/V heads, and
    their sliding window (None: full attention)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None

    @classmethod
    def groups_of(cls, module, cfg) -> tuple[CacheSpec, ...]:
        """The caches of a decoder `module` (models/decoder.py) of config `cfg`: one per
        KV-cache group."""
        return tuple(
            cls(len(g.layers), cfg.num_kv_heads, cfg.head_dim, g.window)
            for g in module.kv_cache_groups(cfg)
        )


def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
    return num_layers * block_size * 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def allocator_fraction(platform: str) -> float:
    """The share of a device's memory that JAX's allocator may use (its `bytes_limit`): on
    GPU, XLA_CLIENT_MEM_FRACTION (or the older XLA_PYTHON_CLIENT_MEM_FRACTION), else XLA's
    default 0.75; elsewhere the whole device."""
    if platform != "gpu":
        return 1.0
    value = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION"
    )
    return float(value) if value else 0.75


def kv_cache_budget(
    memory_bytes: int | None, utilization: float, step_bytes, stats=None, fraction=1.0
) -> int:
    """The bytes the KV cache may take: `memory_bytes` when given, else what the device has
    left. `step_bytes()`: what the largest step needs, only asked when sizing from device
    memory. `stats`: the device's memory stats (default: the first device's). `fraction`:
    the share of the device the stats' `bytes_limit` is (`allocator_fraction`)."""
    if memory_bytes is None:
        stats = (jax.devices()[0].memory_stats() or {}) if stats is None else stats
        limit = stats.get("bytes_limit")
        if limit:
            used = stats.get("bytes_in_use", 0)
            activation_bytes = step_bytes()
            logger.info(
                "Memory profile: %.2f GiB in use (weights), the largest step needs %.2f GiB.",
                used / 2**30,
                activation_bytes / 2**30,
            )
            budget = min(int(limit / fraction * utilization), limit)
            if utilization > fraction:
                logger.warning(
                    "JAX's allocator may use %.2f of the device, less than "
                    "gpu_memory_utilization=%.2f: the KV cache is sized to the allocator's "
                    "limit (XLA_CLIENT_MEM_FRACTION raises it).",
                    fraction,
                    utilization,
                )
            memory_bytes = budget - used - activation_bytes
            if memory_bytes <= 0:
                raise ValueError(
                    "No device memory is left for the KV cache: the weights and activations "
                    f"use {used / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB. Increase "
                    "gpu_memory_utilization or use a smaller model."
                )
        else:
            memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    return memory_bytes


def sliding_pool_cap(window: int, block_size: int, max_num_seqs: int, max_step_tokens: int):
    """The most blocks a sliding-window group's requests hold at once, the null block
    included: each of `max_num_seqs` requests keeps the W - 1 keys before its step plus the
    step's own tokens (all of them together at most `max_step_tokens`), two partial blocks
    at either end."""
    span = max_num_seqs * (window - 1) + max_step_tokens
    return cdiv(span, block_size) + 2 * max_num_seqs + 1


def split_blocks(budget: int, sizes: list[int], caps: list[int | None]) -> list[int]:
    """Block counts of groups whose blocks take `sizes` bytes, filling `budget` bytes:
    capped groups get their cap, or the uncapped groups' count where that is smaller; the
    uncapped groups share one count."""
    capped = {g for g, cap in enumerate(caps) if cap is not None}
    while True:
        rest = budget - sum(caps[g] * sizes[g] for g in capped)
        per_block = sum(size for g, size in enumerate(sizes) if g not in capped)
        n = max(rest, 0) // per_block
        over = {g for g in capped if caps[g] > n}
        if not over:
            return [caps[g] if g in capped else n for g in range(len(sizes))]
        capped -= over


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype, platform: str):
    """vLLM's `kv_cache_dtype` as (the cache array's dtype, the float8 format whose bytes it
    holds or None): "auto" is the model's dtype, "fp8" and "fp8_e4m3" float8_e4m3fn,
    "fp8_e5m2" float8_e5m2 (scales 1.0, vLLM's default without `calculate_kv_scales`, unless
    the checkpoint or `quantization_param_path` gives per-layer scales:
    model_loader/kv_scales.py). On the CPU a float8 cache is held as its bytes (uint8):
    XLA's CPU backend updates float8 arrays element by element
    (pallas_kernels/ragged_paged_attention/cache.py)."""
    names = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
    if kv_cache_dtype == "auto":  # other names are refused by EngineArgs (KV_CACHE_DTYPES)
        return jnp.dtype(dtype), None
    kv_dtype = jnp.dtype(names[kv_cache_dtype])
    logger.info(
        "Using %s data type to store kv cache (%s, 1 byte a value): %dx the tokens "
        "of a %s cache in the same memory.",
        kv_cache_dtype,
        kv_dtype.name,
        jnp.dtype(dtype).itemsize,
        jnp.dtype(dtype).name,
    )
    if platform == "cpu":
        return jnp.dtype(jnp.uint8), kv_dtype.name
    return kv_dtype, None


def abstract_kv_cache(spec: CacheSpec, num_blocks, block_size, dtype, mesh) -> jax.ShapeDtypeStruct:
    """A group's cache's shape, dtype and sharding: [Lg, B, S, 2K, H], each layer's slice the
    kernel's [B, S, 2K, H] page-major layout, sharded on the kv-head axis. Lowering against
    it allocates nothing (the profile); `allocate_kv_cache` makes it real."""
    shape = (
        spec.num_layers,
        *kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim),
    )
    return jax.ShapeDtypeStruct(
        shape, jnp.dtype(dtype), sharding=named_sharding(mesh, CACHE_AXES, shape, "The KV cache")
    )


def allocate_kv_cache(spec: jax.ShapeDtypeStruct) -> jax.Array:
    """The zeroed cache described by `spec` (from `abstract_kv_cache`)."""
    return jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=spec.sharding)()


def allocate_kv_caches(specs):
    """`allocate_kv_cache` over a tree of specs (`size_kv_cache`'s), waiting until every
    cache is zeroed: the engine runs it on a thread while it compiles (XLA's CPU backend
    zeroes 4 GiB in about 2 s and releases the GIL meanwhile)."""
    return jax.block_until_ready(
        jax.tree.map(
            allocate_kv_cache, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )
    )


def size_kv_cache(
    models: list[tuple[CacheSpec, ...]],
    *,
    block_size: int,
    tp: int,
    dtype,
    pp: int = 1,
    mesh,
    platform: str,
    max_model_len: int,
    max_num_seqs: int,
    max_step_tokens: int,
    override: int | None,
    memory_bytes: int | None,
    utilization: float,
    profile=None,
):
    """Size the caches from memory (per device: they are split on their kv-head axis over
    `tp` devices, and on their layer axis over `pp` pipeline stages) and
    log them as vLLM does. `models`: the model's KV-cache groups, then a speculative draft
    model's if any. `max_step_tokens`: the most tokens a step computes for one request
    (drafts included). `profile(abstract caches) -> bytes`: what the largest step needs
    (`ModelRunner.profile_step_bytes`; with a draft, the pair (target's, draft's)).
    `override` (num_gpu_blocks_override): every full-attention group's count, and a sliding
    group's up to its cap. Returns (each model's tuple of group caches, abstract:
    `allocate_kv_caches` makes them, and every group's block count, in order)."""
    specs = [spec for groups in models for spec in groups]
    sizes = [
        bytes_per_block(s.num_layers // pp, block_size, s.num_kv_heads // tp, s.head_dim, dtype)
        for s in specs
    ]
    caps = [None] * len(specs)
    if any(s.window is None for s in specs):  # spare memory goes to full attention
        caps = [
            None
            if s.window is None
            else sliding_pool_cap(s.window, block_size, max_num_seqs, max_step_tokens)
            for s in specs
        ]

    def step_bytes():
        small = [tuple(abstract_kv_cache(s, 4, block_size, dtype, mesh) for s in g) for g in models]
        return profile(small[0] if len(small) == 1 else tuple(small))

    if override is not None:
        counts = [override if cap is None else min(override, cap) for cap in caps]
    else:
        budget = kv_cache_budget(
            memory_bytes, utilization, step_bytes, fraction=allocator_fraction(platform)
        )
        counts = split_blocks(budget, sizes, caps)
        if min(counts) < 2:
            raise ValueError(
                f"The KV cache memory ({budget} bytes) holds fewer than 2 blocks of "
                f"{sum(sizes)} bytes; give it more memory."
            )
    needs = [
        max_blocks_per_request(max_model_len, block_size, s.window, max_step_tokens) for s in specs
    ]
    # Requests of max_model_len tokens the pools hold at once while they decode (a sliding
    # group's need while a step computes many tokens is the start-up check's, below).
    decoding = [max_blocks_per_request(max_model_len, block_size, s.window, 1) for s in specs]
    concurrency = min((n - 1) / need for n, need in zip(counts, decoding, strict=True))
    total = sum(n * size for n, size in zip(counts, sizes, strict=True))
    logger.info(
        "# %s blocks: %s (%.2f GiB KV cache); maximum concurrency for %d tokens per request: %.2fx",
        platform.upper(),
        ", ".join(_group_line(s, n, block_size) for s, n in zip(specs, counts, strict=True)),
        total / 2**30,
        max_model_len,
        concurrency,
    )
    if any(n - 1 < need for n, need in zip(counts, needs, strict=True)) and override is None:
        short = [
            f"{need} blocks of {s.num_layers} layers where it holds {n - 1}"
            for s, n, need in zip(specs, counts, needs, strict=True)
            if n - 1 < need
        ]
        raise ValueError(
            f"One request of max_model_len={max_model_len} tokens needs {'; '.join(short)} "
            f"({total / 2**30:.3f} GiB of KV cache in all). Give the cache more memory "
            "(gpu_memory_utilization, kv_cache_memory_bytes) or lower max_model_len."
        )
    caches, start = [], 0
    for groups in models:
        caches.append(
            tuple(
                abstract_kv_cache(s, n, block_size, dtype, mesh)
                for s, n in zip(groups, counts[start : start + len(groups)], strict=True)
            )
        )
        start += len(groups)
    return caches, counts


def _group_line(spec: CacheSpec, num_blocks: int, block_size: int) -> str:
    kind = "full attention" if spec.window is None else f"sliding window {spec.window}"
    return f"{num_blocks} blocks of {spec.num_layers} layers ({kind})"

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

KV-cache groups (one per attention kind, each with its spec: jllm/kv_cache_interface.py) draw
their blocks from pools: groups of one model whose arrays are identical share a pool and its
one array (row r of each group is row r of the array), others have their own. A pool whose
groups all hold a bounded span per request (sliding window, chunked local attention,
per-request state) is capped at the most that `max_num_seqs` requests can hold in it at once
(the spec's `pool_cap`), and the memory it does not need goes to the other pools, which all
get one count (a model whose every pool is capped has no cap: spare blocks keep more
prefixes cached). Sized from memory, every pool must hold one request of `max_model_len`
tokens in all its groups at once, a windowed group by its span, or start-up fails with the
numbers (vLLM's check).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from jllm.config import DEFAULT_CPU_KV_CACHE_BYTES
from jllm.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    share_pools,
)
from sharding import named_sharding

logger = logging.getLogger(__name__)

CACHE_AXES = ("layers", "cache_blocks", "cache_slots", "cache_kv_heads", "head_dim")


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


def split_blocks(budget: int, sizes: list[int], caps: list[int | None]) -> list[int]:
    """Block counts of pools whose blocks take `sizes` bytes, filling `budget` bytes:
    capped pools get their cap, or the uncapped pools' count where that is smaller; the
    uncapped pools share one count (at least one pool must be uncapped)."""
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


def abstract_kv_cache(spec: KVCacheSpec, num_blocks, block_size, dtype, mesh):
    """A pool's cache (of groups of `spec`'s arrays): its shape, dtype and sharding. Attention
    is [Lg, B, S, 2K, H], each layer's slice the kernel's [B, S, 2K, H] page-major layout,
    sharded on the kv-head axis; other kinds are split on their layer axis (pipeline
    stages), and per-request state, a tuple of arrays, on its head axes too. Lowering
    against it allocates nothing (the profile); `allocate_kv_cache` makes it real."""
    out = []
    arrays = spec.cache_arrays(num_blocks, block_size, dtype)
    state_axes = spec.array_axes() if isinstance(spec, MambaSpec) else ((),) * len(arrays)
    for (shape, array_dtype), inner in zip(arrays, state_axes, strict=True):
        if isinstance(spec, AttentionSpec):
            axes = CACHE_AXES
        else:
            axes = ("layers", None, *inner) if inner else ("layers",)
        axes += (None,) * (len(shape) - len(axes))
        sharding = named_sharding(mesh, axes, shape, "The KV cache")
        out.append(jax.ShapeDtypeStruct(shape, jnp.dtype(array_dtype), sharding=sharding))
    return out[0] if len(out) == 1 else tuple(out)


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
    models: list[tuple[KVCacheSpec, ...]],
    *,
    block_size: int,
    tp: int,
    dtype,
    pp: int = 1,
    dp: int = 1,
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
    """Size the pools from memory (per device: each spec's `shard` over `tp` devices and
    `pp` pipeline stages) and log them as vLLM does. `models`: the model's KV-cache groups'
    specs, then a speculative draft model's if any; each model's groups share pools by
    `share_pools`, never another model's (each model's forward takes its own arrays).
    `max_step_tokens`: the most tokens a step computes for one request (drafts included).
    `profile(abstract caches) -> bytes`: what the largest step needs
    (`ModelRunner.profile_step_bytes`; with a draft, the pair (target's, draft's)).
    `override` (num_gpu_blocks_override): every uncapped pool's count, and a capped pool's
    up to its cap. Returns (each model's tuple of pool caches, abstract: `allocate_kv_caches`
    makes them; the KVCacheConfig: every group's spec and pool, every pool's block count).
    With `dp` data shards each shard's devices hold that count of blocks: the arrays hold
    `dp` times as many, their block axis split over the mesh's `data` axis, and the
    KVCacheConfig counts one shard's (each shard's KVCacheManager hands out its own)."""
    own, pools = [], []  # each model's pools (each the specs of its groups); each group's
    for groups in models:
        shared = share_pools(groups)
        pools += [sum(map(len, own)) + p for p in shared]
        own.append(
            [
                [s for s, q in zip(groups, shared, strict=True) if q == p]
                for p in range(max(shared, default=-1) + 1)
            ]
        )
    members = [m for model_pools in own for m in model_pools]
    sizes = [m[0].shard(tp, pp).page_size_bytes(block_size, dtype) for m in members]
    caps = [_pool_cap(m, block_size, max_num_seqs, max_step_tokens) for m in members]
    if all(cap is not None for cap in caps):
        caps = [None] * len(members)  # no pool grows with the context: spare blocks cache

    def abstract(num_blocks):  # each model's tuple of pool caches
        counts, out = iter(num_blocks), []
        for model_pools in own:
            out.append(
                tuple(
                    abstract_kv_cache(m[0], dp * next(counts), block_size, dtype, mesh)
                    for m in model_pools
                )
            )
        return out

    def step_bytes():
        small = abstract([4] * len(members))
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

    def need(m, step_tokens):  # the blocks one max_model_len request holds in a pool
        return sum(s.max_blocks_per_request(max_model_len, block_size, step_tokens) for s in m)

    needs = [need(m, max_step_tokens) for m in members]
    # Requests of max_model_len tokens the pools hold at once while they decode (a windowed
    # group's need while a step computes many tokens is the start-up check's, below).
    concurrency = min((n - 1) / need(m, 1) for n, m in zip(counts, members, strict=True))
    total = sum(n * size for n, size in zip(counts, sizes, strict=True))
    logger.info(
        "# %s blocks%s: %s (%.2f GiB KV cache); maximum concurrency for %d tokens per request: "
        "%.2fx",
        platform.upper(),
        "" if dp == 1 else f" per data shard (of {dp})",
        ", ".join(_pool_line(m, n) for m, n in zip(members, counts, strict=True)),
        total / 2**30,
        max_model_len,
        concurrency,
    )
    if any(n - 1 < need for n, need in zip(counts, needs, strict=True)) and override is None:
        short = [
            f"{need} blocks of {m[0].num_layers} layers where it holds {n - 1}"
            for m, n, need in zip(members, counts, needs, strict=True)
            if n - 1 < need
        ]
        raise ValueError(
            f"One request of max_model_len={max_model_len} tokens needs {'; '.join(short)} "
            f"({total / 2**30:.3f} GiB of KV cache in all). Give the cache more memory "
            "(gpu_memory_utilization, kv_cache_memory_bytes) or lower max_model_len."
        )
    specs = tuple(s for groups in models for s in groups)
    return abstract(counts), KVCacheConfig(
        specs=specs, pools=tuple(pools), num_blocks=tuple(counts)
    )


def _pool_cap(specs, block_size: int, max_num_seqs: int, max_step_tokens: int):
    """A pool's cap: the sum of its groups' (each counts the null block once), or None when
    any group's need grows with the context."""
    caps = [s.pool_cap(block_size, max_num_seqs, max_step_tokens) for s in specs]
    return None if None in caps else sum(caps) - len(caps) + 1


def _pool_line(specs, num_blocks: int) -> str:
    kinds = " + ".join(s.describe() for s in specs)
    return f"{num_blocks} blocks of {specs[0].num_layers} layers ({kinds})"

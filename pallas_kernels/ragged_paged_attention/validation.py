"""Input checks for ragged paged attention, shared by the kernel and the reference.

Only static properties are checked (ranks, dtypes, shapes), so the checks run unchanged
on concrete arrays and on tracers under ``jax.jit``. Errors are ``ValueError`` with a
message that names the offending argument.
"""

import jax
import jax.numpy as jnp

from .cache import check_fp8_dtype


def _shape(name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _int32(name: str, x, rank: int) -> tuple[int, ...]:
    shape = _shape(name, x)
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {shape}")
    if jnp.dtype(x.dtype) != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    return shape


def validate_inputs(
    q, kv_cache, kv_lens, block_tables, query_start, query_lens, num_seqs, fp8_dtype=None
) -> None:
    """Raises ValueError unless the arguments form a consistent ragged paged batch.

    Expected: q [T, N, H] float; kv_cache [B, S, 2K, H] float (or uint8 float8 bytes with
    `fp8_dtype` naming the format, cache.py) with N % K == 0;
    kv_lens, query_start, query_lens [R] int32; block_tables [R, P] int32;
    num_seqs an int, an int32 scalar or an int32 array of shape [1].
    """
    q_shape = _shape("q", q)
    if len(q_shape) != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q_shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    t, n, h = q_shape
    if min(t, n, h) < 1:
        raise ValueError(f"q must have non-empty dimensions, got shape {q_shape}")

    kv_shape = _shape("kv_cache", kv_cache)
    if len(kv_shape) != 4:
        raise ValueError(f"kv_cache must be [B, S, 2K, H], got shape {kv_shape}")
    check_fp8_dtype(kv_cache.dtype, fp8_dtype)
    if fp8_dtype is None and not jnp.issubdtype(kv_cache.dtype, jnp.floating):
        raise ValueError(f"kv_cache must be floating point, got {kv_cache.dtype}")
    _, s, two_k, kv_h = kv_shape
    if s < 1 or two_k < 2 or two_k % 2:
        raise ValueError(
            f"kv_cache must be [B, S, 2K, H] with S >= 1 and an even, non-zero head axis "
            f"(K and V interleaved), got shape {kv_shape}"
        )
    if kv_h != h:
        raise ValueError(f"head dim mismatch: q has H={h}, kv_cache has H={kv_h}")
    k = two_k // 2
    if n % k:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={k}")

    (r,) = _int32("kv_lens", kv_lens, 1)
    bt_shape = _int32("block_tables", block_tables, 2)
    if bt_shape[0] != r or bt_shape[1] < 1:
        raise ValueError(f"block_tables must be [R={r}, P>=1], got shape {bt_shape}")
    for name, x in (("query_start", query_start), ("query_lens", query_lens)):
        if _int32(name, x, 1) != (r,):
            raise ValueError(f"{name} must be [R={r}], got shape {tuple(x.shape)}")

    if isinstance(num_seqs, int):
        return
    ns_shape = _shape("num_seqs", num_seqs)
    if ns_shape not in ((), (1,)) or jnp.dtype(num_seqs.dtype) != jnp.int32:
        raise ValueError(
            f"num_seqs must be an int32 scalar or [1] array, got {num_seqs.dtype}{list(ns_shape)}"
        )


def validate_q_horizon(q_horizon, num_tokens: int) -> None:
    """Raises ValueError unless `q_horizon` is None or an int32 [T] array, T = `num_tokens`
    (q's rows)."""
    if q_horizon is not None and _int32("q_horizon", q_horizon, 1) != (num_tokens,):
        raise ValueError(
            f"q_horizon must be [T={num_tokens}] (one per query row), got shape "
            f"{tuple(q_horizon.shape)}"
        )


def as_stacked(kv_cache, layer, latent: bool = False):
    """A kernel's cache argument as (stacked cache [L, B, S, 2K, H], the layer to read, that
    layer's shape and dtype for `validate_inputs`). A stacked cache needs ``layer``; a
    one-layer cache [B, S, 2K, H] takes none and becomes layer 0 of a stack of one. A latent
    cache has no head axis: [L, B, S, H] stacked, [B, S, H] for one layer."""
    layout = "[L, B, S, H]" if latent else "[L, B, S, 2K, H]"
    if kv_cache.ndim == (4 if latent else 5):
        if layer is None:
            raise ValueError(f"a stacked kv_cache {layout} needs layer=")
    elif layer is not None:
        raise ValueError(f"layer= needs the stacked kv_cache {layout}")
    else:
        kv_cache, layer = kv_cache[None], 0
    return kv_cache, layer, jax.ShapeDtypeStruct(kv_cache.shape[1:], kv_cache.dtype)


def stacked_and_checked(q, kv_cache, layer, metadata, fp8_dtype, latent=False, v_head_dim=None):
    """A kernel's cache as (the stacked cache, the layer to read) by `as_stacked`, after
    `validate_inputs` on it and `metadata` (kv_lens, block_tables, query_start, query_lens,
    num_seqs). The values are a value head's lanes (no `v_head_dim`) or, with `latent`, the
    first `v_head_dim` lanes of one latent cache ([B, S, H] a layer)."""
    kv_cache, layer, layer_view = as_stacked(kv_cache, layer, latent)
    if latent:
        validate_latent(layer_view, v_head_dim)
        layer_view = latent_as_kv(layer_view)
    elif v_head_dim is not None:
        raise ValueError(
            "the kernels take v_head_dim only with a latent cache (latent=True); a layer whose "
            "values are narrower than its keys runs on the XLA attention"
        )
    validate_inputs(q, layer_view, *metadata, fp8_dtype)
    return kv_cache, layer


def validate_options(
    sm_scale, sliding_window, soft_cap, *, chunk_size=None, v_head_dim=None, head_dim=None
) -> None:
    """Raises ValueError on out-of-range attention options (`v_head_dim` at most the
    cache's `head_dim`, where given)."""
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    for name, value in (
        ("sliding_window", sliding_window),
        ("chunk_size", chunk_size),
        ("v_head_dim", v_head_dim),
    ):
        if value is not None and (int(value) != value or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    if v_head_dim is not None and head_dim is not None and v_head_dim > head_dim:
        raise ValueError(
            f"v_head_dim={v_head_dim} exceeds the cache's head dim {head_dim}: the values are "
            "the first v_head_dim lanes of each value head"
        )


def validate_latent(kv_cache, v_head_dim) -> None:
    """Raises ValueError unless `kv_cache` is a latent cache [B, S, H] whose values are its
    first `v_head_dim` lanes, fewer than H."""
    shape = _shape("kv_cache", kv_cache)
    if len(shape) != 3:
        raise ValueError(f"a latent kv_cache is [B, S, H] (no head axis), got shape {shape}")
    if v_head_dim is None or not 0 < v_head_dim < shape[-1]:
        raise ValueError(
            f"a latent cache's values are its first v_head_dim lanes, fewer than its {shape[-1]}: "
            f"got v_head_dim={v_head_dim}"
        )


def latent_as_kv(kv_cache) -> jax.ShapeDtypeStruct:
    """A latent cache [B, S, H] as the [B, S, 2K, H] layout of one KV head that
    `validate_inputs` checks (its keys and values are one vector)."""
    b, s, h = kv_cache.shape
    return jax.ShapeDtypeStruct((b, s, 2, h), kv_cache.dtype)


def validate_sinks(sinks, num_heads: int, latent: bool = False) -> None:
    """Raises ValueError unless `sinks` is None or a float [N] array, N = `num_heads` (q's
    heads), and not beside a latent cache (`latent`: MLA has no sinks, and the kernels
    take none there)."""
    if sinks is None:
        return
    if latent:
        raise ValueError("sinks with a latent (MLA) cache are not supported")
    shape = _shape("sinks", sinks)
    if shape != (num_heads,):
        raise ValueError(f"sinks must be [N={num_heads}] (one per query head), got {shape}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be floating point, got {sinks.dtype}")

"""The random draw of the sampler: top-k, top-p and min-p filtering, then an exponential race.

A row's token depends only on its own filtered distribution, its seed and its output index:
never on its neighbours, its bucket or which internal path computed it.

- Kept set. min-p zeroes tokens below `min_p * max` before this module; top-k keeps tokens
  at least as likely as the k-th most likely, top-p (relative to what top-k kept) the most
  likely tokens until their mass reaches `top_p`. Both are thresholds on the probability,
  so a token tied with the last kept one is kept too (vLLM's top-k masks the same way).
- Draw. The exponential race (as vLLM's sampler): the token is argmax p_i / q_i over the
  kept set, with q_i ~ Exp(1). The q_i are a keyed hash of the token id under the row's key
  (derived with JAX's threefry from seed and output index), so a path that looks at 256
  candidates and a path that looks at the whole vocabulary draw the same q for a token, and
  pick the same winner from the same kept set.
- Two paths. The candidate path works on the 256 most likely tokens; it is exact for a row
  when every kept token is among them (its threshold lies above the 256th probability).
  Other rows (top-p reaching past the candidates, 256 < top_k < V, plain temperature
  sampling) take the vocabulary path, which finds its thresholds by an exact bisection over
  float bit patterns. Which path a row takes depends on its own distribution only.

Costs on the 2-core CPU at [64, 49152]: top_k(256) ~6 ms, a full-vocabulary race ~4 ms
(threefry per token was ~140 ms, hence the hash), the bisection ~1 ms per step.

Glossary: R requests, V vocab, C candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NUM_CANDIDATES = 256
# Non-negative float32s order as their int32 bit patterns, all below 2**31.
_BISECT_STEPS = 31


def row_keys(seed_lo, seed_hi, counter):
    """Per row [R] -> [R, 2] uint32: the key of the draw for output index `counter`."""

    def one(lo, hi, c):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(lo), hi), c)
        return jax.random.key_data(key)

    return jax.vmap(one)(seed_lo, seed_hi, counter)


def _fmix32(h):
    """MurmurHash3's finaliser: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def exponentials(keys, ids):
    """Exp(1) variates [R, n] for token ids [R, n] (or [1, n]) under row keys [R, 2]. For a
    fixed key the map from id to hash is a bijection, so no two tokens share a 32-bit hash."""
    h = _fmix32(ids.astype(jnp.uint32) ^ keys[:, :1])
    h = _fmix32(h ^ keys[:, 1:])
    u = ((h >> 8).astype(jnp.float32) + 0.5) * np.float32(2.0**-24)  # (0, 1)
    return -jnp.log(u)


def first_argmax(x):
    """argmax over the last axis, first index on ties ([R, n] -> [R] int32); a row of NaNs
    gives an index in range. XLA's CPU argmax (a variadic reduce) is ~7x slower than a max
    and a min, and one max-and-min pass over the whole row writes an int32 copy of it
    (1.7 ms for 64 rows of SmolLM2's 49152 logits on 2 Zen 4 cores). So: the max of each
    block of about 1024, the first block holding the row's max, and the first index of the
    max inside that block only (0.39 ms there; 3.4 ms against 21.7 ms for 256 rows)."""
    n = x.shape[-1]
    c = _block_size(n)
    if c == n:
        return _first_max_index(x, x.max(-1, keepdims=True))
    pad = -n % c
    if pad:
        low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else _lowest(x.dtype)
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=low)
    blocks = x.reshape(*x.shape[:-1], -1, c)  # [R, n / c, c]
    block_max = blocks.max(-1)
    best = block_max.max(-1, keepdims=True)
    block = _first_max_index(block_max, best)  # NaN rows: the last block
    inside = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
    return jnp.minimum(block * c + _first_max_index(inside, best), n - 1)


def _first_max_index(x, best):
    """First index along the last axis where x equals `best` (clamped to the last index)."""
    n = x.shape[-1]
    idx = jnp.min(jnp.where(x == best, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(idx, n - 1)


def _lowest(dtype):
    """The smallest value of an integer or bool dtype (first_argmax's padding)."""
    return False if dtype == jnp.bool_ else jnp.iinfo(dtype).min


def _block_size(n: int) -> int:
    """first_argmax's block: n itself up to 2048, else the divisor of n nearest 1024 within
    256-4096 (no padding copy), else 1024."""
    if n <= 2048:
        return n
    divisors = [c for c in range(256, 4097) if n % c == 0]
    return min(divisors, key=lambda c: abs(c - 1024)) if divisors else 1024


def _race(p, q):
    """Index of the winner of the exponential race among tokens with p > 0 ([R, n] -> [R])."""
    return first_argmax(p / q)


def _largest_threshold(values, target, measure):
    """Per row, the largest float t with measure(values >= t) >= target [R, 1], exactly:
    values >= 0 and 0 < target <= measure(everything)."""
    as_float = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)  # noqa: E731
    lo = jnp.zeros(values.shape[:1] + (1,), jnp.int32)  # 0.0 satisfies the target
    hi = jax.lax.bitcast_convert_type(values.max(-1, keepdims=True), jnp.int32) + 1  # fails

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = measure(values, values >= as_float(mid)) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return as_float(lo)


def _count(values, mask):
    # A float sum of a select: XLA's CPU reduction of a converted mask is twice as slow.
    return jnp.where(mask, 1.0, 0.0).sum(-1, keepdims=True)


def _mass(values, mask):
    return jnp.where(mask, values, 0.0).sum(-1, keepdims=True)


def candidate_draw(p, total, top_k, top_p, keys):
    """The draw among the C most likely tokens. p [R, V] (min-p applied), total [R, 1] its
    mass, top_k [R, 1] (V when off), top_p [R, 1]. Returns (token [R], exact [R]): exact
    where every token the row keeps is a candidate, so the token is the row's true draw."""
    V = p.shape[-1]
    C = min(NUM_CANDIDATES, V)
    # The barriers keep XLA's CPU TopK: without them, slices of the outputs fold into the
    # sort that top_k lowers to, the TopK rewrite no longer matches, and a full sort of
    # [64, 49152] runs instead (~200 ms against ~11 ms, 2-core CPU). One barrier per output:
    # XLA 0.11's TopK decomposer aborts when a barrier takes TopK's tuple whole.
    cand_p, cand_ids = jax.lax.top_k(p, C)  # [R, C] descending
    cand_p = jax.lax.optimization_barrier(cand_p)
    cand_ids = jax.lax.optimization_barrier(cand_ids)
    t_k = jnp.take_along_axis(cand_p, jnp.clip(top_k - 1, 0, C - 1), axis=-1)  # [R, 1]
    t_k = jnp.where(top_k >= V, 0.0, t_k)
    kept_k = jnp.where(cand_p >= t_k, cand_p, 0.0)
    mass_k = jnp.where(top_k >= V, total, kept_k.sum(-1, keepdims=True))
    reach = jnp.cumsum(kept_k, axis=-1) >= top_p * mass_k  # [R, C]
    m = jnp.clip(first_argmax(reach)[:, None], 0, C - 1)
    t_p = jnp.where(top_p >= 1.0, 0.0, jnp.take_along_axis(cand_p, m, axis=-1))
    t = jnp.maximum(t_k, t_p)  # [R, 1]
    last = cand_p[:, -1:]
    exact = (
        ((top_k <= C) | (top_k >= V))
        & ((top_p >= 1.0) | reach.any(-1, keepdims=True))
        & ((C == V) | (t > last) | (last <= 0.0))
    )
    kept = jnp.where(cand_p >= t, cand_p, 0.0)
    idx = _race(kept, exponentials(keys, cand_ids))
    token = jnp.take_along_axis(cand_ids, idx[:, None], axis=-1)[:, 0]
    return token.astype(jnp.int32), exact[:, 0]


def vocab_draw(p, total, top_k, top_p, keys):
    """The same draw over the whole vocabulary (arguments as `candidate_draw`) -> [R]."""
    V = p.shape[-1]
    kept = jnp.where(p >= _vocab_threshold(p, total, top_k, top_p), p, 0.0)
    ids = jnp.arange(V, dtype=jnp.int32)[None, :]
    return _race(kept, exponentials(keys, ids))


def kept_tokens(p, top_k, top_p, min_p):
    """Which tokens a row's draw may pick [R, V] bool: probs p [R, V] under min_p, top_k
    [R] (0: off) and top_p [R] (what `processed_logprobs` keeps; `filtered_draw` draws
    among exactly these)."""
    V = p.shape[-1]
    floor = min_p[:, None] * p.max(-1, keepdims=True)
    p = jnp.where(p >= floor, p, 0.0)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]
    t = _vocab_threshold(p, p.sum(-1, keepdims=True), k, top_p[:, None])
    return (p >= t) & (p > 0.0)


def _vocab_threshold(p, total, top_k, top_p):
    """The probability [R, 1] at or above which a token survives top_k [R, 1] (V when
    off) and top_p [R, 1] (p: min-p applied; total its mass)."""
    V = p.shape[-1]
    t_k = jax.lax.cond(
        jnp.any(top_k < V),
        lambda: jnp.where(top_k < V, _largest_threshold(p, top_k.astype(jnp.float32), _count), 0),
        lambda: jnp.zeros_like(total),
    )
    kept_k = jnp.where(p >= t_k, p, 0.0)
    mass_k = jnp.where(top_k >= V, total, kept_k.sum(-1, keepdims=True))
    t_p = jax.lax.cond(
        jnp.any(top_p < 1.0),
        lambda: jnp.where(top_p < 1.0, _largest_threshold(kept_k, top_p * mass_k, _mass), 0),
        lambda: jnp.zeros_like(total),
    )
    return jnp.maximum(t_k, t_p)


def filtered_draw(p, top_k, top_p, min_p, sampled, keys):
    """One token per row from probs p [R, V] under top_k [R] (0: off), top_p, min_p [R].
    Rows where `sampled` is False (greedy, padding) get an arbitrary token."""
    V = p.shape[-1]
    p = jnp.where(p >= min_p[:, None] * p.max(-1, keepdims=True), p, 0.0)
    total = p.sum(-1, keepdims=True)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]
    tp = top_p[:, None]
    filtered = sampled & ((k[:, 0] < V) | (top_p < 1.0) | (min_p > 0.0))

    def candidates():
        token, exact = candidate_draw(p, total, k, tp, keys)
        return token, exact | ~sampled

    def no_candidates():  # every sampled row takes the vocabulary path
        return jnp.zeros(sampled.shape, jnp.int32), ~sampled

    # One vocabulary path in the program, after the candidates, where there were two (in
    # each branch of whether any row is filtered): the draw is about half of a sampler's
    # compile; a 16-row sampler traced 624 equations instead of 793 and compiled in about
    # 1.45 s instead of 1.7 (2-core Zen 3, a tiny Llama with SmolLM2's 49152 tokens).
    token, exact = jax.lax.cond(jnp.any(filtered), candidates, no_candidates)
    return jax.lax.cond(
        jnp.all(exact),
        lambda: token,
        lambda: jnp.where(exact, token, vocab_draw(p, total, k, tp, keys)),
    )

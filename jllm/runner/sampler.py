"""On-device sampling, in vLLM's order and with vLLM's semantics.

raw logprobs (returned when asked) -> min_tokens suppression -> repetition / frequency /
presence penalties -> greedy argmax, or temperature -> min_p -> top_k -> top_p -> sample.
Each sequence draws from its own key, `fold_in(key(seed), output_index)`, so a seeded request
produces the same text whatever else shares its batch and even after preemption.

One executable per row bucket: the passes a batch needs are chosen on device (lax.cond).

Glossary: R requests, V vocab, M suppressed ids per request, J logprobs returned.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jllm.sampling_params import SAMPLING_EPS


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed_lo",
        "seed_hi",
        "counter",
        "presence",
        "frequency",
        "repetition",
        "penalty_rows",
        "suppress",
        "want_logprobs",
    ],
    meta_fields=[],
)
@dataclasses.dataclass
class SamplingMetadata:
    temperature: jax.Array  # [R] float32
    top_p: jax.Array  # [R] float32
    top_k: jax.Array  # [R] int32, 0 = off
    min_p: jax.Array  # [R] float32
    seed_lo: jax.Array  # [R] uint32
    seed_hi: jax.Array  # [R] uint32
    counter: jax.Array  # [R] int32, index of the token being sampled
    presence: jax.Array  # [R] float32
    frequency: jax.Array  # [R] float32
    repetition: jax.Array  # [R] float32
    penalty_rows: jax.Array  # [R] int32, row in the penalty state (0: none)
    suppress: jax.Array  # [R, M] int32 token ids to mask (min_tokens), V for none
    want_logprobs: jax.Array  # [R] bool


def _row_uniform(seed_lo, seed_hi, counter):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_lo), seed_hi), counter)
    return jax.random.uniform(key, (), jnp.float32)


def _draw(probs, u):
    """Inverse-CDF draw from unnormalised probs [R, V] with uniforms u [R]."""
    cdf = jnp.cumsum(probs, axis=-1)  # [R, V]
    target = u[:, None] * cdf[:, -1:]
    idx = jnp.sum(cdf < target, axis=-1)
    return jnp.minimum(idx, probs.shape[-1] - 1).astype(jnp.int32)


def _apply_penalties(logits, md: SamplingMetadata, counts, prompt_mask):
    c = counts[md.penalty_rows]  # [R, V] int32 occurrences in the output
    seen = (c > 0) | prompt_mask[md.penalty_rows]  # [R, V]
    rep = md.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency[:, None] * c.astype(jnp.float32)
    return logits - md.presence[:, None] * (c > 0).astype(jnp.float32)


# Candidates of the fast top-k/top-p path. Rows whose top-p set reaches past them take the
# bisection path instead; lax.cond runs only the branch taken. (A full sort of [64, 49152]
# costs ~230 ms on the 2-core CPU; top_k(256) ~11 ms; the bisection ~25 ms.)
NUM_CANDIDATES = 256
_BISECT_STEPS = 32


def _largest_threshold(values, target, measure):
    """Per row, the largest t with measure(values where values >= t) >= target [R, 1]."""
    lo = jnp.zeros_like(values[:, :1])
    hi = values.max(-1, keepdims=True)

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = measure(values, values >= mid) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def _count(values, mask):
    return mask.sum(-1, keepdims=True).astype(values.dtype)


def _mass(values, mask):
    return jnp.where(mask, values, 0.0).sum(-1, keepdims=True)


def _filtered_draw(probs, md: SamplingMetadata, u):
    """top_k then top_p (relative to what top_k kept) on probs [R, V], then a draw.

    A token survives top_p when the mass of the tokens strictly more likely than it is below
    top_p, as in vLLM; at least the most likely token always survives.
    """
    R, V = probs.shape
    C = min(NUM_CANDIDATES, V)
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, V), V)[:, None]  # [R, 1]
    top_p = md.top_p[:, None]

    top_p_cand, top_ids = jax.lax.top_k(probs, C)  # [R, C] descending

    def fast(cand_p, cand_ids):
        rank = jnp.arange(C)[None, :]
        cand_p = jnp.where(rank < k, cand_p, 0.0)
        kept_mass = jnp.where(k <= C, cand_p.sum(-1, keepdims=True), probs.sum(-1, keepdims=True))
        before = jnp.cumsum(cand_p, axis=-1) - cand_p
        keep = (before < top_p * kept_mass) | (rank == 0)
        picked = _draw(jnp.where(keep, cand_p, 0.0), u)
        return jnp.take_along_axis(cand_ids, picked[:, None], axis=-1)[:, 0]

    def bisect(cand_p, cand_ids):
        t_k = jnp.where(k < V, _largest_threshold(probs, k, _count), 0.0)
        p_k = jnp.where(probs >= t_k, probs, 0.0)
        t_p = _largest_threshold(p_k, top_p * p_k.sum(-1, keepdims=True), _mass)
        return _draw(jnp.where(p_k >= jnp.maximum(t_p, 1e-38), p_k, 0.0), u)

    exact = (k[:, 0] <= C) | (top_p_cand.sum(-1) >= md.top_p * probs.sum(-1))
    return jax.lax.cond(jnp.all(exact), fast, bisect, top_p_cand, top_ids)


@partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits, md: SamplingMetadata, counts, prompt_mask, *, num_logprobs):
    """logits [R, V] -> tokens [R], sampled logprob [R], rank [R], top ids/logprobs [R, J].

    Which passes run (penalties, sampling, top-k/top-p, logprobs) is decided on device from
    the batch with lax.cond, so one executable per row bucket serves every mix of requests.
    """
    logits = logits.astype(jnp.float32)
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    processed = logits.at[rows, md.suppress].set(-jnp.inf, mode="drop")
    processed = jax.lax.cond(
        jnp.any(md.penalty_rows > 0),
        lambda x: _apply_penalties(x, md, counts, prompt_mask),
        lambda x: x,
        processed,
    )
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    greedy_row = md.temperature < SAMPLING_EPS

    def sampled():
        temp = jnp.where(greedy_row, 1.0, md.temperature)
        x = processed / temp[:, None]
        probs = jax.nn.softmax(x, axis=-1)
        min_keep = probs >= md.min_p[:, None] * probs.max(-1, keepdims=True)
        u = jax.vmap(_row_uniform)(md.seed_lo, md.seed_hi, md.counter)
        filtered = jnp.any(~greedy_row & ((md.top_k > 0) | (md.top_p < 1.0)))
        drawn = jax.lax.cond(
            filtered,
            lambda: _filtered_draw(jnp.where(min_keep, probs, 0.0), md, u),
            lambda: _draw(jnp.where(min_keep, probs, 0.0), u),
        )
        return jnp.where(greedy_row, greedy, drawn)

    tokens = jax.lax.cond(jnp.all(greedy_row), lambda: greedy, sampled)

    def logprobs():
        raw = jax.nn.log_softmax(logits, axis=-1)  # [R, V]
        token_lp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]  # [R]
        rank = jnp.sum(raw > token_lp[:, None], axis=-1).astype(jnp.int32) + 1
        top_lp, top_ids = jax.lax.top_k(raw, num_logprobs)  # [R, J]
        return token_lp, rank, top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        return (
            jnp.zeros((R,), jnp.float32),
            jnp.zeros((R,), jnp.int32),
            jnp.zeros((R, num_logprobs), jnp.int32),
            jnp.zeros((R, num_logprobs), jnp.float32),
        )

    out = (tokens, *jax.lax.cond(jnp.any(md.want_logprobs), logprobs, no_logprobs))
    # Under a mesh (the runner lowers inside `jax.set_mesh`) every process gets the whole
    # result, which process 0 reads back.
    if not jax.sharding.get_abstract_mesh().empty:
        out = jax.lax.with_sharding_constraint(out, jax.sharding.PartitionSpec())
    return out

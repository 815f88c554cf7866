"""The seeded draw: the candidate path and the vocabulary path agree wherever the candidate
path claims to be exact, the kept set follows numpy references of top-k / top-p / min-p, and
a row's token never depends on the rest of its batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jllm.runner.draw import (
    NUM_CANDIDATES,
    candidate_draw,
    exponentials,
    filtered_draw,
    first_argmax,
    row_keys,
    vocab_draw,
)

R, V = 8, 1024
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


def kept_reference(p, top_k, top_p, min_p):
    """numpy: min-p, then top-k and top-p as thresholds (ties with the last kept are kept)."""
    p = np.where(p >= min_p * p.max(), p, 0.0)
    desc = np.sort(p)[::-1]
    t_k = desc[top_k - 1] if 0 < top_k < len(p) else 0.0
    kept = np.where(p >= t_k, p, 0.0)
    if top_p < 1.0:
        desc = np.sort(kept)[::-1]
        m = np.argmax(np.cumsum(desc) >= top_p * kept.sum())
        kept = np.where(kept >= desc[m], kept, 0.0)
    return kept > 0


@jax.jit
def both_paths(p, top_k, top_p, min_p, keys):
    V = p.shape[-1]
    p = jnp.where(p >= min_p[:, None] * p.max(-1, keepdims=True), p, 0.0)
    total = p.sum(-1, keepdims=True)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]
    token, exact = candidate_draw(p, total, k, top_p[:, None], keys)
    return token, exact, vocab_draw(p, total, k, top_p[:, None], keys)


draw = jax.jit(filtered_draw)


def probs_from(seed, scale, bf16):
    logits = np.random.default_rng(seed).normal(0, scale, (R, V)).astype(np.float32)
    if bf16:  # bf16 logits: many exact ties
        logits = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    return np.asarray(jax.nn.softmax(logits, axis=-1))


def keys_for(seeds, counter=0):
    seeds = np.asarray(seeds, np.uint32)
    return row_keys(seeds, seeds * 0 + 3, np.full(len(seeds), counter, np.int32))


rows = st.fixed_dictionaries(
    {
        "top_k": st.sampled_from([0, 1, 2, 7, 100, NUM_CANDIDATES - 1, NUM_CANDIDATES, 300, V]),
        "top_p": st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1]),
        "min_p": st.sampled_from([0.0, 0.0, 0.01, 0.2]),
    }
)


@PROPERTY
@given(
    seed=st.integers(0, 2**20),
    scale=st.sampled_from([0.05, 0.5, 2.0, 6.0]),
    bf16=st.booleans(),
    params=st.lists(rows, min_size=R, max_size=R),
)
def test_candidate_path_agrees_with_vocabulary_path(seed, scale, bf16, params):
    p = probs_from(seed, scale, bf16)
    top_k = np.array([r["top_k"] for r in params], np.int32)
    top_p = np.array([r["top_p"] for r in params], np.float32)
    min_p = np.array([r["min_p"] for r in params], np.float32)
    token, exact, full = (
        np.asarray(x) for x in both_paths(p, top_k, top_p, min_p, keys_for(np.arange(R) + seed))
    )
    np.testing.assert_array_equal(token[exact], full[exact])
    for r in range(R):
        kept = kept_reference(p[r].astype(np.float64), top_k[r], top_p[r], min_p[r])
        assert kept[full[r]], f"row {r} drew a token outside its kept set"
        if exact[r]:
            # Exact means every kept token is one of the candidates.
            assert kept.sum() <= NUM_CANDIDATES


def test_both_paths_are_exercised():
    """Guards the property above: flat rows fall back to the vocabulary path, peaked ones
    do not."""
    flat, peaked = probs_from(1, 0.05, False), probs_from(1, 6.0, False)
    ones = np.ones(R, np.float32)
    zero = np.zeros(R, np.int32)
    _, exact_flat, _ = both_paths(flat, zero, ones * 0.9, ones * 0, keys_for(np.arange(R)))
    _, exact_peaked, _ = both_paths(peaked, zero, ones * 0.9, ones * 0, keys_for(np.arange(R)))
    assert not np.asarray(exact_flat).any() and np.asarray(exact_peaked).all()


def test_exponentials_of_a_subset_equal_the_whole():
    keys = keys_for([5, 6], counter=9)
    whole = np.asarray(exponentials(keys, jnp.arange(V)[None, :]))
    ids = np.random.default_rng(0).choice(V, (2, 50), replace=False)
    np.testing.assert_array_equal(
        np.asarray(exponentials(keys, jnp.asarray(ids))), whole[[[0], [1]], ids]
    )
    assert (whole > 0).all() and np.isfinite(whole).all()


@PROPERTY
@given(
    seed=st.integers(0, 2**20),
    scale=st.sampled_from([0.05, 0.5, 2.0, 6.0]),
    params=st.lists(rows, min_size=R, max_size=R),
    sampled=st.lists(st.booleans(), min_size=R, max_size=R),
)
def test_a_rows_token_is_its_own(seed, scale, params, sampled):
    """Each sampled row alone gives the token it gets inside any batch (greedy and padding
    rows beside it change which paths run)."""
    p = probs_from(seed, scale, False)
    top_k = np.array([r["top_k"] for r in params], np.int32)
    top_p = np.array([r["top_p"] for r in params], np.float32)
    min_p = np.array([r["min_p"] for r in params], np.float32)
    sampled = np.array(sampled)
    keys = keys_for(np.arange(R) + seed)
    batch = np.asarray(draw(p, top_k, top_p, min_p, sampled, keys))
    for r in np.flatnonzero(sampled):
        alone = draw(
            p[r : r + 1],
            top_k[r : r + 1],
            top_p[r : r + 1],
            min_p[r : r + 1],
            sampled[r : r + 1],
            keys[r : r + 1],
        )
        assert int(alone[0]) == batch[r], f"row {r}"


@given(
    n=st.sampled_from([7, 2048, 2049, 5003, 32000, 49152]),
    levels=st.integers(2, 60),
    seed=st.integers(0, 2**16),
)
@PROPERTY
def test_first_argmax_is_numpys_argmax(n, levels, seed):
    # Few distinct values, so ties across and inside first_argmax's blocks are common; vocab
    # sizes with and without a padded last block, and a single block.
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, (5, n)).astype(np.float32)
    x[1] = -np.inf  # a fully masked row: index 0, as numpy
    x[2, -1] = levels  # the max in the last (padded) block
    x[3, rng.integers(0, n, 3)] = np.inf
    assert (np.asarray(jax.jit(first_argmax)(jnp.asarray(x))) == np.argmax(x, axis=1)).all()
    nans = jnp.full((2, n), jnp.nan)
    assert ((np.asarray(first_argmax(nans)) >= 0) & (np.asarray(first_argmax(nans)) < n)).all()

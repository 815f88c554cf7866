"""The device sampler against numpy references of vLLM's sampling semantics."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jllm.runner.draw import NUM_CANDIDATES
from jllm.runner.sampler import SamplingMetadata, sample, unpack_result


def metadata(R, V, **over):
    fields = dict(
        temperature=np.zeros(R, np.float32),
        top_p=np.ones(R, np.float32),
        top_k=np.zeros(R, np.int32),
        min_p=np.zeros(R, np.float32),
        seed_lo=np.arange(R, dtype=np.uint32),
        seed_hi=np.zeros(R, np.uint32),
        counter=np.zeros(R, np.int32),
        presence=np.zeros(R, np.float32),
        frequency=np.zeros(R, np.float32),
        repetition=np.ones(R, np.float32),
        penalty_rows=np.zeros(R, np.int32),
        suppress=np.full((R, 16), V, np.int32),
        want_logprobs=np.zeros(R, bool),
        want_top=np.ones(R, bool),
        bias_rows=np.zeros(R, np.int32),
        masked=np.zeros(R, bool),
        processors=(),
        batch_row=np.arange(R, dtype=np.int32),
        draft=np.full(R, -1, np.int32),
        group_first=np.arange(R, dtype=np.int32),
        spec_prev=np.full((R, 1), V, np.int32),
    )
    for k, v in over.items():
        fields[k] = np.broadcast_to(np.asarray(v, fields[k].dtype), fields[k].shape).copy()
    arrays = {k: jnp.asarray(v) for k, v in fields.items() if k != "processors"}
    return SamplingMetadata(**arrays, processors=fields["processors"])


def run(logits, md, counts=None, prompt_mask=None, num_logprobs=5, bias=None, bitmask=None):
    R, V = logits.shape
    counts = np.zeros((R + 1, V), np.int32) if counts is None else counts
    prompt_mask = np.zeros((R + 1, V), bool) if prompt_mask is None else prompt_mask
    bias = np.zeros((R + 1, V), np.float32) if bias is None else bias
    last = np.zeros(R + 1, np.int32)
    bitmask = np.zeros((R, (V + 31) // 32), np.int32) if bitmask is None else bitmask
    packed, _, _ = sample(
        jnp.asarray(logits),
        md,
        counts,
        prompt_mask,
        bias,
        last,
        bitmask,
        num_logprobs=num_logprobs,
    )
    tokens, lp, rank, _, top_ids, top_lp = unpack_result(np.asarray(packed), num_logprobs)
    return [tokens, lp, rank, top_ids, top_lp]


def test_penalties_follow_vllm_semantics():
    rng = np.random.default_rng(0)
    R, V = 6, 40
    logits = rng.normal(0, 2, (R, V)).astype(np.float32)
    counts = np.zeros((R + 1, V), np.int32)
    prompt_mask = np.zeros((R + 1, V), bool)
    for r in range(R):
        counts[r + 1, rng.choice(V, 8)] = rng.integers(1, 4, 8)
        prompt_mask[r + 1, rng.choice(V, 8)] = True
    rep = np.array([1.0, 1.5, 0.7, 1.0, 1.0, 2.0], np.float32)
    freq = np.array([0.0, 0.0, 0.0, 0.8, 0.0, -0.5], np.float32)
    pres = np.array([0.0, 0.0, 0.0, 0.0, 1.5, 1.0], np.float32)
    md = metadata(
        R, V, repetition=rep, frequency=freq, presence=pres, penalty_rows=np.arange(1, R + 1)
    )
    tokens = run(logits, md, counts, prompt_mask)[0]
    ref = logits.copy()
    for r in range(R):
        c, seen = counts[r + 1], (counts[r + 1] > 0) | prompt_mask[r + 1]
        ref[r] = np.where(seen, np.where(ref[r] > 0, ref[r] / rep[r], ref[r] * rep[r]), ref[r])
        ref[r] -= freq[r] * c + pres[r] * (c > 0)
    np.testing.assert_array_equal(tokens, ref.argmax(-1))
    assert (tokens != logits.argmax(-1)).any()  # the penalties changed something


def test_suppressed_ids_are_never_chosen():
    logits = np.zeros((2, 10), np.float32)
    logits[:, 3] = 5.0
    suppress = np.full((2, 16), 10, np.int32)
    suppress[0, 0] = 3
    tokens = run(logits, metadata(2, 10, suppress=suppress))[0]
    assert tokens[0] != 3 and tokens[1] == 3


def expected_dist(logits, temperature, top_k, top_p, min_p):
    """vLLM's order: temperature, min_p, top_k, top_p (kept: mass of better tokens < p)."""
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    p = np.where(p >= min_p * p.max(), p, 0.0)
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    if top_k:
        ps[top_k:] = 0.0
    ps = ps / ps.sum()
    before = np.cumsum(ps) - ps
    ps = np.where((before < top_p) | (np.arange(len(ps)) == 0), ps, 0.0)
    out = np.zeros_like(p)
    out[order] = ps / ps.sum()
    return out


# Each case fails with probability ALPHA when the sampler is right (chi-square goodness of
# fit over DRAWS independent draws, bins with an expected count below 5 pooled); the seeds
# are fixed, so the outcome is reproducible.
DRAWS, ALPHA = 20_000, 1e-4


@pytest.mark.parametrize(
    "scale, temperature, top_k, top_p, min_p",
    [
        (1.0, 0.8, 50, 0.9, 0.0),  # peaked: candidate path (41 tokens kept)
        (0.3, 1.0, 0, 0.9, 0.0),  # flat: top-p set beyond the candidates (vocabulary path)
        (0.3, 1.0, 700, 1.0, 0.0),  # top_k beyond the candidates (vocabulary path)
        (0.3, 1.0, 700, 0.8, 0.0),  # both, beyond the candidates
        (1.0, 1.0, 0, 1.0, 0.1),  # min_p only
        (1.0, 0.5, 0, 1.0, 0.0),  # plain temperature sampling
    ],
)
def test_sampling_distribution(scale, temperature, top_k, top_p, min_p):
    V = 1000
    row = (np.random.default_rng(1).normal(0, scale, V)).astype(np.float32)
    want = expected_dist(row.astype(np.float64), temperature, top_k, top_p, min_p)
    if top_k > NUM_CANDIDATES or scale < 1:
        assert (want > 0).sum() > NUM_CANDIDATES or top_k > NUM_CANDIDATES
    md = metadata(
        DRAWS,
        V,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed_lo=np.arange(DRAWS),
        counter=7,
    )
    tokens = run(np.tile(row, (DRAWS, 1)), md)[0]
    assert want[tokens].min() > 0, "sampled a token outside the allowed set"
    observed = np.bincount(tokens, minlength=V).astype(np.float64)
    expected = want * DRAWS
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert keep.sum() >= 5, "too few outcomes for the test to mean anything"
    _, p_value = scipy.stats.chisquare(obs[keep], exp[keep])
    assert p_value > ALPHA, (p_value, int(big.sum()))


def test_seeded_draws_are_reproducible_per_row():
    V, R = 500, 8
    logits = np.random.default_rng(2).normal(0, 1, (R, V)).astype(np.float32)
    md = metadata(R, V, temperature=1.0, seed_lo=42, counter=3)
    a = run(logits, md)[0]
    b = run(logits[::-1].copy(), metadata(R, V, temperature=1.0, seed_lo=42, counter=3))[0]
    np.testing.assert_array_equal(a, b[::-1])  # a row's draw ignores its neighbours
    c = run(logits, metadata(R, V, temperature=1.0, seed_lo=42, counter=4))[0]
    assert (a != c).any()


def test_greedy_rows_in_a_sampled_batch_and_logprobs():
    rng = np.random.default_rng(3)
    R, V = 4, 300
    logits = rng.normal(0, 2, (R, V)).astype(np.float32)
    md = metadata(
        R, V, temperature=[0.0, 1.0, 0.0, 1.0], want_logprobs=True, top_p=[1.0, 0.5, 1.0, 1.0]
    )
    tokens, lp, rank, top_ids, top_lp = run(logits, md, num_logprobs=5)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    ref -= logits.max(-1, keepdims=True)
    for r in range(R):
        np.testing.assert_allclose(lp[r], ref[r, tokens[r]], atol=1e-5)
        assert rank[r] == (ref[r] > ref[r, tokens[r]]).sum() + 1
        np.testing.assert_array_equal(top_ids[r], np.argsort(-ref[r])[:5])
        np.testing.assert_allclose(top_lp[r], np.sort(ref[r])[::-1][:5], atol=1e-5)


def test_grammar_bitmask_masks_only_its_rows():
    """Bit j of word i allows token 32 i + j; rows not marked `masked` ignore the mask."""
    rng = np.random.default_rng(7)
    R, V = 6, 70  # a partial last word
    logits = rng.normal(0, 2, (R, V)).astype(np.float32)
    allowed = rng.random((R, V)) < 0.3
    allowed[:, 0] = True
    padded = np.zeros((R, 96), bool)
    padded[:, :V] = allowed
    bitmask = (padded.reshape(R, 3, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(
        axis=-1
    )
    bitmask = bitmask.astype(np.uint32).view(np.int32)
    masked = np.array([1, 1, 1, 0, 1, 0], bool)
    greedy = metadata(R, V, masked=masked, want_logprobs=True)
    tokens, lp, _, _, top_lp = run(logits, greedy, bitmask=bitmask, num_logprobs=V)
    for r in range(R):
        row = np.where(allowed[r] | ~masked[r], logits[r], -np.inf)
        assert tokens[r] == np.argmax(row)
    # Logprobs are those of the masked distribution (vLLM applies the mask to the logits).
    assert np.isneginf(top_lp[0]).sum() == V - allowed[0].sum()
    for counter in range(20):
        md = metadata(
            R, V, masked=masked, temperature=1.0, seed_lo=np.arange(R) + 11, counter=counter
        )
        tokens = run(logits, md, bitmask=bitmask)[0]
        assert all(allowed[r, tokens[r]] for r in range(R) if masked[r])

"""Attention kinds through the whole engine on the model seams: a test family (tests/
toy_family.py, registered out of tree) whose layers mix chunked local attention, a sliding
window and full attention, every one with attention sinks, and a second whose layers mix an
MLA-shaped latent with full attention, each against a dense float64 numpy oracle: greedy
tokens equal and logprobs within 1e-4, alone, with chunked prefill, under preemption and
from the prefix cache. Chunks of 20 tokens over blocks of 16, so chunk boundaries fall
inside blocks; the chunked group frees what its chunks left behind."""

from __future__ import annotations

import numpy as np
import pytest
import toy_family
from oracle import SMALL, generate, prompt_ids

from jllm import LLM, SamplingParams

CHUNK, WINDOW = 20, 12
PROMPTS = prompt_ids(3, 36, vocab=512)  # 36, 43 and 50 tokens: past one or two chunk ends


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory, tokenizer_dir) -> str:
    toy_family.register()
    root = tmp_path_factory.mktemp("toy")
    return toy_family.save_toy(root, tokenizer_dir, chunk=CHUNK, window=WINDOW)


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory, tokenizer_dir) -> str:
    toy_family.register()
    root = tmp_path_factory.mktemp("latent")
    return toy_family.save_toy(root, tokenizer_dir, layer_types=toy_family.LATENT_TYPES)


def _log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def assert_oracle(path, prompts, outs):
    for prompt, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        tokens = list(prompt) + list(gen.token_ids)
        logprobs = _log_softmax(toy_family.reference_logits(path, tokens[:-1]))
        steps = logprobs[len(prompt) - 1 :]  # the positions that chose each generated token
        assert list(gen.token_ids) == steps.argmax(-1).tolist()
        got = [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
        want = [steps[i, t] for i, t in enumerate(gen.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 16, "enable_prefix_caching": False},  # chunked prefill
        {"num_gpu_blocks_override": 12},  # preemption: full and sliding share a pool
    ],
    ids=["alone", "chunked", "preempting"],
)
def test_chunked_local_sliding_and_sinks_match_the_oracle(toy_dir, settings):
    llm = LLM(toy_dir, **{**SMALL, "dtype": "float32", **settings})
    assert_oracle(toy_dir, PROMPTS, generate(llm, PROMPTS))
    if not settings:  # again from the prefix cache: the first two blocks are hits
        others = prompt_ids(3, 45, seed=3, vocab=512)
        again = [p[:34] + q[34:] for p, q in zip(PROMPTS, others, strict=True)]
        outs = generate(llm, again)
        assert all(o.num_cached_tokens >= 32 for o in outs)
        assert_oracle(toy_dir, again, outs)
    if "num_gpu_blocks_override" in settings:
        # A request longer than the pools hold even alone is refused, not left waiting.
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        with pytest.raises(ValueError, match="KV cache is too small"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], long, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        assert_oracle(toy_dir, PROMPTS[:1], generate(llm, PROMPTS[:1]))


def test_the_masks_and_sinks_matter(toy_dir):
    """The oracle's answer changes without the chunks or without the sinks, so the engine
    agreeing with it is not an accident of a model that ignores them."""
    tokens = PROMPTS[2]
    want = toy_family.reference_logits(toy_dir, tokens)
    full = [t.replace("chunked", "full") for t in toy_family.LAYER_TYPES]
    unchunked = toy_family.reference_logits(toy_dir, tokens, layer_types=full)
    assert np.abs(want[CHUNK:] - unchunked[CHUNK:]).max() > 1e-2
    np.testing.assert_allclose(want[:CHUNK], unchunked[:CHUNK])  # the first chunk: all it sees
    assert np.abs(want - toy_family.reference_logits(toy_dir, tokens, sinks=False)).max() > 1e-2


@pytest.mark.parametrize("backend", ["cpu_kernel", "pallas_interpret"])
def test_the_kernels_take_every_kind(toy_dir, backend):
    """Chunks, windows and sinks mixed in one model, on the C++ kernel and the TPU kernel
    (interpreted), against the oracle, with chunked prefill."""
    settings = {**SMALL, "dtype": "float32", "attention_backend": backend}
    llm = LLM(toy_dir, **{**settings, "max_num_batched_tokens": 32})
    assert llm.llm_engine.runner.backend == backend
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    assert_oracle(toy_dir, PROMPTS, generate(llm, PROMPTS, params))


def test_the_chunked_group_frees_what_its_chunks_left(toy_dir):
    """36 + 300 tokens need 21 blocks at full attention; the chunked group holds at most the
    blocks of its current chunk and the step's tokens, so with every other group given room
    the chunked pool's 6 blocks (its cap for one request) suffice, with the oracle's tokens."""
    settings = {**SMALL, "dtype": "float32", "max_num_seqs": 1, "max_num_batched_tokens": 16}
    llm = LLM(toy_dir, **settings)
    kv = llm.llm_engine.scheduler.kv_cache
    kinds = [spec.describe() for spec in kv.specs]
    assert kinds[0] == f"chunked local attention {CHUNK}"
    chunked = kv.pools[kv.pool_of[0]]
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True, logprobs=1)
    outs = generate(llm, PROMPTS[:1], params)
    assert_oracle(toy_dir, PROMPTS[:1], outs)
    assert chunked.num_blocks - 1 <= 6 < 21


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 10}],
    ids=["alone", "chunked-preempting"],
)
def test_an_mla_shaped_latent_matches_the_oracle(latent_dir, settings):
    """One latent vector per token and layer (kv_lora_rank 32 + rope 8), attended in the
    absorbed form, beside a full-attention layer; prefix hits on the latent group too."""
    llm = LLM(latent_dir, **{**SMALL, "dtype": "float32", **settings})
    kv = llm.llm_engine.scheduler.kv_cache
    assert [spec.describe() for spec in kv.specs] == ["MLA latent 32+8", "full attention"]
    assert_oracle(latent_dir, PROMPTS, generate(llm, PROMPTS))
    if not settings:
        others = prompt_ids(3, 45, seed=3, vocab=512)
        again = [p[:34] + q[34:] for p, q in zip(PROMPTS, others, strict=True)]
        outs = generate(llm, again)
        assert all(o.num_cached_tokens >= 32 for o in outs)
        assert_oracle(latent_dir, again, outs)

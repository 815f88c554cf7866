"""Per-request state (`MambaSpec`) through the whole engine on the model seams: a test family
(tests/state_family.py, registered out of tree) whose linear-attention layers keep a conv
window and a recurrent state per request beside full-attention layers, against a float64
numpy oracle over each whole sequence: greedy tokens equal and logprobs within 1e-4, alone,
with chunked prefill (the state carried across chunks, decode rows beside prefill chunks),
under preemption (the slot freed, the request recomputed from zero state), one step ahead
(async scheduling), and with prefix caching on without state snapshots (no hits taken);
with snapshots, a sleep forgets them, and the host tier never loads another prompt's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import state_family
from oracle import SMALL, generate, prompt_ids

from jllm import LLM, SamplingParams
from jllm.kv_cache_interface import FullAttentionSpec, MambaSpec
from jllm.models.state import build_state_metadata
from jllm.spec_decode import check_state_speculation

# A short prompt beside longer ones: under a budget of 16 tokens its decodes run in the steps
# that hold the others' prefill chunks.
PROMPTS = [prompt_ids(1, 5, seed=7, vocab=512)[0], *prompt_ids(3, 36, vocab=512)]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory, tokenizer_dir) -> str:
    state_family.register()
    root = tmp_path_factory.mktemp("state")
    return state_family.save_state_model(root, tokenizer_dir)


def _log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def assert_oracle(path, prompts, outs):
    for prompt, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        tokens = list(prompt) + list(gen.token_ids)
        logprobs = _log_softmax(state_family.reference_logits(path, tokens[:-1]))
        steps = logprobs[len(prompt) - 1 :]  # the positions that chose each generated token
        assert list(gen.token_ids) == steps.argmax(-1).tolist()
        got = [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
        want = [steps[i, t] for i, t in enumerate(gen.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)


def _state_pool(llm):
    kv = llm.llm_engine.scheduler.kv_cache
    (g,) = [g for g, spec in enumerate(kv.specs) if isinstance(spec, MambaSpec)]
    return kv, kv.pools[kv.pool_of[g]]


@pytest.mark.parametrize(
    "settings",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16, "enable_prefix_caching": False},  # chunked prefill
        {"num_gpu_blocks_override": 8, "enable_prefix_caching": False},  # preemption
        # One step ahead: a step's rows read the state the step still in flight writes.
        {"max_num_batched_tokens": 16, "enable_prefix_caching": False, "async_scheduling": True},
        # Rows packed back to back (the ragged kernels' layout) instead of on tiles.
        {
            "max_num_batched_tokens": 16,
            "enable_prefix_caching": False,
            "attention_backend": "cpu_kernel",
        },
    ],
    ids=["alone", "chunked", "preempting", "chunked-async", "chunked-packed"],
)
def test_linear_attention_state_matches_the_oracle(state_dir, settings):
    llm = LLM(state_dir, **{**SMALL, "dtype": "float32", **settings})
    assert_oracle(state_dir, PROMPTS, generate(llm, PROMPTS))
    if "num_gpu_blocks_override" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prefix_caching_takes_no_hits_and_slots_come_back(state_dir, monkeypatch):
    """With prefix caching on and mamba_cache_mode="none", a model with per-request state
    takes no hits (no state snapshots), even for prompts that share blocks, and still
    matches the oracle; every finished request gives its slot back to the state pool
    (snapshots: tests/models/test_qwen3_next.py)."""
    settings = {"enable_prefix_caching": True, "mamba_cache_mode": "none"}
    llm = LLM(state_dir, **{**SMALL, "dtype": "float32", **settings})
    kv, pool = _state_pool(llm)
    every_slot = pool.num_blocks - 1
    assert pool.num_free == every_slot
    freed = []
    free = kv.free

    def counting_free(req):
        before = pool.num_free
        free(req)
        freed.append(pool.num_free - before)

    monkeypatch.setattr(kv, "free", counting_free)
    outs = generate(llm, PROMPTS)
    assert_oracle(state_dir, PROMPTS, outs)
    others = prompt_ids(4, 45, seed=3, vocab=512)
    again = [p[:34] + q[34:] for p, q in zip(PROMPTS, others, strict=True)]
    outs = generate(llm, again)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert kv.prefix_hits == 0
    assert_oracle(state_dir, again, outs)
    assert freed == [1] * (2 * len(PROMPTS))  # one slot back per finished request
    assert pool.num_free == every_slot


def test_the_linear_layers_matter(state_dir):
    """The oracle's answer changes with full attention in place of the linear layers, so
    the engine agreeing with it is not an accident of a model that skips them."""
    tokens = PROMPTS[2]
    want = state_family.reference_logits(state_dir, tokens)
    full = [state_family.FULL] * len(state_family.LAYER_TYPES)
    assert np.abs(want - state_family.reference_logits(state_dir, tokens, full)).max() > 1e-2


def test_state_metadata_of_a_step():
    """Each row's slot is its block table's entry 0, it starts fresh when its first token is
    at position 0, and padding rows and tokens point nowhere."""
    table = np.array([[5, 0], [3, 0], [9, 0]], np.int32)  # input-batch rows 0..2
    # Rows: a decode of input-batch row 2 at position 7, a prefill of row 0 from position 0
    # (3 tokens), a chunk of row 1 from position 4 (2 tokens), then a padding row.
    query_start = np.array([0, 1, 6, 0], np.int32)
    query_lens = np.array([1, 3, 2, 0], np.int32)
    req_row = np.array([2, 0, 1, -1], np.int32)
    positions = np.array([7, 0, 1, 2, 0, 0, 4, 5], np.int32)  # tokens 4, 5: padding
    md = build_state_metadata(query_start, query_lens, table, positions, req_row)
    assert md.slots.tolist() == [9, 5, 3, -1]
    assert md.fresh.tolist() == [False, True, False, False]
    assert md.token_row.tolist() == [0, 1, 1, 1, -1, -1, 2, 2]
    assert md.query_lens.tolist() == [1, 3, 2, 0]


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_draft_models_are_refused_with_state(method):
    """A draft model or MTP beside a per-request state group (the model's or a draft's) is
    refused by name; n-gram drafts run, the state put back after rejections (end to end:
    tests/models/test_qwen3_next.py)."""
    state = state_family.LinearAttention.spec(
        SimpleNamespace(num_heads=4, head_dim=16, hidden_size=64)
    )
    full = FullAttentionSpec(num_kv_heads=1, head_size=16)
    config = SimpleNamespace(method=method)
    for specs in [(state, full), (full, state)]:
        with pytest.raises(ValueError, match=f"Speculative decoding \\({method}\\).*per-request"):
            check_state_speculation(config, specs)
    check_state_speculation(config, (full,))
    check_state_speculation(None, (state,))
    check_state_speculation(SimpleNamespace(method="ngram"), (state, full))


def test_sleep_forgets_state_snapshots_the_last_step_took(state_dir):
    """The last step's snapshot is copied before the next step's forward, so after a run
    its slot is still held: a prefix-cache reset (sleep's) must drop it with its key, not be
    refused and leave keys that point at released memory after wake_up."""
    llm = LLM(state_dir, **{**SMALL, "dtype": "float32"}, enable_sleep_mode=True)
    prompt = prompt_ids(1, 100, seed=3, vocab=512)
    params = SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True, logprobs=1)
    first = generate(llm, prompt, params)  # its last decode snapshots at 128 tokens
    assert_oracle(state_dir, prompt, first)
    assert llm.reset_prefix_cache()
    again = generate(llm, prompt, params)
    llm.sleep(level=1)
    kv, pool = _state_pool(llm)
    assert not pool.cached and kv.all_blocks_free
    assert llm.wake_up() is not False
    woken = generate(llm, prompt, params)
    assert again[0].num_cached_tokens == woken[0].num_cached_tokens == 0
    assert_oracle(state_dir, prompt, woken)


def test_a_host_state_load_reads_its_snapshot_not_a_store_of_its_own_step(state_dir):
    """One host slot for state snapshots: the request loading the snapshot from there
    evicts a device snapshot when it takes its live slot, whose store reuses that host
    slot in the same step; the load must read the snapshot, not the store."""
    base = {**SMALL, "dtype": "float32", "max_num_seqs": 2}
    probe = LLM(state_dir, **base, kv_offloading_size=0.01)
    per_slot = 0.01 / probe.llm_engine.scheduler.kv_cache.state_host.num_blocks
    del probe
    llm = LLM(state_dir, **base, kv_offloading_size=per_slot * 1.5)
    kv = llm.llm_engine.scheduler.kv_cache
    assert kv.state_host.num_blocks == 1
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompt = prompt_ids(1, 90, seed=7, vocab=512)
    generate(llm, prompt, params)
    for seed in (8, 9, 10):  # its snapshot at 64 goes to the host
        generate(llm, prompt_ids(1, 70, seed=seed, vocab=512), params)
    prompts = [prompt_ids(1, 20, seed=30, vocab=512)[0], prompt[0]]
    outs = generate(llm, prompts, params)
    assert outs[1].num_cached_tokens == 64 and kv.state_host.loads == 1
    assert_oracle(state_dir, prompts, outs)

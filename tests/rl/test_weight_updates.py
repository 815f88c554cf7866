"""Weight updates (RL rollouts): the engine loaded with one tiny Llama takes a second one's
weights through `start_weight_update` / `update_weights` / `finish_weight_update` and then
matches transformers running the second model (float32: greedy tokens equal, logprobs
within 1e-4). Chunks as torch, numpy and jax arrays; the engine's own state back
(`get_weights`); TP=2 on a device subset; fp8 re-quantized; tied embeddings (the tiny
models tie them: the head follows the embedding); no stale prefix-cache hit; every bad
update refused with the old weights still served whole; no compile after an update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from oracle import (
    SMALL,
    TINY,
    assert_matches,
    generate,
    oracle_tokens,
    prompt_ids,
    same_outputs,
)

from jllm import LLM, SamplingParams
from jllm.runner.compile_guard import count_compiles

PROMPTS = prompt_ids(3, 20)


def _model(seed: int, **extra):
    config = transformers.LlamaConfig(**{"tie_word_embeddings": True, **TINY, **extra})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(model A, its folder, model B): the engine starts from A and is updated to B."""
    a, b = _model(0), _model(1)
    path = tmp_path_factory.mktemp("rl") / "a"
    a.save_pretrained(path)
    return a, str(path), b


@pytest.fixture(scope="module")
def llm(models):
    return LLM(models[1], **SMALL, dtype="float32", skip_tokenizer_init=True)


def push(llm, model, version=None, chunks=(torch, np, jnp)):
    """`model`'s state dict in len(chunks) chunks, each as the given framework's arrays."""
    items = list(model.state_dict().items())
    size = -(-len(items) // len(chunks))
    llm.start_weight_update()
    for i, kind in enumerate(chunks):
        part = items[i * size : (i + 1) * size]
        if kind is np:
            part = {k: v.numpy() for k, v in part}
        elif kind is jnp:
            part = [(k, jnp.asarray(v.numpy())) for k, v in part]
        llm.update_weights(part)
    llm.finish_weight_update(version)


def test_an_update_in_chunks_serves_the_new_model(llm, models):
    a, _, b = models
    assert llm.get_weight_version() == "default"
    assert_matches(a, PROMPTS, generate(llm, PROMPTS))
    push(llm, b, "step-1")
    assert llm.get_weight_version() == "step-1"
    with count_compiles() as events:  # same shapes and shardings: nothing recompiles
        outs = generate(llm, PROMPTS)
    assert not events
    assert_matches(b, PROMPTS, outs)
    spans = outs[0].outputs[0].weight_versions
    assert [(s.version, s.start, s.end) for s in spans] == [("step-1", 0, 8)]
    push(llm, a, "step-2", chunks=(jnp,))
    assert_matches(a, PROMPTS, generate(llm, PROMPTS))


def test_no_prefix_computed_with_old_weights_is_a_hit(llm, models):
    a, _, b = models
    push(llm, a)
    generate(llm, PROMPTS)  # cached under A's weights
    assert all(o.num_cached_tokens >= 16 for o in generate(llm, PROMPTS))
    push(llm, b)
    outs = generate(llm, PROMPTS)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert_matches(b, PROMPTS, outs)
    assert all(o.num_cached_tokens >= 16 for o in generate(llm, PROMPTS))  # B's own


def test_requests_running_across_an_update_report_both_versions(llm, models):
    """One request, one of n=2, and two of one prompt admitted in one step (the second hits
    the blocks the first computes) run across the update: each sequence's tokens before it
    are A's, every sequence reports both versions, and none of their blocks (mixed weights)
    is a hit afterwards."""
    a, _, b = models
    push(llm, a, "v-a")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    pair = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    running = [
        ("across", 0, params),
        ("pair", 1, pair),
        ("twin-1", 2, params),
        ("twin-2", 2, params),
    ]
    for rid, i, p in running:
        engine.add_request(rid, *engine.prepare({"prompt_token_ids": PROMPTS[i]}, p))
    done = {}
    for _ in range(4):
        done |= {o.request_id: o for o in engine.step() if o.finished}
    push(llm, b, "v-b")
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(done) == sorted(rid for rid, _, _ in running)
    assert done["twin-2"].num_cached_tokens >= 16
    oracle_a = oracle_tokens(a, PROMPTS, 8)
    for rid, i, _ in running:
        for seq in done[rid].outputs:
            spans = [(s.version, s.start, s.end) for s in seq.weight_versions]
            assert [s[0] for s in spans] == ["v-a", "v-b"] and spans[-1][2] == 8
            assert spans[0][2] == spans[1][1]
            before = spans[0][2]
            assert list(seq.token_ids)[:before] == oracle_a[i][:before]
    # Their blocks mix both weights: a new request with their prompts is not a hit.
    again = generate(llm, PROMPTS)
    assert all(o.num_cached_tokens == 0 for o in again)
    assert_matches(b, PROMPTS, again)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"model.layers.0.self_attn.q_proj.weight": np.zeros((3, 64), np.float32)}, "shape"),
        ({"model.layers.9.mlp.up_proj.weight": np.zeros((128, 64), np.float32)}, "no such layer"),
        ({"model.nonsense.weight": np.zeros(4, np.float32)}, "not a weight of this model"),
        ({"model.norm.weight": np.zeros(64, np.int32)}, "not a floating-point"),
    ],
    ids=["shape", "layer", "name", "dtype"],
)
def test_a_bad_update_is_refused_and_the_old_weights_stay(llm, models, bad, match):
    a, _, b = models
    push(llm, a, "good")
    llm.start_weight_update()
    llm.update_weights({k: v.numpy() for k, v in list(b.state_dict().items())[:6]})
    with pytest.raises(ValueError, match=match):
        llm.update_weights(bad)
    with pytest.raises(RuntimeError, match="without a matching start_weight_update"):
        llm.finish_weight_update("bad")  # the failed chunk ended the session
    assert llm.get_weight_version() == "good"
    assert_matches(a, PROMPTS, generate(llm, PROMPTS))


def test_the_session_calls_in_order(llm):
    with pytest.raises(RuntimeError, match="start_weight_update must be called"):
        llm.update_weights({})
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="already active"):
        llm.start_weight_update()
    llm.finish_weight_update()  # an empty update changes nothing
    llm.update_weight_version("relabelled")
    assert llm.get_weight_version() == "relabelled"


def test_the_engines_own_state_goes_back_without_a_copy(llm, models, tmp_path):
    a, _, b = models
    b.save_pretrained(tmp_path / "b")
    other = LLM(str(tmp_path / "b"), **SMALL, dtype="float32", skip_tokenizer_init=True)
    state = other.get_weights()
    push(llm, a)
    llm.start_weight_update()
    llm.update_weights(state)
    llm.finish_weight_update()
    assert_matches(b, PROMPTS, generate(llm, PROMPTS))
    given = jax.tree.leaves(state)
    assert all(x is y for x, y in zip(jax.tree.leaves(llm.get_weights()), given, strict=True))
    wrong = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
    llm.start_weight_update()
    with pytest.raises(ValueError, match="bfloat16"):
        llm.update_weights(wrong)


def test_tensor_parallel_and_fp8_engines_take_updates(models):
    """TP=2 splits every updated tensor across both devices; an fp8 engine re-quantizes
    each update, giving what a fresh fp8 load of the new weights gives."""
    a, path, b = models
    # On devices 2 and 3 (a trainer in the process keeps the others); the jax chunk sits
    # on device 0 and moves device to device.
    tp = LLM(
        path,
        **SMALL,
        dtype="float32",
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        devices=[2, 3],
    )
    push(tp, b)
    assert_matches(b, PROMPTS, generate(tp, PROMPTS))
    kernel = tp.get_weights()["layers"]["self_attn"]["q_proj"]["weight"]
    assert {d.id for d in kernel.sharding.device_set} == {2, 3}
    del tp
    fp8 = LLM(path, **SMALL, dtype="float32", skip_tokenizer_init=True, quantization="fp8")
    push(fp8, b, chunks=(np, jnp))
    got = generate(fp8, PROMPTS)
    b_dir = f"{path}-b"
    b.save_pretrained(b_dir)
    fresh = LLM(b_dir, **SMALL, dtype="float32", skip_tokenizer_init=True, quantization="fp8")
    want = generate(fresh, PROMPTS)
    same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in want], 1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_partial_updates_in_random_chunks(llm, models, seed):
    """A random subset of B's tensors (some layers' rows only), in random chunks of random
    kinds, over A: the engine equals A with exactly those tensors replaced."""
    a, _, b = models
    push(llm, a)
    rng = np.random.default_rng(seed)
    names = [k for k in b.state_dict() if rng.random() < 0.5 and k != "lm_head.weight"]
    mixed = _model(0)
    state = {**a.state_dict(), **{k: b.state_dict()[k] for k in names}}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: the head follows
    mixed.load_state_dict(state)
    kinds = [torch, np, jnp]
    llm.start_weight_update()
    order = rng.permutation(len(names))
    for chunk in np.array_split(order, max(1, len(names) // 4)):
        kind = kinds[rng.integers(3)]
        part = [(names[i], b.state_dict()[names[i]]) for i in chunk]
        if kind is np:
            part = [(k, v.numpy()) for k, v in part]
        elif kind is jnp:
            part = [(k, jnp.asarray(v.numpy())) for k, v in part]
        llm.update_weights(part)
    llm.finish_weight_update()
    assert_matches(mixed, PROMPTS, generate(llm, PROMPTS))

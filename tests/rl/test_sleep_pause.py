"""Sleep, wake and pause (RL rollouts): sleep levels 1 and 2 return the weights' and the KV
cache's device memory (counted with `jax.live_arrays()`) and waking gives the same outputs
with nothing compiled; level 2 takes its weights from the next update; pause "abort",
"wait" and "keep" under concurrent streams on AsyncLLM, with new requests queued until
resume as vLLM's."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
import torch
import transformers
from oracle import (
    SMALL,
    TINY,
    assert_matches,
    eager,
    generate,
    oracle_tokens,
    prompt_ids,
    same_outputs,
)

from jllm import LLM, SamplingParams
from jllm.config import EngineArgs
from jllm.engine.async_llm import AsyncLLM
from jllm.runner.compile_guard import count_compiles

PROMPTS = prompt_ids(3, 20)


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **SMALL, dtype="float32", enable_sleep_mode=True)


def _same(got, want):
    # 1e-5: a prefix hit before, none after, so other chunks.
    same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in want], 1e-5)


def test_sleep_level_1_frees_the_device_and_wakes_to_the_same_outputs(llm):
    before = generate(llm, PROMPTS)
    runner = llm.llm_engine.runner
    weights = sum(a.nbytes for a in jax.tree.leaves(llm.get_weights()))
    cache = sum(a.nbytes for a in jax.tree.leaves(runner.kv_cache))
    held = live_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert held - live_bytes() >= weights + cache
    with pytest.raises(RuntimeError, match="asleep"):
        generate(llm, PROMPTS)
    assert llm.wake_up(["weights"]) is False  # the KV cache still sleeps
    assert llm.wake_up() is True and not llm.is_sleeping()
    # Asleep again, and only the KV cache woken: a second sleep releases it again.
    llm.sleep(level=1)
    asleep = live_bytes()
    assert llm.wake_up(["kv_cache"]) is False
    llm.sleep(level=1)
    assert live_bytes() == asleep
    assert llm.wake_up() is True and not llm.is_sleeping()
    with count_compiles() as events:
        after = generate(llm, PROMPTS)
    assert not events
    _same(after, before)
    assert all(o.num_cached_tokens == 0 for o in after)  # the cache's content went


def test_sleep_level_2_takes_its_weights_from_the_next_update(llm, llama_dir):
    before = generate(llm, PROMPTS)
    llm.sleep(level=2)
    model = eager(llama_dir)
    llm.start_weight_update()
    llm.update_weights((k, v.numpy()) for k, v in model.state_dict().items())
    llm.finish_weight_update("after-sleep")
    assert llm.is_sleeping() and llm.wake_up(["kv_cache"]) is True
    after = generate(llm, PROMPTS)
    _same(after, before)
    assert_matches(model, PROMPTS, after)
    assert after[0].outputs[0].weight_versions[0].version == "after-sleep"


def test_level_0_and_releasing_the_kv_cache(llm):
    before = generate(llm, PROMPTS)
    llm.sleep(level=0)
    assert llm.is_sleeping()
    cache = sum(a.nbytes for a in jax.tree.leaves(llm.llm_engine.runner.kv_cache))
    held = live_bytes()
    llm.release_kv_cache_memory()
    assert held - live_bytes() >= cache
    assert llm.wake_up(["kv_cache", "scheduling"]) is True
    _same(generate(llm, PROMPTS), before)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["everything"])
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)


def test_adopted_arrays_stay_the_trainers(llm, llama_dir):
    """A native update adopts the trainer's arrays without a copy but does not own them: a
    row write by name and a sleep leave them alive. The engine's own arrays
    (`get_weights()`) go with a sleep, and pushing them back then is refused naming the
    parameter, with the old weights served on."""
    before = generate(llm, PROMPTS)
    trainer = jax.tree.map(lambda a: a + 0.0, llm.get_weights())
    llm.start_weight_update()
    llm.update_weights(trainer)
    llm.finish_weight_update()
    q = trainer["layers"]["self_attn"]["q_proj"]["weight"]
    assert llm.get_weights()["layers"]["self_attn"]["q_proj"]["weight"] is q
    name = "model.layers.0.self_attn.q_proj.weight"
    llm.start_weight_update()
    llm.update_weights({name: eager(llama_dir).state_dict()[name].numpy()})
    llm.finish_weight_update()
    llm.sleep(level=1)
    assert not any(a.is_deleted() for a in jax.tree.leaves(trainer))
    assert llm.wake_up()
    _same(generate(llm, PROMPTS), before)
    own = llm.get_weights()
    llm.sleep(level=1)
    llm.wake_up()
    llm.start_weight_update()
    with pytest.raises(ValueError, match="embed_tokens is a deleted array"):
        llm.update_weights(own)
    _same(generate(llm, PROMPTS), before)


def test_a_draft_model_sleeps_with_the_target(llama_dir):
    """Both levels free the speculative draft's weights too and wake them unchanged; at
    level 2 the draft keeps a host copy (updates reach the target alone)."""
    spec = {"model": llama_dir, "num_speculative_tokens": 2}
    llm = LLM(llama_dir, **SMALL, dtype="float32", enable_sleep_mode=True, speculative_config=spec)
    draft = llm.llm_engine.runner.draft
    want = [np.asarray(a) for a in jax.tree.leaves(draft.state)]
    before = generate(llm, PROMPTS)
    for level in (1, 2):
        held = live_bytes()
        leaves = jax.tree.leaves(draft.state)
        llm.sleep(level=level)
        assert all(a.is_deleted() for a in leaves)
        assert held - live_bytes() >= sum(w.nbytes for w in want)
        if level == 2:
            model = eager(llama_dir)
            llm.start_weight_update()
            llm.update_weights((k, v.numpy()) for k, v in model.state_dict().items())
            llm.finish_weight_update()
        assert llm.wake_up()
        for got, w in zip(jax.tree.leaves(draft.state), want, strict=True):
            np.testing.assert_array_equal(np.asarray(got), w)
        _same(generate(llm, PROMPTS), before)


def test_sleep_mode_must_be_enabled_for_levels_1_and_2(llama_dir):
    plain = LLM(llama_dir, **SMALL, dtype="float32")
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep(level=1)
    assert plain.wake_up() is True
    generate(plain, PROMPTS[:1])


# ---- pause on AsyncLLM -------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_llm(llama_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=llama_dir, **SMALL, dtype="float32"))
    yield engine
    engine.shutdown()


PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


async def _stream(engine, rid, prompt, started: asyncio.Event | None = None):
    last = None
    async for out in engine.generate({"prompt_token_ids": prompt}, PARAMS, rid):
        last = out
        if started is not None:
            started.set()
    return last


async def _started(engine, tag):
    events = [asyncio.Event() for _ in PROMPTS]
    tasks = [
        asyncio.create_task(_stream(engine, f"{tag}-{i}", p, e))
        for i, (p, e) in enumerate(zip(PROMPTS, events, strict=True))
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    return tasks


async def _held(engine, rid):
    """A request sent while generation is paused: it does not start (vLLM queues it)."""
    task = asyncio.create_task(_stream(engine, rid, PROMPTS[0]))
    await asyncio.sleep(0.3)
    assert not task.done() and not engine.engine.scheduler.requests
    return task


def test_pause_abort_ends_every_stream_and_queues_new_ones(async_llm):
    async def run():
        tasks = await _started(async_llm, "abort")
        await async_llm.pause_generation(mode="abort")
        outs = await asyncio.gather(*tasks)
        assert {o.outputs[0].finish_reason for o in outs} == {"abort"}
        assert await async_llm.is_paused()
        held = await _held(async_llm, "held")
        gone = await _held(async_llm, "gone")
        gone.cancel()  # a client that leaves while held: its request never starts
        await asyncio.gather(gone, return_exceptions=True)
        await async_llm.resume_generation()
        assert not await async_llm.is_paused()
        assert (await held).outputs[0].finish_reason == "length"
        out = await _stream(async_llm, "after", PROMPTS[0])
        assert out.outputs[0].finish_reason == "length"
        assert not async_llm.engine.scheduler.requests

    asyncio.run(run())


def test_pause_wait_drains_then_queues(async_llm):
    async def run():
        tasks = await _started(async_llm, "wait")
        await async_llm.pause_generation(mode="wait")
        assert all(t.done() for t in tasks)
        assert {t.result().outputs[0].finish_reason for t in tasks} == {"length"}
        held = await _held(async_llm, "held-wait")
        await async_llm.resume_generation()
        assert (await held).outputs[0].finish_reason == "length"

    asyncio.run(run())


def test_pause_keep_freezes_streams_and_they_go_on_with_the_same_outputs(async_llm):
    async def run():
        want = await asyncio.gather(
            *(_stream(async_llm, f"ref-{i}", p) for i, p in enumerate(PROMPTS))
        )
        tasks = await _started(async_llm, "keep")
        await async_llm.pause_generation(mode="keep")
        engine = async_llm.engine
        frozen = [len(r.output_token_ids) for r in engine.scheduler.requests.values()]
        queued = asyncio.create_task(_stream(async_llm, "queued", PROMPTS[1]))
        await asyncio.sleep(0.3)
        assert [len(r.output_token_ids) for r in engine.scheduler.requests.values()][:3] == frozen
        assert not any(t.done() for t in (*tasks, queued))
        await async_llm.resume_generation()
        got = await asyncio.gather(*tasks, queued)
        for g, w in zip(got, [*want, want[1]], strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids

    asyncio.run(run())


def _push(engine, model, version):
    async def run():
        await engine.start_weight_update()
        await engine.update_weights([(k, v.numpy()) for k, v in model.state_dict().items()])
        await engine.finish_weight_update(version)

    return run()


def test_pause_keep_with_clear_cache_recomputes_the_kept_requests(async_llm, llama_dir):
    """vLLM's pause(keep, clear_cache=True) preempts the frozen requests and forgets the
    cached prefixes: a request kept across an update goes on as the new model computes it
    over its prompt and the tokens it had (transformers' oracle), and the prefix of a
    finished request is no hit after the pause. clear_cache=False keeps both."""
    a, b = eager(llama_dir), _model_b()
    prompt = PROMPTS[0]

    async def run():
        await _stream(async_llm, "warm", prompt)
        await async_llm.pause_generation(mode="keep", clear_cache=False)
        await async_llm.resume_generation()
        assert (await _stream(async_llm, "hit", prompt)).num_cached_tokens > 0
        started = asyncio.Event()
        kept = asyncio.create_task(_stream(async_llm, "kept", prompt, started))
        await started.wait()
        await async_llm.pause_generation(mode="keep", clear_cache=True)
        assert not async_llm.engine.scheduler.running  # preempted, not frozen with blocks
        await _push(async_llm, b, "b")
        await async_llm.resume_generation()
        out = (await kept).outputs[0]
        assert (await _stream(async_llm, "cold", PROMPTS[2])).num_cached_tokens == 0
        await _push(async_llm, a, "default")  # the fixture's model again
        return out

    out = asyncio.run(run())
    tokens = list(out.token_ids)
    k = out.weight_versions[0].end
    assert [s.version for s in out.weight_versions] == ["default", "b"] and 0 < k < len(tokens)
    assert tokens[k:] == oracle_tokens(b, [prompt + tokens[:k]], len(tokens) - k)[0]


def test_resume_while_asleep_is_refused_and_wake_up_resumes(async_llm):
    """resume_generation while the KV cache is released would step on freed memory: it is
    refused, the engine lives on and wake_up resumes it with the same outputs."""

    async def run():
        want = await _stream(async_llm, "before", PROMPTS[0])
        await async_llm.pause_generation(mode="abort")
        await async_llm.release_kv_cache_memory()
        with pytest.raises(RuntimeError, match="asleep"):
            await async_llm.resume_generation()
        assert await async_llm.is_sleeping()
        assert await async_llm.wake_up() is True
        assert not await async_llm.is_paused()
        got = await _stream(async_llm, "after", PROMPTS[0])
        assert got.outputs[0].token_ids == want.outputs[0].token_ids

    asyncio.run(run())


def test_reset_prefix_cache_with_running_requests(llm):
    """reset_prefix_cache refuses while requests run, unless reset_running_requests
    preempts them first (vLLM's scheduler): they finish with the outputs they would have had
    and nothing cached stays."""
    want = generate(llm, PROMPTS[:2])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", *engine.prepare({"prompt_token_ids": p}, params))
    done = {o.request_id: o for _ in range(3) for o in engine.step() if o.finished}
    assert llm.reset_prefix_cache() is False
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    _same([done["r0"], done["r1"]], want)
    assert all(o.num_cached_tokens == 0 for o in generate(llm, [PROMPTS[2]]))


def _model_b():
    config = transformers.LlamaConfig(**{"tie_word_embeddings": True, **TINY})
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_torch_tensor_in_bfloat16_is_taken(llama_dir):
    """torch's bfloat16 has no numpy dtype: its bits are read as ml_dtypes' bfloat16."""
    from jllm.model_loader.loader import as_array

    t = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    np.testing.assert_array_equal(np.asarray(as_array(t), np.float32), [1.5, -2.25])

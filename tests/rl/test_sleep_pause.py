"""Sleep, wake and pause (RL rollouts): sleep levels 1 and 2 return the weights' and the KV
cache's device memory (counted with `jax.live_arrays()`) and waking gives the same outputs
with nothing compiled; level 2 takes its weights from the next update; pause "abort",
"wait" and "keep" under concurrent streams on AsyncLLM, with new requests refused or
queued as vLLM's."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
import torch
from oracle import SMALL, assert_matches, eager, generate, prompt_ids, same_outputs

from jllm import LLM, SamplingParams
from jllm.config import EngineArgs
from jllm.engine.async_llm import AsyncLLM, EnginePausedError
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


def test_pause_abort_ends_every_stream_and_refuses_new_ones(async_llm):
    async def run():
        tasks = await _started(async_llm, "abort")
        await async_llm.pause_generation(mode="abort")
        outs = await asyncio.gather(*tasks)
        assert {o.outputs[0].finish_reason for o in outs} == {"abort"}
        assert await async_llm.is_paused()
        with pytest.raises(EnginePausedError):
            await _stream(async_llm, "refused", PROMPTS[0])
        await async_llm.resume_generation()
        assert not await async_llm.is_paused()
        out = await _stream(async_llm, "after", PROMPTS[0])
        assert out.outputs[0].finish_reason == "length"

    asyncio.run(run())


def test_pause_wait_drains_then_refuses(async_llm):
    async def run():
        tasks = await _started(async_llm, "wait")
        await async_llm.pause_generation(mode="wait")
        assert all(t.done() for t in tasks)
        assert {t.result().outputs[0].finish_reason for t in tasks} == {"length"}
        with pytest.raises(EnginePausedError):
            await _stream(async_llm, "refused-wait", PROMPTS[0])
        await async_llm.resume_generation()

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


def test_a_torch_tensor_in_bfloat16_is_taken(llama_dir):
    """torch's bfloat16 has no numpy dtype: its bits are read as ml_dtypes' bfloat16."""
    from jllm.model_loader.loader import as_array

    t = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    np.testing.assert_array_equal(np.asarray(as_array(t), np.float32), [1.5, -2.25])

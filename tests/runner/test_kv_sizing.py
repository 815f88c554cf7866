"""KV-cache sizing: on a device with memory stats the cache gets `gpu_memory_utilization` of
the memory less what is in use and what the largest step needs, as XLA's memory analysis of
the largest bucket reports it (the profiling run); explicit sizes never profile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jllm.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    sliding_pool_cap,
    windowed_pool_cap,
)
from jllm.runner.kv_cache import abstract_kv_cache, kv_cache_budget, size_kv_cache, split_blocks

GiB = 1 << 30


def test_sizing_from_memory_stats_subtracts_the_profiled_step():
    asked = []

    def step_bytes():
        asked.append(True)
        return 3 * GiB

    stats = {"bytes_limit": 80 * GiB, "bytes_in_use": 16 * GiB}
    budget = kv_cache_budget(None, 0.9, step_bytes, stats)
    assert asked and budget == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB
    # An explicit size never profiles (nor does a block count: `size_kv_cache` below).
    asked.clear()
    assert kv_cache_budget(GiB, 0.9, step_bytes, stats) == GiB
    assert not asked
    with pytest.raises(ValueError, match="No device memory is left"):
        kv_cache_budget(None, 0.2, step_bytes, stats)


def test_utilization_is_a_share_of_the_whole_device(caplog):
    """JAX's allocator limit is `fraction` of the device: 0.9 of an 80 GiB device is 72 GiB,
    and a utilization above the allocator's share is capped at its limit, with a warning."""
    stats = {"bytes_limit": 76 * GiB, "bytes_in_use": 16 * GiB}  # 0.95 of 80 GiB
    budget = kv_cache_budget(None, 0.9, lambda: 3 * GiB, stats, fraction=0.95)
    assert budget == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB
    with caplog.at_level("WARNING"):
        budget = kv_cache_budget(None, 0.9, lambda: 3 * GiB, stats, fraction=0.75)
    assert budget == 76 * GiB - 16 * GiB - 3 * GiB
    assert "XLA_CLIENT_MEM_FRACTION" in caplog.text


def test_profile_of_the_largest_bucket(llama_llm):
    """The profile compiles the largest bucket against a 4-block stand-in cache (nothing is
    allocated) and counts at least the logits of the largest sampler bucket."""
    engine = llama_llm.llm_engine
    runner, cfg = engine.runner, engine.model_config
    spec = FullAttentionSpec(
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim
    )
    cache = abstract_kv_cache(spec, 4, runner.layout.block_size, engine.dtype, runner.mesh)
    assert isinstance(cache, jax.ShapeDtypeStruct) and cache.shape[:2] == (cfg.num_layers, 4)
    largest_rs = runner.layout.sample_buckets[-1]
    assert runner.profile_step_bytes((cache,)) >= largest_rs * cfg.vocab_size * 4


def test_groups_split_the_memory_by_what_they_can_use():
    """A sliding group gets at most what max_num_seqs requests can hold in its window; the
    rest of the memory goes to full attention. Groups that can use more than an equal share
    are not capped below it."""
    cap = sliding_pool_cap(window=24, block_size=16, max_num_seqs=4, max_step_tokens=64)
    assert cap == -(-(4 * 23 + 64) // 16) + 2 * 4 + 1 == 19
    sizes = [5 * 1024, 1024]  # 5 sliding layers, 1 full (Gemma 3's pattern)
    counts = split_blocks(1000 * 1024, sizes, [cap, None])
    assert counts == [19, (1000 - 19 * 5)]
    # Little memory: an equal count is below the cap, so both share it.
    assert split_blocks(60 * 1024, sizes, [cap, None]) == [10, 10]
    assert split_blocks(60 * 1024, sizes, [None, None]) == [10, 10]


SIZING = dict(
    block_size=16,
    tp=1,
    dtype="float32",
    mesh=jax.sharding.Mesh(jax.devices()[:1], ("model",)),
    platform="cpu",
    max_num_seqs=4,
    max_step_tokens=64,
    override=None,
    utilization=0.9,
)


def _size(specs, **kw):
    return size_kv_cache([specs], **{**SIZING, **kw})


def test_one_request_must_fit_counting_a_window_by_its_span():
    """A 4096-token request needs 256 blocks of full attention but only its window's in a
    sliding group: a cache too small for the first passes for the second."""
    heads = dict(num_layers=2, num_kv_heads=2, head_size=16)
    full, sliding = FullAttentionSpec(**heads), SlidingWindowSpec(**heads, sliding_window=32)
    per_block = 2 * 16 * 2 * 2 * 16 * 4  # layers x slots x K/V x heads x head dim x float32
    memory = 100 * per_block
    with pytest.raises(
        ValueError, match="4096 tokens needs 256 blocks of 2 layers where it holds 99"
    ):
        _size((full,), max_model_len=4096, memory_bytes=memory)
    _, config = _size((sliding,), max_model_len=4096, memory_bytes=memory)
    assert config.num_blocks == (100,)
    # An explicit block count is taken as it is (preemption tests run on tiny pools), and
    # never profiles (`_size` passes no profile: asking would fail).
    _, config = _size((full,), max_model_len=4096, memory_bytes=None, override=12)
    assert config.num_blocks == (12,)


def test_a_shared_pool_is_sized_as_one():
    """Gemma 2's groups (equal arrays) share one pool: its blocks weigh one group's, it is
    not capped for the window, and one request must fit in both groups at once."""
    heads = dict(num_layers=2, num_kv_heads=2, head_size=16)
    sliding, full = SlidingWindowSpec(**heads, sliding_window=32), FullAttentionSpec(**heads)
    per_block = 2 * 16 * 2 * 2 * 16 * 4
    caches, config = _size((sliding, full), max_model_len=4096, memory_bytes=300 * per_block)
    assert config.pools == (0, 0) and config.num_blocks == (300,)
    ((cache,),) = caches
    assert cache.shape == (2, 300, 16, 4, 16)
    # 256 blocks of full attention and cdiv(32 - 1 + 64 - 1, 16) + 1 = 7 in the window.
    with pytest.raises(ValueError, match="needs 263 blocks of 2 layers where it holds 261"):
        _size((sliding, full), max_model_len=4096, memory_bytes=262 * per_block)


def test_caps_apply_to_pools_of_bounded_groups_only():
    """A pool of windowed or per-request groups is capped at what max_num_seqs requests
    hold (per-request state: a slot each), the rest of the memory goes to full attention and
    MLA; a draft model's groups never share the target's pools."""
    one = dict(num_kv_heads=2, head_size=16)
    specs = (
        FullAttentionSpec(num_layers=1, **one),
        ChunkedLocalAttentionSpec(num_layers=3, attention_chunk_size=64, **one),
        MambaSpec(num_layers=3, shapes=((4, 32),), dtypes=("float32",)),
    )
    draft = (FullAttentionSpec(num_layers=1, **one),)
    caches, config = size_kv_cache(
        [specs, draft],
        **{**SIZING, "max_model_len": 1024, "memory_bytes": 1 << 24},
    )
    assert config.pools == (0, 1, 2, 3)
    full, local, state, draft_blocks = config.num_blocks
    assert local == windowed_pool_cap(63, 16, 4, 64) and state == 4 + 1
    assert full == draft_blocks > local
    (full_cache, local_cache, state_cache), (draft_cache,) = caches
    assert state_cache.shape == (3, 5, 4, 32) and state_cache.dtype == jnp.float32
    assert local_cache.shape == (3, local, 16, 4, 16)
    mla = MLAAttentionSpec(num_layers=2, kv_lora_rank=32, qk_rope_head_dim=8)
    ((cache,),), config = size_kv_cache(
        [(mla,)], **{**SIZING, "max_model_len": 1024, "memory_bytes": 100 * 2 * 16 * 40 * 4}
    )
    assert config.num_blocks == (100,) and cache.shape == (2, 100, 16, 40)

"""KV-cache specs: each kind's bytes, arrays, live blocks, skipped tokens and caps against
brute force; pools shared only by identical arrays; and the imports that let engine/,
runner/ and models/ all read the module."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from kv_specs import MLA, STATE, attention, chunked

from jllm.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    share_pools,
    sliding_pool_cap,
)
from jllm.utils import cdiv

JLLM = pathlib.Path(__file__).resolve().parent.parent / "jllm"


def test_bytes_and_arrays_of_each_kind():
    full = FullAttentionSpec(num_layers=3, num_kv_heads=4, head_size=8)
    ((shape, dtype),) = full.cache_arrays(10, 16, "float16")
    assert shape == (3, 10, 16, 8, 8) and dtype == np.float16
    assert full.page_size_bytes(16, "float16") == 3 * 16 * 2 * 4 * 8 * 2
    # One device of tp=2, pp=3: a layer and two heads.
    assert full.shard(2, 3) == FullAttentionSpec(num_layers=1, num_kv_heads=2, head_size=8)
    # MLA: one latent per token, no heads, whole on every TP device.
    mla = type(MLA)(num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.cache_arrays(10, 16, "uint8") == (((2, 10, 16, 576), np.uint8),)
    assert mla.page_size_bytes(16, "bfloat16") == 2 * 16 * 576 * 2
    assert mla.shard(4, 2).page_size_bytes(16, "uint8") == 16 * 576
    # Per-request state: a slot per request, whatever the block size and cache dtype.
    state = MambaSpec(num_layers=2, shapes=((3, 8), (4, 8, 8)), dtypes=("float16", "float32"))
    assert state.cache_arrays(5, 16, "uint8") == (
        ((2, 5, 3, 8), np.float16),
        ((2, 5, 4, 8, 8), np.float32),
    )
    assert state.page_size_bytes(16, "uint8") == state.page_size_bytes(1, "float64")
    assert state.page_size_bytes(16, "uint8") == 2 * (3 * 8 * 2 + 4 * 8 * 8 * 4)
    assert state.num_blocks(10_000, 16) == state.max_blocks_per_request(10_000, 16, 64) == 1


def test_what_a_step_skips():
    """A step from p reads nothing before p - W + 1 (window) or floor(p / C) * C (chunk);
    full attention, MLA and per-request state skip nothing."""
    for p in range(100):
        assert attention(8).num_skipped_tokens(p) == max(0, p - 7)
        assert chunked(12).num_skipped_tokens(p) == p - p % 12
        for spec in (attention(), MLA, STATE):
            assert spec.num_skipped_tokens(p) == 0
    # A hit of n blocks needs what the step at n * S reads.
    assert attention(9).hit_start(5, 4) == (20 - 8) // 4 == 3
    assert chunked(8).hit_start(5, 4) == 4 and chunked(8).hit_start(4, 4) == 4


@pytest.mark.parametrize("size, max_step", [(4, 1), (4, 3), (16, 7), (4, 20), (8, 8)])
@pytest.mark.parametrize(
    "spec", [attention(1), attention(5), attention(20), chunked(4), chunked(6), chunked(16)]
)
def test_max_blocks_per_request_is_the_widest_span(spec, size, max_step):
    """Against every step position c and size n: the blocks from the first one the step
    reads to the last one it writes."""
    widest = max(
        cdiv(c + n, size) - spec.num_skipped_tokens(c) // size
        for c in range(300)
        for n in range(1, max_step + 1)
    )
    assert spec.max_blocks_per_request(10_000, size, max_step) == widest
    assert spec.max_blocks_per_request(10, size, max_step) <= cdiv(10, size)


def test_pool_caps():
    """A windowed group's cap is what max_num_seqs requests hold in their spans; per-request
    state takes one slot each; full attention and MLA grow with the context."""
    assert attention(24).pool_cap(16, 4, 64) == sliding_pool_cap(24, 16, 4, 64) == 19
    assert chunked(25).pool_cap(16, 4, 64) == 19  # a chunk of 25 keeps at most 24 before
    assert STATE.pool_cap(16, 4, 64) == 5
    assert attention().pool_cap(16, 4, 64) is None and MLA.pool_cap(16, 4, 64) is None


def test_identical_arrays_share_a_pool():
    """Gemma 2's full and sliding groups (same layers, heads, head size) share; other
    counts, heads or kinds do not, though their blocks may weigh the same."""
    heads = dict(num_kv_heads=2, head_size=16)
    full = FullAttentionSpec(num_layers=13, **heads)
    local = SlidingWindowSpec(num_layers=13, sliding_window=4096, **heads)
    assert share_pools([local, full]) == (0, 0)
    doubled = FullAttentionSpec(num_layers=26, num_kv_heads=1, head_size=16)
    assert doubled.page_size_bytes(16, "bfloat16") == full.page_size_bytes(16, "bfloat16")
    assert share_pools([local, doubled]) == (0, 1)
    assert share_pools([attention(), MLA, attention(8), STATE, chunked(4)]) == (0, 1, 0, 2, 0)


def test_specs_refuse_what_they_cannot_be():
    with pytest.raises(ValueError, match="at least 1 token"):
        attention(0)
    with pytest.raises(ValueError, match="at least one layer"):
        FullAttentionSpec(num_layers=0, num_kv_heads=1, head_size=1)
    with pytest.raises(ValueError, match="one dtype per state shape"):
        MambaSpec(shapes=((1,),), dtypes=())


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_imports_go_downward():
    """The specs import nothing of jllm but its utilities (and no JAX: the host-side import
    test, tests/engine/test_scheduler.py); the runner and the models import nothing of the
    engine, nor the models anything of the runner."""
    for name in _imports(JLLM / "kv_cache_interface.py"):
        assert not name.startswith(("jllm.", "jax")) or name == "jllm.utils", name
    for package, below in (
        ("runner", ("jllm.engine",)),
        ("models", ("jllm.engine", "jllm.runner")),
    ):
        for path in (JLLM / package).rglob("*.py"):
            for name in _imports(path):
                assert not name.startswith(below), f"{path.name} imports {name}"

"""The host KV tier's copies on the device (runner/host_kv.py), per pool: a full-attention
pool's blocks and a per-request state pool's snapshots (a tuple of arrays) are stored and
loaded by (pool, source, destination) triples; loads into state slots wait for the late
phase, after the step's state copies (one of which may still read the slot: the source of
a snapshot whose request was freed before its copy ran)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jllm.distributed.codec import MalformedMessage
from jllm.runner.executables import ExecutableTable
from jllm.runner.host_kv import HostKVCache
from sharding import make_mesh, replicated


def test_stores_then_loads_per_pool_and_state_loads_late():
    mesh = make_mesh(1)
    attention = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)  # [L, B, ...]
    state = (jnp.ones((2, 3, 2)), jnp.full((2, 3, 5), 2.0))  # a state pool: [L, slots, ...]
    block_1 = np.asarray(attention)[:, 1]  # the scatters donate the caches
    runner = SimpleNamespace(kv_cache=(attention, state), table=ExecutableTable(mesh))
    host = HostKVCache({0: 2, 1: 2}, runner.kv_cache, replicated(mesh))
    # step 1: store attention block 1 and state slot 2 in host memory
    host.apply(runner, ([(0, 1, 0), (1, 2, 1)], []))
    host.flush()
    np.testing.assert_array_equal(host.arrays[0][0][:, 0], block_1)
    np.testing.assert_array_equal(host.arrays[1][1][:, 1], 2.0)
    # step 2: load both back elsewhere: the state slot only in the late phase
    runner.kv_cache = (runner.kv_cache[0], (jnp.zeros((2, 3, 2)), jnp.zeros((2, 3, 5))))
    writes = ([], [(0, 0, 3), (1, 1, 0)])
    host.apply(runner, writes)
    np.testing.assert_array_equal(runner.kv_cache[0][:, 3], block_1)
    assert not np.asarray(runner.kv_cache[1][1]).any()  # not yet
    host.apply_late(runner, writes)
    np.testing.assert_array_equal(runner.kv_cache[1][1][:, 0], 2.0)
    assert isinstance(runner.kv_cache[1], tuple) and len(runner.kv_cache[1]) == 2


def test_the_wire_form_names_a_pool_the_tier_keeps():
    mesh = make_mesh(1)
    caches = (jnp.zeros((1, 4, 2)), (jnp.zeros((1, 3, 2)),))
    host = HostKVCache({0: 2}, caches, replicated(mesh))
    writes = ([(0, 1, 0)], [(0, 0, 2)])
    assert host.decode(host.encode(writes)) == writes
    with pytest.raises(MalformedMessage, match="pool 1"):
        host.decode([[[1, 0, 0]], []])
    with pytest.raises(MalformedMessage, match="host block 2"):
        host.decode([[], [[0, 2, 1]]])

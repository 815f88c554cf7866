"""The host-memory KV tier's arrays and copies (`engine/host_kv_tier.py` decides which
blocks): one host array per KV-cache group, [L, Bh, S, 2K, H] in the cache's dtype, and the
two copies a step may start with:

- stores: the device blocks evicted from the prefix cache, gathered on the device by a
  compiled executable before the step's forward can overwrite them, and brought to the host
  asynchronously (`copy_to_host_async`); they are written into the host array when the next
  step starts, before its loads read it, so a block stored in one step can be loaded in the
  next, and the scheduler loop never waits on a copy it has just started;
- loads: host blocks put on the device (with the cache's sharding) and scattered into fresh
  device blocks by a compiled executable that updates the donated cache in place, before the
  forward that reads them.

Both run in buckets of 1, 2, 4, ... blocks, compiled at start-up. `HostKVCache` is a runner
manager (`runner/manager.py`): a step's writes are its (stores, loads), block-id pairs on
the wire. On TPU and GPU the host
array would live in the `pinned_host` memory kind for DMA copies; on the CPU host memory is
the device's memory and numpy is the host array.

Glossary: L layers, Bh host blocks, S block size, K kv heads, H head dim, n blocks copied.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jllm.distributed.codec import MalformedMessage, expect_ints, expect_list
from jllm.runner.buckets import pow2_buckets
from jllm.runner.manager import RunnerManager

# The most blocks one copy executable moves; longer lists go in several calls.
MAX_COPY_BLOCKS = 64


@jax.jit
def gather_blocks(cache, ids):
    """cache [L, B, S, 2K, H], ids [n] -> [L, n, S, 2K, H] (a padding id reads block 0)."""
    return cache[:, ids]


@partial(jax.jit, donate_argnames=("cache",))
def scatter_blocks(cache, ids, blocks):
    """Write blocks [L, n, S, 2K, H] at ids [n] (an id past the cache, padding, writes
    nothing)."""
    return cache.at[:, ids].set(blocks.astype(cache.dtype), mode="drop")


class HostKVCache(RunnerManager):
    name = "host_kv"

    def __init__(self, num_blocks: int, device_caches: tuple, replicated) -> None:
        """`device_caches`: the model's KV-cache groups (their shapes and shardings)."""
        self.num_blocks = num_blocks
        self.replicated = replicated
        self.arrays = [
            np.zeros((c.shape[0], num_blocks, *c.shape[2:]), c.dtype) for c in device_caches
        ]
        self.buckets = pow2_buckets(MAX_COPY_BLOCKS)
        self._pending: list[tuple[list[int], list]] = []  # (host blocks, gathered arrays)

    @staticmethod
    def block_bytes(device_caches) -> int:
        """Host bytes of one block in every group."""
        return sum(
            int(np.prod((c.shape[0], *c.shape[2:]))) * jnp.dtype(c.dtype).itemsize
            for c in device_caches
        )

    def _executable(self, table, kind: str, fn, cache, n: int, *extra):
        def lower():
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.replicated)
            return fn.lower(cache, ids, *extra)

        return table.get(kind, (cache.shape, str(cache.dtype), n), lower)

    def _blocks_shape(self, cache, n: int):
        shape = (cache.shape[0], n, *cache.shape[2:])
        return jax.ShapeDtypeStruct(shape, cache.dtype, sharding=cache.sharding)

    def compile_all(self, runner) -> None:
        for cache in runner.kv_cache:
            for n in self.buckets:
                self._executable(runner.table, "host kv gather", gather_blocks, cache, n)
                blocks = self._blocks_shape(cache, n)
                self._executable(runner.table, "host kv scatter", scatter_blocks, cache, n, blocks)

    def empty(self):
        return ([], [])

    def apply(self, runner, writes) -> None:
        stores, loads = writes
        if stores or loads:
            runner.kv_cache = self.copy(runner.table, runner.kv_cache, stores, loads)

    def encode(self, writes) -> list:
        stores, loads = writes
        return [[[int(a), int(b)] for a, b in stores], [[int(a), int(b)] for a, b in loads]]

    def decode(self, wire):
        wire = expect_list(wire, "the host KV copies")
        if len(wire) != 2:
            raise MalformedMessage("step message: the host KV copies are not [stores, loads]")
        stores, loads = (
            [tuple(expect_ints(p, "a host KV copy", 2)) for p in expect_list(w, "copies")]
            for w in wire
        )
        return stores, loads

    def device_arrays(self, runner) -> list:
        self.flush()
        return list(self.arrays)  # host memory, written by every process alike

    def _chunks(self, pairs):
        largest = self.buckets[-1]
        for lo in range(0, len(pairs), largest):
            part = pairs[lo : lo + largest]
            yield part, next(b for b in self.buckets if b >= len(part))

    def flush(self) -> None:
        """Write the stores started by earlier steps into the host arrays."""
        for host_ids, gathered in self._pending:
            for array, blocks in zip(self.arrays, gathered, strict=True):
                array[:, host_ids] = np.asarray(blocks)[:, : len(host_ids)]
        self._pending = []

    def copy(self, table, caches: tuple, stores, loads) -> tuple:
        """Start this step's stores ((device block, host block) each) and make its loads
        ((host block, device block) each); returns the updated caches."""
        self.flush()
        caches = list(caches)
        for part, n in self._chunks(list(stores)):
            ids = np.zeros(n, np.int32)
            ids[: len(part)] = [d for d, _ in part]
            ids = jax.device_put(ids, self.replicated)
            gathered = []
            for cache in caches:
                blocks = self._executable(table, "host kv gather", gather_blocks, cache, n)(
                    cache, ids
                )
                blocks.copy_to_host_async()
                gathered.append(blocks)
            self._pending.append(([h for _, h in part], gathered))
        for part, n in self._chunks(list(loads)):
            host_ids = [h for h, _ in part]
            ids = np.full(n, -1, np.int32)
            ids[: len(part)] = [d for _, d in part]
            for g, cache in enumerate(caches):
                ids[len(part) :] = cache.shape[1]  # padding: past the cache, dropped
                data = np.zeros((cache.shape[0], n, *cache.shape[2:]), self.arrays[g].dtype)
                data[:, : len(part)] = self.arrays[g][:, host_ids]
                shape = self._blocks_shape(cache, n)
                put_ids = jax.device_put(ids, self.replicated)
                blocks = jax.device_put(data, shape.sharding)
                exe = self._executable(table, "host kv scatter", scatter_blocks, cache, n, shape)
                caches[g] = exe(cache, put_ids, blocks)
        return tuple(caches)


def available_host_bytes() -> int:
    """The host memory the kernel reports available (MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_blocks(size_gib: float | None, device_caches, nnodes: int = 1) -> int:
    """Host blocks `kv_offloading_size` GiB holds (0: off); ValueError when the host does
    not have that memory available, or the engine spans several hosts (not built yet)."""
    if not size_gib:
        return 0
    if nnodes > 1:
        raise ValueError(
            "The host KV tier (kv_offloading_size) runs on one host; with nnodes > 1 it is "
            "not supported yet."
        )
    size = int(size_gib * (1 << 30))
    available = available_host_bytes()
    if size > available:
        raise ValueError(
            f"kv_offloading_size={size_gib} GiB ({size / 2**30:.2f} GiB) is more than this "
            f"host's available memory ({available / 2**30:.2f} GiB)."
        )
    per_block = HostKVCache.block_bytes(device_caches)
    blocks = size // per_block
    if blocks < 1:
        raise ValueError(
            f"kv_offloading_size={size_gib} GiB holds no block ({per_block} bytes each)."
        )
    return int(blocks)

"""The host-memory KV tier's arrays and copies (`engine/host_kv_tier.py` decides which
blocks): per pool the tier keeps, a host copy of each of its arrays with its own block
count (a full-attention pool's [L, Bh, S, 2K, H]; a per-request state pool's snapshots,
[L, Bh, *state shape] per array), in the cache's dtype, and the two copies a step may start
with, (pool, source, destination) each:

- stores: the device blocks evicted from the prefix cache, gathered on the device by a
  compiled executable before the step's forward can overwrite them, and brought to the host
  asynchronously (`copy_to_host_async`); they are written into the host array when the next
  step starts, before its loads read it, so a block stored in one step can be loaded in the
  next, and the scheduler loop never waits on a copy it has just started;
- loads: host blocks put on the device (with the cache's sharding) and scattered into fresh
  device blocks by a compiled executable that updates the donated cache in place, before the
  forward that reads them; a state snapshot's load into a request's live slot runs after the
  step's state copies (`apply_late`), one of which may still read that slot (the source of
  a snapshot whose request was freed before the copy ran).

Both run in buckets of 1, 2, 4, ... blocks, compiled at start-up. `HostKVCache` is a runner
manager (`runner/manager.py`): a step's writes are its (stores, loads), (pool, block, block)
triples on the wire. On TPU and GPU the host
array would live in the `pinned_host` memory kind for DMA copies; on the CPU host memory is
the device's memory and numpy is the host array.

Glossary: L layers, Bh host blocks, S block size, K kv heads, H head dim, n blocks copied.
"""

from __future__ import annotations

import itertools
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
    """cache [L, B, ...], ids [n] -> [L, n, ...] (a padding id reads block 0)."""
    return cache[:, ids]


@partial(jax.jit, donate_argnames=("cache",))
def scatter_blocks(cache, ids, blocks):
    """Write blocks [L, n, ...] at ids [n] (an id past the cache, padding, writes
    nothing)."""
    return cache.at[:, ids].set(blocks.astype(cache.dtype), mode="drop")


def _arrays(cache) -> list:
    """A pool's arrays: its one array, or a state pool's tuple."""
    return list(cache) if isinstance(cache, tuple) else [cache]


def _rebuilt(cache, arrays: list):
    return tuple(arrays) if isinstance(cache, tuple) else arrays[0]


class HostKVCache(RunnerManager):
    name = "host_kv"

    def __init__(self, blocks: dict[int, int], device_caches: tuple, replicated) -> None:
        """`blocks`: the host blocks of each pool the tier keeps; `device_caches`: the
        model's pools (their shapes and shardings)."""
        self.blocks = dict(blocks)
        self.replicated = replicated
        # pools of per-request state (a tuple of arrays each): their loads run late
        self.state_pools = {p for p, c in enumerate(device_caches) if isinstance(c, tuple)}
        self.arrays = {
            pool: [np.zeros((c.shape[0], n, *c.shape[2:]), c.dtype) for c in _arrays(cache)]
            for pool, cache in enumerate(device_caches)
            if (n := self.blocks.get(pool))
        }
        self.buckets = pow2_buckets(MAX_COPY_BLOCKS)
        # (pool, host blocks, gathered arrays) of the stores not written yet
        self._pending: list[tuple[int, list[int], list]] = []

    @staticmethod
    def block_bytes(cache) -> int:
        """Host bytes of one block (one slot, of per-request state) of a pool."""
        return sum(
            int(np.prod((c.shape[0], *c.shape[2:]))) * jnp.dtype(c.dtype).itemsize
            for c in _arrays(cache)
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
        for pool in self.arrays:
            for cache, n in itertools.product(_arrays(runner.kv_cache[pool]), self.buckets):
                self._executable(runner.table, "host kv gather", gather_blocks, cache, n)
                blocks = self._blocks_shape(cache, n)
                self._executable(runner.table, "host kv scatter", scatter_blocks, cache, n, blocks)

    def empty(self):
        return ([], [])

    def apply(self, runner, writes) -> None:
        """The stores, and the loads into pools of blocks (not per-request state)."""
        stores, loads = writes
        self.flush()  # the earlier steps' stores: every load of this step reads them
        early = [c for c in loads if c[0] not in self.state_pools]
        if stores or early:
            runner.kv_cache = self.copy(runner.table, runner.kv_cache, stores, early)

    def apply_late(self, runner, writes) -> None:
        """The loads into a request's live state slot, after the state copies
        (runner/state_copies.py), which may read that slot first: a snapshot's source that
        its request freed before the copy ran."""
        late = [c for c in writes[1] if c[0] in self.state_pools]
        if late:  # before this step's stores are written: one may reuse the host slot read
            runner.kv_cache = self.copy(runner.table, runner.kv_cache, [], late, flush=False)

    def encode(self, writes) -> list:
        return [[[int(x) for x in copy] for copy in copies] for copies in writes]

    def decode(self, wire):
        wire = expect_list(wire, "the host KV copies")
        if len(wire) != 2:
            raise MalformedMessage("step message: the host KV copies are not [stores, loads]")
        stores, loads = (
            [tuple(expect_ints(p, "a host KV copy", 3)) for p in expect_list(w, "copies")]
            for w in wire
        )
        hosts = [(p, h) for p, _, h in stores] + [(p, h) for p, h, _ in loads]
        for pool, host in hosts:
            if pool not in self.arrays:
                raise MalformedMessage(f"step message: no host KV tier for pool {pool}")
            if not 0 <= host < self.blocks[pool]:
                raise MalformedMessage(f"step message: host block {host} of pool {pool}")
        return stores, loads

    def device_arrays(self, runner) -> list:
        self.flush()  # host memory, written by every process alike
        return [array for arrays in self.arrays.values() for array in arrays]

    def _chunks(self, pairs):
        largest = self.buckets[-1]
        for lo in range(0, len(pairs), largest):
            part = pairs[lo : lo + largest]
            yield part, next(b for b in self.buckets if b >= len(part))

    def flush(self) -> None:
        """Write the stores started by earlier steps into the host arrays."""
        for pool, host_ids, gathered in self._pending:
            for array, blocks in zip(self.arrays[pool], gathered, strict=True):
                array[:, host_ids] = np.asarray(blocks)[:, : len(host_ids)]
        self._pending = []

    def copy(self, table, caches: tuple, stores, loads, flush: bool = True) -> tuple:
        """Start this step's stores ((pool, device block, host block) each) and make its
        loads ((pool, host block, device block) each); returns the updated caches. The
        loads read the host arrays before the stores started here are written, with
        `flush` after those of earlier calls (the host tier may hand a store the host block
        a load of the same step reads: `HostKVTier.store`)."""
        if flush:
            self.flush()
        caches = list(caches)
        for pool in self.arrays:
            mine = [(d, h) for p, d, h in stores if p == pool]
            for part, n in self._chunks(mine):
                ids = np.zeros(n, np.int32)
                ids[: len(part)] = [d for d, _ in part]
                ids = jax.device_put(ids, self.replicated)
                gathered = []
                for cache in _arrays(caches[pool]):
                    exe = self._executable(table, "host kv gather", gather_blocks, cache, n)
                    blocks = exe(cache, ids)
                    blocks.copy_to_host_async()
                    gathered.append(blocks)
                self._pending.append((pool, [h for _, h in part], gathered))
        for pool, hosts in self.arrays.items():
            arrays = _arrays(caches[pool])
            for part, n in self._chunks([(h, d) for p, h, d in loads if p == pool]):
                host_ids = [h for h, _ in part]
                for i, (cache, host) in enumerate(zip(arrays, hosts, strict=True)):
                    ids = np.full(n, cache.shape[1], np.int32)  # padding: past it, dropped
                    ids[: len(part)] = [d for _, d in part]
                    data = np.zeros((cache.shape[0], n, *cache.shape[2:]), host.dtype)
                    data[:, : len(part)] = host[:, host_ids]
                    shape = self._blocks_shape(cache, n)
                    put_ids = jax.device_put(ids, self.replicated)
                    blocks = jax.device_put(data, shape.sharding)
                    exe = self._executable(
                        table, "host kv scatter", scatter_blocks, cache, n, shape
                    )
                    arrays[i] = exe(cache, put_ids, blocks)
            caches[pool] = _rebuilt(caches[pool], arrays)
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


def host_tier_blocks(
    size_gib: float | None, device_caches, shares: dict[int, int], nnodes: int = 1
) -> dict[int, int]:
    """Host blocks of each pool `kv_offloading_size` GiB holds ({}: off), in units of
    `shares` (pool -> its blocks per unit: a hybrid's full-attention blocks between two
    state snapshots, and one snapshot); ValueError when the host does not have that memory
    available, or the engine spans several hosts (not built yet)."""
    if not size_gib:
        return {}
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
    per_unit = sum(n * HostKVCache.block_bytes(device_caches[pool]) for pool, n in shares.items())
    units = size // per_unit
    if units < 1:
        what = "block" if len(shares) == 1 else "block run and state snapshot"
        raise ValueError(
            f"kv_offloading_size={size_gib} GiB holds no {what} ({per_unit} bytes each)."
        )
    return {pool: int(units * n) for pool, n in shares.items()}

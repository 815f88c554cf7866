"""The host-memory KV tier's bookkeeping (vLLM's CPU offloading, `kv_offloading_size`): which
prefix-cache keys have a copy of their block in host memory, and where.

A full block evicted from the device's prefix cache is stored here under the same sha256 key
(`kv_cache_manager.block_key`: salts, adapters and images isolate it exactly as on the
device); a prefix lookup that runs past the device's hits continues here, and the blocks it
finds are loaded back into fresh device blocks before the step that reads them, instead of
being recomputed. The host pool is an LRU of its own. The copies themselves are the runner's
(`runner/host_kv.py`): the scheduler hands it, per step, the device-to-host stores and the
host-to-device loads (`SchedulerOutput.kv_stores`, `kv_loads`). Host-side only: no JAX
import.
"""

from __future__ import annotations

from collections import OrderedDict


class HostKVTier:
    def __init__(self, num_blocks: int, block_bytes: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes  # one block of every layer (the metrics' bytes)
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # key -> host block, oldest first
        self.free = list(range(num_blocks - 1, -1, -1))
        # Keys stored while the coming step is scheduled: their data reaches the host array
        # when the step after starts, so they are not loaded before then.
        self.arriving: set[bytes] = set()
        # Counters for the stats line and the metrics.
        self.stores = 0  # blocks copied device -> host
        self.loads = 0  # blocks copied host -> device
        self.queries = 0  # tokens looked up here (past the device's hits)
        self.hits = 0  # of which found

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / max(1, self.num_blocks)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The host blocks of the longest prefix of `keys` held here."""
        out = []
        for key in keys:
            block = self.cached.get(key)
            if block is None or key in self.arriving:
                break
            out.append(block)
        return out

    def touch(self, keys: list[bytes]) -> None:
        """Mark `keys` as just used (a load): the last to be evicted."""
        for key in keys:
            if key in self.cached:
                self.cached.move_to_end(key)

    def store(self, key: bytes) -> int | None:
        """A host block for the device block evicted under `key`, evicting the least
        recently used entry when full; None when the key is held already (refreshed).

        Reusing a block a load of the same step reads is safe: the runner reads a step's
        loads before it writes the step's stores (at the next step's start)."""
        if key in self.cached:
            self.cached.move_to_end(key)
            return None
        if self.free:
            block = self.free.pop()
        else:
            _, block = self.cached.popitem(last=False)
        self.cached[key] = block
        self.arriving.add(key)
        self.stores += 1
        return block

    def step_scheduled(self) -> None:
        """The coming step's copies are handed to the runner: this step's stores will have
        arrived before the next step's loads."""
        self.arriving.clear()

    def reset(self) -> None:
        self.cached.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.arriving.clear()

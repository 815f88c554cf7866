"""One KV-cache group's rules over its pool (vLLM's SingleTypeKVCacheManager): how many
blocks a request's list needs, which blocks a step frees, which blocks it caches and what a
prefix hit needs, all read from the group's spec (jllm/kv_cache_interface.py), so one class
serves every kind. `KVCacheManager` (engine/kv_cache_manager.py) runs one per group and
moves them together.

A request's block list has one entry per logical block (one slot for per-request state).
Blocks that no later step reads (before a sliding window, or before the current chunk) are
released and NULL_BLOCK takes their place; the NULL_BLOCKs are therefore a prefix of the
list. The runner's block tables keep the old ids there, which the attention masks.

Groups that share a pool cache their blocks under their own variants of the request's keys
(the key and the group's `tag`), as vLLM's keys carry the group id: the groups compute
different contents for the same tokens, and a block is held by one group at a time.
Host-side only: no JAX import.
"""

from __future__ import annotations

from jllm.engine.block_pool import NULL_BLOCK, BlockPool
from jllm.kv_cache_interface import KVCacheSpec


class SingleTypeManager:
    def __init__(self, spec: KVCacheSpec, pool: BlockPool, block_size: int, tag: bytes = b""):
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.tag = tag  # appended to the keys of a pool shared with other groups

    def num_needed(self, num_tokens: int) -> int:
        """The length of the block list of a request with `num_tokens` slots."""
        return self.spec.num_blocks(num_tokens, self.block_size)

    def _hit(self, key: bytes) -> int | None:
        return self.pool.hit(key + self.tag)

    def hit_length(self, keys: list[bytes], n: int) -> int:
        """The longest hit of at most `n` blocks this group accepts: m blocks such that the
        blocks from `hit_start(m)` to m are cached (full attention: all of them). Every m up
        to the cached prefix is accepted; beyond it (windowed kinds only: their accepted
        lengths are not a prefix of each other) the scan goes down from n, and looks each
        block up at most once."""
        if not self.spec.prefix_cacheable:
            return 0  # no state snapshots: only the empty hit (kv_cache_interface.MambaSpec)
        cached = 0  # the cached prefix
        while cached < n and self._hit(keys[cached]) is not None:
            cached += 1
        m = n
        while m > cached:
            first = self.spec.hit_start(m, self.block_size)
            if first == 0:  # nor does any shorter hit skip a block: only the prefix
                return cached
            i = m - 1
            while i >= first and self._hit(keys[i]) is not None:
                i -= 1
            if i < first:
                return m
            # Block i is missing: every hit longer than i reads it (hit_start grows with
            # the hit), so the next candidate is the hit of i blocks.
            m = i
        return m

    def hit_blocks(self, keys: list[bytes], n: int) -> list[int]:
        """The blocks of an accepted hit of `n` blocks: NULL_BLOCK where no later step
        reads."""
        if n == 0:
            return []
        first = self.spec.hit_start(n, self.block_size)
        return [NULL_BLOCK] * first + [self.pool.cached[k + self.tag] for k in keys[first:n]]

    def free_skipped(self, held: list[int], start: int) -> None:
        """Release the blocks wholly before what a step from position `start` reads. The
        list's NULL_BLOCKs are a prefix (hits skip the same way), so the scan stops at the
        first one."""
        i = min(len(held), self.spec.num_skipped_tokens(start) // self.block_size)
        dead = []
        while i > 0 and held[i - 1] != NULL_BLOCK:
            i -= 1
            dead.append(held[i])
            held[i] = NULL_BLOCK
        self.pool.release(dead[::-1])  # the later blocks are evicted first, as a tail

    def cache_blocks(self, held: list[int], keys: list[bytes], start: int, end: int) -> None:
        """Register the full blocks `start` .. `end` - 1 under their keys."""
        if not self.spec.prefix_cacheable:
            return
        for i in range(start, end):
            if held[i] != NULL_BLOCK:
                self.pool.cache(held[i], keys[i] + self.tag)

    def forget(self, held: list[int], keys: list[bytes], first: int) -> None:
        """Drop the keys of the blocks from `first` on (their contents were never written)."""
        pool = self.pool
        for i in range(first, min(len(held), len(keys))):
            b, key = held[i], keys[i] + self.tag
            if b != NULL_BLOCK and pool.block_hash[b] == key and pool.cached.get(key) == b:
                del pool.cached[key]
                pool.block_hash[b] = None
                pool.unfresh(b)

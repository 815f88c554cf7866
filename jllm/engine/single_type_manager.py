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

    def num_fresh(self, held: list[int], hit: list[int], num_tokens: int) -> int:
        """How many fresh blocks a request holding `held` needs, after the hits `hit`, to
        hold `num_tokens` slots."""
        return max(0, self.num_needed(num_tokens) - len(held) - len(hit))

    def extend(self, held: list[int], hit: list[int], fresh: list[int]) -> None:
        """Append the hits (taken) and the fresh blocks to the request's list."""
        held.extend(hit)
        held.extend(fresh)

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

    def cache_blocks(
        self, held: list[int], keys: list[bytes], start: int, end: int, step_end: int = 0
    ) -> None:
        """Register the full blocks `start` .. `end` - 1 under their keys (`step_end`: where
        the step that fills them ends, in tokens)."""
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
                pool.uncache(b)


class StateManager(SingleTypeManager):
    """A per-request state group (`MambaSpec`): each request's list is its one live slot.
    With the spec's `cache_interval` C (vLLM's "align" mode), the state after each multiple
    of C that a step ends at (the scheduler cuts prefill chunks there: `align`) is
    snapshotted into a slot of its own, cached under the key of the block it ends, and a
    prefix hit of n blocks (n * S a multiple of C) starts a request from the snapshot at n.

    Snapshots are copies of whole slots, made on the device before a step's forward
    (`SchedulerOutput.state_copies`, in order): first the live slots of the steps that ended
    at a multiple of C into their snapshot slots (the step that reached the multiple has
    run by then), then the snapshots hit into the new requests' live slots. A snapshot is
    therefore written one step after the step that computed it, so its pool takes it as a
    hit only from the step after it was cached (`same_step_hits=False`: the pool's `fresh`
    blocks), and each slot a copy reads or writes stays held until the copies are handed
    to the step that makes them (`take_copies`). Not in any request's list, a cached
    snapshot is a free block with a key, evicted (LRU) like any other."""

    def __init__(self, spec, pool, block_size: int, tag: bytes = b""):
        super().__init__(spec, pool, block_size, tag)
        self.interval = spec.cache_interval
        self.stride = self.interval // block_size  # blocks between snapshots
        # Snapshots (live slot, snapshot slot, block) of the step being scheduled, those of
        # the step scheduled before it (copied before the next step's forward), and the
        # loads (snapshot, live slot) of the step being scheduled; every slot here is held.
        self.snapshots: list[tuple[int, int, int]] = []
        self.ready: list[tuple[int, int, int]] = []
        self.loads: list[tuple[int, int]] = []
        # Speculative decoding (the spec's `backups`: a request's list is [live, backup]):
        # restores (backup, live) of requests whose last step rejected drafts, and saves
        # (live, backup) of the rows that verify drafts in the step being scheduled.
        self.restores: list[tuple[int, int]] = []
        self.saves: list[tuple[int, int]] = []

    def align(self, start: int, num_new: int) -> int:
        """`num_new` tokens from `start` cut to end at the last multiple of the interval they
        cross, so that the step snapshots there (a prompt's end too: its tail runs in the
        next step, beside the others' rows)."""
        if not self.interval:
            return num_new
        boundary = (start + num_new) // self.interval * self.interval
        return boundary - start if boundary > start else num_new

    def hit_length(self, keys: list[bytes], n: int) -> int:
        """The longest m <= n at a snapshot (m a multiple of the stride) whose snapshot is
        cached and written (not one the step being scheduled caches)."""
        if not self.interval:
            return 0
        for m in range(n // self.stride * self.stride, 0, -self.stride):
            if self._hit(keys[m - 1]) is not None:
                return m
        return 0

    def hit_blocks(self, keys: list[bytes], n: int) -> list[int]:
        """The snapshot a hit of n blocks starts from (taken until its copy is handed on)."""
        return [] if n == 0 else [self.pool.cached[keys[n - 1] + self.tag]]

    def num_fresh(self, held: list[int], hit: list[int], num_tokens: int) -> int:
        return 0 if held else self.spec.num_blocks(num_tokens, self.block_size)

    def save(self, held: list[int]) -> None:
        """The request verifies drafts in the step being scheduled: keep its state before
        the step in its backup (unless a restore puts it back there already)."""
        if all(dst != held[0] for _, dst in self.restores):
            self.saves.append((held[0], held[1]))

    def drop(self, held: list[int]) -> None:
        """The request gives its slots back: its saves and restores not handed on yet are
        dropped (its slots may serve another request in the same step)."""
        mine = set(held)
        self.saves = [c for c in self.saves if not mine & set(c)]
        self.restores = [c for c in self.restores if not mine & set(c)]

    def restore(self, held: list[int]) -> None:
        """The request's last step rejected drafts, which stay in its live state: the next
        step starts from its backup (the state before that step)."""
        self.restores.append((held[1], held[0]))

    def extend(self, held: list[int], hit: list[int], fresh: list[int]) -> None:
        held.extend(fresh)
        if hit:  # the live slot starts as the snapshot
            self.loads.append((hit[0], held[0]))

    def free_skipped(self, held: list[int], start: int) -> None:
        """The live slot is read by every step."""

    def cache_blocks(
        self, held: list[int], keys: list[bytes], start: int, end: int, step_end: int = 0
    ) -> None:
        """Snapshot the state at block `end` when the step ends there (`step_end`, in
        tokens: not past it, with drafts or tokens still in flight) at a multiple of the
        interval (best effort: none when the pool has no free slot)."""
        if not self.interval or end <= start or end % self.stride or self.pool.num_free == 0:
            return
        if step_end != end * self.block_size:
            return
        key = keys[end - 1] + self.tag
        if key in self.pool.cached:
            return
        (slot,) = self.pool.allocate(1)
        self.pool.cache(slot, key)
        self.snapshots.append((held[0], slot, end))

    def forget(self, held: list[int], keys: list[bytes], first: int) -> None:
        """A request taken back out of the step it was scheduled in: its snapshot past
        `first` blocks (never to be computed) is dropped."""
        keep = []
        for live, slot, end in self.snapshots:
            if held and live == held[0] and end > first:
                self.pool.uncache(slot)
                self.pool.release([slot])
            else:
                keep.append((live, slot, end))
        self.snapshots = keep

    def discard_pending(self) -> None:
        """Drop the snapshots not copied yet, their slots and keys (a prefix-cache reset with
        no request holding a slot: nothing reads them)."""
        for _, slot, _ in self.ready + self.snapshots:
            self.pool.uncache(slot)
            self.pool.release([slot])
        self.ready, self.snapshots = [], []

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies the step being handed on makes before its forward, in order: the
        snapshots of the step before it (which has run by then), then its own loads. Their
        slots are released: any later use of them runs after these copies."""
        copies = [(live, slot) for live, slot, _ in self.ready] + self.loads
        copies += self.restores + self.saves
        self.pool.release([slot for _, slot, _ in self.ready] + [snap for snap, _ in self.loads])
        self.ready, self.snapshots, self.loads = self.snapshots, [], []
        self.restores, self.saves = [], []
        return copies

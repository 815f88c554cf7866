"""Paged KV-cache bookkeeping: block pools with ref counts and automatic prefix caching,
per KV-cache group.

Blocks are the unit of the device cache (`block_size` token slots each). Block 0 is a
reserved null block that padding tokens write into; it is never handed out.

KV-cache groups (vLLM V1's hybrid KV cache manager, in our own shape): the layers of one
attention kind share a group, and each group has its own block pool (`BlockPool`, sized per
group), its own cache arrays on the device and its own block table per request. A model of
one attention kind is one group; a speculative draft model's layers are a group of their
own. A request's blocks are a tuple with one list per group, where list index = logical
block index; it is admitted, grown, hit in the prefix cache, preempted and freed in every
group at once: a step that cannot get blocks in every group gets none.

A full-attention group holds the blocks of a request's whole context. A sliding-window group
(window W: the query at position p reads keys p-W+1..p) holds only those its window can
still see: a step computing positions c.. reads keys from c-W+1 on, and positions never move
back (a rejected draft is recomputed from past the step's first position), so each step
releases the blocks wholly before c-W+1 and puts NULL_BLOCK in their place. The runner's
block tables keep the old ids there, which the window masks. A request then holds a bounded
span of blocks (`max_blocks_per_request`), however long it runs.

Prefix caching: every full block of a request has a key chained from its parent's key and
its own token ids: sha256(parent key || the block's token ids as int64 || extra keys), where
the first block's parent is a random per-process root (from PYTHONHASHSEED when set, as in
vLLM) and its extra keys are the request's LoRA adapter (a digest of its files: an adapter
reloaded under the same name with other weights gets other keys) and its `cache_salt`. A hit
is trusted, so the key must not be forgeable: Python's `hash` of the token tuple, used
before, is neither wide nor keyed, and requests with different salts (tenants) or adapters
must never share a block.

A full block is registered under its key as soon as it is allocated (its KV is written in
the same step that first reads it, and every layer writes before it attends), so even
requests scheduled in the same step share it. Not under pipeline stages
(`same_step_hits=False`): a step's micro-batches run its rows in the runner's order (one-token
rows first), not the scheduler's, so a row could read a block that a later micro-batch
writes; there a block is a hit only from the step after the one that computes it (a pool's
`fresh` blocks are the current step's), and a request admitted beside its block's writer
computes the block itself. Only known tokens count: the slots a step
computes for draft tokens are not a block's content until the drafts are accepted (and
appended), so a rejected draft never enters the cache. Freed blocks (a window's too) keep
their key and stay in an LRU free queue until the pool needs them back. Each group caches
its own blocks under the request's keys. A hit of n blocks (the next position n*S) needs, in
a full group, all n cached, and in a sliding group only those its window reads from there;
a hit is the longest n every group accepts (vLLM's rule).
Host-side only: no JAX import.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jllm.engine.host_kv_tier import HostKVTier
from jllm.engine.request import Request
from jllm.utils import cdiv

NULL_BLOCK = 0


def _root_key() -> bytes:
    seed = os.environ.get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else hashlib.sha256(seed.encode()).digest()


ROOT_KEY = _root_key()


def block_key(
    parent: bytes | None,
    tokens,
    cache_salt: str | None = None,
    lora: bytes | None = None,
    images: tuple[bytes, ...] = (),
) -> bytes:
    """The prefix-cache key of a full block: a 32-byte sha256 digest. Blocks have a fixed
    token count, so the encoding is unambiguous with the extra keys last: the content hash
    of each image whose tokens the block holds (32 bytes each; the placeholder tokens are
    the same for every image), the LoRA adapter's 32-byte digest, then the salt."""
    h = hashlib.sha256(ROOT_KEY if parent is None else parent)
    h.update(np.asarray(tokens, np.int64).tobytes())
    for image in images:
        h.update(b"image:" + image)
    if parent is None and lora is not None:
        h.update(b"lora:" + lora)
    if parent is None and cache_salt is not None:
        h.update(b"cache_salt:" + cache_salt.encode())
    return h.digest()


def max_blocks_per_request(
    num_tokens: int, block_size: int, window: int | None, max_step_tokens: int
) -> int:
    """The most blocks one group holds for a request of `num_tokens` tokens (lookahead slots
    included) when a step computes at most `max_step_tokens` of them (drafts and lookahead
    included): what the engine checks a pool against and sizes it by. Full attention: the
    whole context. Sliding window W: a step from position c holds c-W+1 .. c+n-1, a span of
    W-1+n tokens, which straddles at most cdiv(span - 1, S) + 1 blocks."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    return min(full, cdiv(window + max_step_tokens - 2, block_size) + 1)


class BlockPool:
    """One KV-cache group's blocks: ref counts, the prefix cache's keys, and the LRU queue
    of free blocks (the front is reused first). NULL_BLOCK entries of a request's list (a
    window's skipped blocks) are neither taken nor released."""

    def __init__(self, num_blocks: int, same_step_hits: bool = True) -> None:
        self.num_blocks = num_blocks
        # The blocks cached by the step being scheduled, which it may not hit (None: it may).
        self.fresh: set[int] | None = None if same_step_hits else set()
        # Called with (block, key) when a cached block's key is evicted (the host tier).
        self.on_evict = None
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block key -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def take(self, blocks: list[int]) -> None:
        """Hold prefix-cache hits: blocks that may sit in the free queue."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def num_reused_free(self, blocks: list[int]) -> int:
        """How many of the hits `blocks` are free blocks (taking them shrinks the pool)."""
        return sum(1 for b in blocks if b != NULL_BLOCK and self.ref_cnt[b] == 0)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, evicting their old keys."""
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                    self.unfresh(b)
                    if self.on_evict is not None:
                        self.on_evict(b, h)
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, key: bytes) -> None:
        if self.block_hash[block] is None and key not in self.cached:
            self.cached[key] = block
            self.block_hash[block] = key
            if self.fresh is not None:
                self.fresh.add(block)

    def begin_step(self) -> None:
        """The blocks the last step cached are written now: this step may hit them."""
        if self.fresh is not None:
            self.fresh.clear()

    def unfresh(self, block: int) -> None:
        if self.fresh is not None:
            self.fresh.discard(block)

    def hit(self, key: bytes) -> int | None:
        """The block cached under `key` that this step may read, or None."""
        block = self.cached.get(key)
        if block is None or (self.fresh is not None and block in self.fresh):
            return None
        return block

    def hits(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` that this step may read."""
        blocks = []
        for h in keys:
            block = self.hit(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Give blocks back; tail blocks go first in the eviction order."""
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def reset(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.begin_step()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        enable_prefix_caching: bool,
        num_groups: int | None = None,
        windows: Sequence[int | None] | None = None,
        host: HostKVTier | None = None,
        same_step_hits: bool = True,
    ) -> None:
        """`num_blocks`: each group's pool size (an int: every group's); `windows`: each
        group's sliding window in tokens, None for full attention (the default for all).
        The number of groups is `num_groups`, else the length of a list given, else 1.
        `host`: the host-memory tier (one full-attention group only), or None.
        `same_step_hits`: whether a request may hit blocks that the step it is scheduled in
        computes, which needs every write of a step before its reads (False under pipeline
        stages; `begin_step` then starts each step)."""
        scalar = np.ndim(num_blocks) == 0
        if num_groups is None:
            num_groups = 1 if scalar and windows is None else len(windows if scalar else num_blocks)
        num_blocks = [int(num_blocks)] * num_groups if scalar else [int(n) for n in num_blocks]
        windows = [None] * num_groups if windows is None else list(windows)
        if len(num_blocks) != num_groups or len(windows) != num_groups:
            raise ValueError(
                f"{num_groups} KV-cache groups need {num_groups} block counts and windows, "
                f"got {list(num_blocks)} and {windows}."
            )
        if min(num_blocks) < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {min(num_blocks)}.")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"A sliding window must be at least 1 token, got {windows}.")
        self.group_num_blocks = tuple(num_blocks)
        self.windows = tuple(windows)
        self.num_blocks = max(num_blocks)  # the largest pool (the runner's padding slot)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(n, same_step_hits) for n in num_blocks]
        self.req_blocks: dict[str, tuple[list[int], ...]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.host = host
        self.host_hits: list[int] = []  # the last lookup's host blocks (get_computed_blocks)
        # The copies the next step makes: (device block, host block) stores of evicted
        # blocks, and (host block, device block) loads of host hits.
        self.kv_stores: list[tuple[int, int]] = []
        self.kv_loads: list[tuple[int, int]] = []
        if host is not None:
            if len(self.pools) != 1 or self.windows[0] is not None or not enable_prefix_caching:
                raise ValueError(
                    "The host KV tier (kv_offloading_size) needs prefix caching and one "
                    "KV-cache group of full attention; this model has "
                    f"{len(self.pools)} group(s) with windows {list(self.windows)}."
                )
            self.pools[0].on_evict = self._store

    def _store(self, block: int, key: bytes) -> None:
        host_block = self.host.store(key)
        if host_block is not None:
            self.kv_stores.append((block, host_block))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The stores and loads gathered since the last call, for the step that runs next."""
        stores, loads = self.kv_stores, self.kv_loads
        self.kv_stores, self.kv_loads = [], []
        if self.host is not None:
            self.host.step_scheduled()
        return stores, loads

    def begin_step(self) -> None:
        """A new step is being scheduled: the blocks cached by the last one are written
        before it runs (steps run in order), so it may hit them."""
        for pool in self.pools:
            pool.begin_step()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the group with the fewest: a step that needs no more than this in
        any group fits (`group_num_free` has each group's)."""
        return min(pool.num_free for pool in self.pools)

    @property
    def group_num_free(self) -> tuple[int, ...]:
        return tuple(pool.num_free for pool in self.pools)

    @property
    def all_blocks_free(self) -> bool:
        """No request holds a block in any group (with unequal pools `num_free_blocks` cannot
        tell: it is the smallest group's count)."""
        return all(pool.num_free == pool.num_blocks - 1 for pool in self.pools)

    @property
    def usage(self) -> float:
        """The fullest group's share of its blocks in use: the group that runs out first."""
        return max(pool.usage for pool in self.pools)

    def no_blocks(self) -> tuple[list[int], ...]:
        return tuple([] for _ in self.pools)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's blocks: one list per group (NULL_BLOCK where a window left)."""
        return self.req_blocks.get(request_id) or self.no_blocks()

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        size = self.block_size
        tokens = req.all_token_ids
        for i in range(len(req.block_hashes), num_tokens // size):
            parent = req.block_hashes[i - 1] if i else None
            block = tokens[i * size : (i + 1) * size]
            images = tuple(it.hash for it in req.mm_items if it.overlaps(i * size, (i + 1) * size))
            req.block_hashes.append(
                block_key(parent, block, req.cache_salt, req.lora_digest, images)
            )

    def _window_blocks(self, window: int) -> int:
        """How many blocks before block n a window reads from position n*S."""
        return cdiv(window - 1, self.block_size)

    def _hit_length(self, g: int, keys: list[bytes], n: int) -> int:
        """The longest hit of at most `n` blocks group `g` accepts: a full group needs every
        block cached, a sliding one the last `_window_blocks` (or all, when fewer). The
        accepted lengths of a sliding group are not a prefix, hence the scan down from n."""
        pool, window = self.pools[g], self.windows[g]
        if window is None:
            return len(pool.hits(keys[:n]))
        need, run = self._window_blocks(window), 0
        if need == 0:
            return n
        for i in range(n - 1, -1, -1):
            if pool.hit(keys[i]) is None:
                run = 0
                continue
            run += 1
            if run == need:
                return i + need
        return run  # blocks 0 .. run-1, all the window reads from position run*S

    def get_computed_blocks(self, req: Request) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix of `req` that every group accepts as a hit, in whole blocks
        and leaving one token to compute: (each group's blocks, NULL_BLOCK where a window
        does not read, and the tokens they hold). A request asking for prompt logprobs reads
        none (vLLM's rule: they are computed for the whole prompt); its blocks are still
        cached for others. With the host tier, `host_hits` has the host blocks of the keys
        that follow the device's hits (their tokens are not counted here)."""
        self.host_hits = []
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return self.no_blocks(), 0
        self._update_hashes(req, req.num_tokens - 1)
        keys = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        n = len(keys)
        while True:  # a fixed point, as vLLM's hybrid coordinator: each group may cut n
            m = min(self._hit_length(g, keys, n) for g in range(self.num_groups))
            if m == n:
                break
            n = m
        hits = []
        for pool, window in zip(self.pools, self.windows, strict=True):
            skip = 0 if window is None else max(0, n - self._window_blocks(window))
            hits.append([NULL_BLOCK] * skip + [pool.cached[k] for k in keys[skip:n]])
        if self.host is not None:
            self.host_hits = self.host.lookup(keys[n:])
        return tuple(hits), n * self.block_size

    def record_host_lookup(self, req: Request, num_device_hit: int, host_hits: list[int]):
        """Count one admitted request's host lookup: the tokens past the device's hits."""
        if self.host is not None and self.enable_prefix_caching:
            looked = max(0, (req.num_tokens - 1) // self.block_size * self.block_size)
            self.host.queries += max(0, looked - num_device_hit)
            self.host.hits += len(host_hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (retries of a blocked request don't count)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: tuple[list[int], ...] = (),
        lookahead: int = 0,
        host_hits: Sequence[int] = (),
    ) -> tuple[list[int], ...] | None:
        """Make room, in every group, for `num_new_tokens` more tokens of `req`, and
        `lookahead` slots past them (where a draft model writes its drafts), after the
        prefix-cache hits `new_computed_blocks` (one list per group, from
        `get_computed_blocks`) and the host tier's hits `host_hits` after them (loaded into
        fresh blocks before the step); None if any group's pool is short, having changed
        nothing but released the blocks that fell out of a window (which no later step
        reads)."""
        blocks = self.req_blocks.get(req.request_id)
        if blocks is None:
            blocks = self.req_blocks[req.request_id] = self.no_blocks()
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_loaded = len(host_hits)
        start = req.num_computed_tokens + (num_hit + num_loaded) * self.block_size
        total = start + num_new_tokens
        need = cdiv(total + lookahead, self.block_size)
        self._free_skipped(blocks, start)
        if not num_hit and not num_loaded and min(map(len, blocks)) >= need:  # a decode
            if self.enable_prefix_caching:
                self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
            return blocks
        hits = new_computed_blocks or self.no_blocks()
        grow = []
        for pool, held, hit in zip(self.pools, blocks, hits, strict=True):
            n = max(0, need - len(held) - len(hit))
            if n > pool.num_free - pool.num_reused_free(hit):
                return None
            grow.append(n)
        for pool, held, hit, n in zip(self.pools, blocks, hits, grow, strict=True):
            pool.take(hit)
            held.extend(hit)
            fresh = pool.allocate(n)
            if num_loaded:  # the first fresh blocks take the host hits' contents
                self.kv_loads.extend(zip(host_hits, fresh[:num_loaded], strict=True))
                first = len(held)
                self._update_hashes(req, (first + num_loaded) * self.block_size)
                self.host.touch(req.block_hashes[first : first + num_loaded])
                self.host.loads += num_loaded
            held.extend(fresh)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
        return blocks

    def _free_skipped(self, blocks: tuple[list[int], ...], start: int) -> None:
        """In each sliding group, release the blocks wholly before the window of a step
        computing from position `start`. A list's NULL_BLOCKs are a prefix (hits skip the
        same way), so the scan stops at the first one."""
        for pool, held, window in zip(self.pools, blocks, self.windows, strict=True):
            if window is None:
                continue
            i = min(len(held), max(0, start - window + 1) // self.block_size)
            dead = []
            while i > 0 and held[i - 1] != NULL_BLOCK:
                i -= 1
                dead.append(held[i])
                held[i] = NULL_BLOCK
            pool.release(dead[::-1])  # the later blocks are evicted first, as a tail

    def _cache_full_blocks(self, req: Request, blocks, num_tokens: int) -> None:
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self._update_hashes(req, num_tokens)
        for pool, held in zip(self.pools, blocks, strict=True):
            for i in range(start, end):
                if held[i] != NULL_BLOCK:
                    pool.cache(held[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = end

    def forget_uncomputed(self, req: Request, num_computed: int) -> None:
        """Drop the prefix-cache keys of `req`'s blocks past its first `num_computed`
        tokens: blocks registered when a step was scheduled that will not run them (the
        request is taken back out of the step), whose contents were never written."""
        blocks = self.req_blocks.get(req.request_id, self.no_blocks())
        first = num_computed // self.block_size
        for pool, held in zip(self.pools, blocks, strict=True):
            for i in range(first, min(len(held), len(req.block_hashes))):
                b, key = held[i], req.block_hashes[i]
                if b != NULL_BLOCK and pool.block_hash[b] == key and pool.cached.get(key) == b:
                    del pool.cached[key]
                    pool.block_hash[b] = None
                    pool.unfresh(b)
        if req.request_id in self.num_cached_blocks:
            self.num_cached_blocks[req.request_id] = min(
                first, self.num_cached_blocks[req.request_id]
            )

    def free(self, req: Request) -> None:
        """Release `req`'s blocks in every group; tail blocks go first in the eviction
        order."""
        blocks = self.req_blocks.pop(req.request_id, self.no_blocks())
        self.num_cached_blocks.pop(req.request_id, None)
        for pool, held in zip(self.pools, blocks, strict=True):
            pool.release(held)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (the host tier's too); refused (False) while any
        request holds blocks."""
        if not self.all_blocks_free:
            return False
        for pool in self.pools:
            pool.reset()
        if self.host is not None:
            self.host.reset()
            self.kv_stores.clear()  # stores not sent yet: their keys are forgotten too
        return True

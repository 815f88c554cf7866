"""Paged KV-cache bookkeeping: block pools with ref counts and automatic prefix caching,
per KV-cache group.

Blocks are the unit of the device cache (`block_size` token slots each). Block 0 is a
reserved null block that padding tokens write into; it is never handed out.

KV-cache groups (vLLM V1's hybrid KV cache manager, in our own shape): the layers of one
attention kind share a group, and each group has its own block pool (`BlockPool`), its own
cache arrays on the device and its own block table per request. A model of one attention
kind is one group; a speculative draft model's layers are a group of their own. Every
group here is full attention: a request holds, in each group, the blocks of its whole
context (a sliding-window group will hold only those its window still sees). A request's
blocks are a tuple with one list per group; it is admitted, grown, hit in the prefix cache,
preempted and freed in every group at once: a step that cannot get blocks in every group
gets none.

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
requests scheduled in the same step share it. Only known tokens count: the slots a step
computes for draft tokens are not a block's content until the drafts are accepted (and
appended), so a rejected draft never enters the cache. Freed blocks keep their key and stay
in an LRU free queue until the pool needs them back. Each group caches its own blocks under
the request's keys; a hit is the prefix every group holds.
Host-side only: no JAX import.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

import numpy as np

from jllm.engine.request import Request
from jllm.utils import cdiv

NULL_BLOCK = 0


def _root_key() -> bytes:
    seed = os.environ.get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else hashlib.sha256(seed.encode()).digest()


ROOT_KEY = _root_key()


def block_key(
    parent: bytes | None, tokens, cache_salt: str | None = None, lora: bytes | None = None
) -> bytes:
    """The prefix-cache key of a full block: a 32-byte sha256 digest. Blocks have a fixed
    token count, so the encoding is unambiguous with the extra keys last: the LoRA
    adapter's 32-byte digest, then the salt."""
    h = hashlib.sha256(ROOT_KEY if parent is None else parent)
    h.update(np.asarray(tokens, np.int64).tobytes())
    if parent is None and lora is not None:
        h.update(b"lora:" + lora)
    if parent is None and cache_salt is not None:
        h.update(b"cache_salt:" + cache_salt.encode())
    return h.digest()


class BlockPool:
    """One KV-cache group's blocks: ref counts, the prefix cache's keys, and the LRU queue
    of free blocks (the front is reused first)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block key -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take(self, blocks: list[int]) -> None:
        """Hold prefix-cache hits: blocks that may sit in the free queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def num_reused_free(self, blocks: list[int]) -> int:
        """How many of the hits `blocks` are free blocks (taking them shrinks the pool)."""
        return sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, evicting their old keys."""
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, key: bytes) -> None:
        if self.block_hash[block] is None and key not in self.cached:
            self.cached[key] = block
            self.block_hash[block] = key

    def hits(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys`."""
        blocks = []
        for h in keys:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Give blocks back; tail blocks go first in the eviction order."""
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def reset(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_groups: int = 1
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(num_blocks) for _ in range(num_groups)]
        self.req_blocks: dict[str, tuple[list[int], ...]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the group with the fewest (every group grows together)."""
        return min(pool.num_free for pool in self.pools)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def no_blocks(self) -> tuple[list[int], ...]:
        return tuple([] for _ in self.pools)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's blocks: one list per group."""
        return self.req_blocks.get(request_id) or self.no_blocks()

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        size = self.block_size
        tokens = req.all_token_ids
        for i in range(len(req.block_hashes), num_tokens // size):
            parent = req.block_hashes[i - 1] if i else None
            block = tokens[i * size : (i + 1) * size]
            req.block_hashes.append(block_key(parent, block, req.cache_salt, req.lora_digest))

    def get_computed_blocks(self, req: Request) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix of `req` that every group holds cached, in whole blocks and
        leaving one token to compute: (each group's blocks, the tokens they hold). A request
        asking for prompt logprobs reads none (vLLM's rule: they are computed for the whole
        prompt); its blocks are still cached for others."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return self.no_blocks(), 0
        self._update_hashes(req, req.num_tokens - 1)
        keys = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        hits = [pool.hits(keys) for pool in self.pools]
        n = min(len(h) for h in hits)
        return tuple(h[:n] for h in hits), n * self.block_size

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
    ) -> tuple[list[int], ...] | None:
        """Make room, in every group, for `num_new_tokens` more tokens of `req`, and
        `lookahead` slots past them (where a draft model writes its drafts), after the
        prefix-cache hits `new_computed_blocks` (one list per group, from
        `get_computed_blocks`); None, changing nothing, if any group's pool is short."""
        blocks = self.req_blocks.get(req.request_id)
        if blocks is None:
            blocks = self.req_blocks[req.request_id] = self.no_blocks()
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        total = req.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        need = cdiv(total + lookahead, self.block_size)
        if not num_hit and min(map(len, blocks)) >= need:  # a decode inside its blocks
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
            held.extend(pool.allocate(n))
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
        return blocks

    def _cache_full_blocks(self, req: Request, blocks, num_tokens: int) -> None:
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self._update_hashes(req, num_tokens)
        for pool, held in zip(self.pools, blocks, strict=True):
            for i in range(start, end):
                pool.cache(held[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = end

    def free(self, req: Request) -> None:
        """Release `req`'s blocks in every group; tail blocks go first in the eviction
        order."""
        blocks = self.req_blocks.pop(req.request_id, self.no_blocks())
        self.num_cached_blocks.pop(req.request_id, None)
        for pool, held in zip(self.pools, blocks, strict=True):
            pool.release(held)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks."""
        if any(pool.num_free != self.num_blocks - 1 for pool in self.pools):
            return False
        for pool in self.pools:
            pool.reset()
        return True

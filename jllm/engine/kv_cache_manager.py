"""Paged KV-cache bookkeeping: a block pool with ref counts and automatic prefix caching.

Blocks are the unit of the device cache (`block_size` token slots each). Block 0 is a
reserved null block that padding tokens write into; it is never handed out.

Prefix caching: every full block of a request has a key chained from its parent's key and
its own token ids: sha256(parent key || the block's token ids as int64 || extra keys), where
the first block's parent is a random per-process root (from PYTHONHASHSEED when set, as in
vLLM) and its extra key is the request's `cache_salt`. A hit is trusted, so the key must not
be forgeable: Python's `hash` of the token tuple, used before, is neither wide nor keyed, and
requests with different salts (tenants) must never share a block.

A full block is registered under its key as soon as it is allocated (its KV is written in
the same step that first reads it, and every layer writes before it attends), so even
requests scheduled in the same step share it. Only known tokens count: the slots a step
computes for draft tokens are not a block's content until the drafts are accepted (and
appended), so a rejected draft never enters the cache. Freed blocks keep their key and stay
in an LRU free queue until the pool needs them back.
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


def block_key(parent: bytes | None, tokens, cache_salt: str | None = None) -> bytes:
    """The prefix-cache key of a full block: a 32-byte sha256 digest. Blocks have a fixed
    token count, so the encoding is unambiguous with the salt last."""
    h = hashlib.sha256(ROOT_KEY if parent is None else parent)
    h.update(np.asarray(tokens, np.int64).tobytes())
    if parent is None and cache_salt is not None:
        h.update(b"cache_salt:" + cache_salt.encode())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Eviction order: the front is reused first.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block key -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        size = self.block_size
        tokens = req.all_token_ids
        for i in range(len(req.block_hashes), num_tokens // size):
            parent = req.block_hashes[i - 1] if i else None
            block = tokens[i * size : (i + 1) * size]
            req.block_hashes.append(block_key(parent, block, req.cache_salt))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest cached prefix of `req` in whole blocks, leaving one token to compute.
        A request asking for prompt logprobs reads none (vLLM's rule: they are computed for
        the whole prompt); its blocks are still cached for others."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(req, req.num_tokens - 1)
        blocks = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

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
        new_computed_blocks: list[int] = (),
        lookahead: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `req`, and `lookahead` slots past
        them (where a draft model writes its drafts); None if the pool is short."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = cdiv(total + lookahead, self.block_size)
        num_new_blocks = max(0, need - len(blocks) - len(new_computed_blocks))
        reused_free = sum(1 for b in new_computed_blocks if self.ref_cnt[b] == 0)
        if num_new_blocks > self.num_free_blocks - reused_free:
            return None
        for b in new_computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        blocks.extend(new_computed_blocks)
        for _ in range(num_new_blocks):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            blocks.append(b)
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
        return blocks

    def _cache_full_blocks(self, req: Request, blocks: list[int], num_tokens: int) -> None:
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self._update_hashes(req, num_tokens)
        for i in range(start, end):
            b, h = blocks[i], req.block_hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        self.num_cached_blocks[req.request_id] = end

    def free(self, req: Request) -> None:
        """Release `req`'s blocks; tail blocks go first in the eviction order."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

"""A KV-cache pool's blocks: ref counts, the prefix cache's keys, and the LRU queue of free
blocks; and the keys themselves.

Blocks are the unit of the device cache (`block_size` token slots each, or one request's
state: jllm/kv_cache_interface.py). Block 0 is a reserved null block that padding tokens
write into; it is never handed out.

Prefix-cache keys: every full block of a request has a key chained from its parent's key and
its own token ids: sha256(parent key || the block's token ids as int64 || extra keys), where
the first block's parent is a random per-process root (from PYTHONHASHSEED when set, as in
vLLM) and its extra keys are the request's LoRA adapter (a digest of its files: an adapter
reloaded under the same name with other weights gets other keys) and its `cache_salt`. A hit
is trusted, so the key must not be forgeable: Python's `hash` of the token tuple, used
before, is neither wide nor keyed, and requests with different salts (tenants) or adapters
must never share a block. Groups that share a pool cache their blocks under their own
variants of the keys (`engine/single_type_manager.py`), as vLLM's keys carry the group id.
Host-side only: no JAX import.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

import numpy as np

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
    root: bytes | None = None,
    embeds: bytes | None = None,
) -> bytes:
    """The prefix-cache key of a full block: a 32-byte sha256 digest. Blocks have a fixed
    token count, so the encoding is unambiguous with the extra keys last: the content hash
    of each image whose tokens the block holds (32 bytes each; the placeholder tokens are
    the same for every image), the digest of an embeddings prompt's rows in the block (its
    token ids are placeholders), the LoRA adapter's 32-byte digest, then the salt. `root`:
    the first block's parent instead of ROOT_KEY (the KV-cache manager's, new with every
    weight update)."""
    h = hashlib.sha256(parent if parent is not None else root or ROOT_KEY)
    h.update(np.asarray(tokens, np.int64).tobytes())
    for image in images:
        h.update(b"image:" + image)
    if embeds is not None:
        h.update(b"prompt_embeds:" + embeds)
    if parent is None and lora is not None:
        h.update(b"lora:" + lora)
    if parent is None and cache_salt is not None:
        h.update(b"cache_salt:" + cache_salt.encode())
    return h.digest()


class BlockPool:
    """One pool's blocks (one KV-cache group's, or those of the groups that share it): ref
    counts, the prefix cache's keys, and the LRU queue of free blocks (the front is reused
    first). NULL_BLOCK entries of a request's list (a window's skipped blocks) are neither
    taken nor released."""

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

    def uncache(self, block: int) -> None:
        """Forget `block`'s key: its contents will not be written after all."""
        key = self.block_hash[block]
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]
        self.block_hash[block] = None
        self.unfresh(block)

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

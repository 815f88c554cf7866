"""Paged KV-cache bookkeeping per KV-cache group: admission, growth, prefix-cache hits,
preemption and freeing, over block pools (`engine/block_pool.py`) that groups may share.

KV-cache groups (vLLM V1's hybrid KV cache manager, in our own shape): the layers of one
attention kind share a group, whose spec (jllm/kv_cache_interface.py) says what a request
holds there; a `SingleTypeManager` per group applies it (`engine/single_type_manager.py`). A
model of one attention kind is one group; a speculative draft model's layers are groups of
their own. A request's blocks are a tuple with one list per group, where list index =
logical block index (a per-request state group's list is its one slot); it is admitted,
grown, hit in the prefix cache, preempted and freed in every group at once: a step that
cannot get blocks in every group gets none.

Pools (vLLM's hybrid allocator): each group draws from a pool (`pools`, by group), and
groups whose cache arrays are identical share one (`kv_cache_interface.share_pools`), so the
blocks a sliding-window group frees serve full attention. Block ids are unique within a
pool, so two groups of one pool never hold the same block; the runner's array of a pool is
indexed by every group of it alike.

A full block is registered under its key as soon as it is allocated (its KV is written in
the same step that first reads it, and every layer writes before it attends), so even
requests scheduled in the same step share it. Not under pipeline stages
(`same_step_hits=False`): a step's micro-batches run its rows in the runner's order (one-token
rows first), not the scheduler's, so a row could read a block that a later micro-batch
writes; there a block is a hit only from the step after the one that computes it (a pool's
`fresh` blocks are the current step's), and a request admitted beside its block's writer
computes the block itself. Only known tokens count: the slots a step computes for draft
tokens are not a block's content until the drafts are accepted (and appended), so a rejected
draft never enters the cache. Freed blocks (a window's too) keep their key and stay in an
LRU free queue until the pool needs them back. Each group caches its own blocks under the
request's keys. A hit of n blocks (the next position n*S) needs what each group's spec says
(a full group all n, a sliding one those its window reads from there, a chunked one those
of the current chunk, per-request state the snapshot at n: StateManager); a hit is the
longest n every group accepts (vLLM's rule).

The host tier (`host`, engine/host_kv_tier.py) keeps evicted full-attention blocks; on a
hybrid of full attention and per-request state (Qwen3-Next) a second tier (`state_host`)
keeps evicted state snapshots, and a hit may then take its attention blocks from the device
and then the host, and the state at its end from either (`_hybrid_host_hit`).
Host-side only: no JAX import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from jllm.engine.block_pool import ROOT_KEY, BlockPool, block_key
from jllm.engine.host_kv_tier import HostKVTier
from jllm.engine.request import Request
from jllm.engine.single_type_manager import SingleTypeManager, StateManager
from jllm.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec


def _is_state(spec: KVCacheSpec) -> bool:
    return isinstance(spec, MambaSpec)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        enable_prefix_caching: bool,
        specs: Sequence[KVCacheSpec] | None = None,
        *,
        pools: Sequence[int] | None = None,
        host: HostKVTier | None = None,
        state_host: HostKVTier | None = None,
        same_step_hits: bool = True,
        drop_last_hit: bool = False,
    ) -> None:
        """`specs`: each group's spec (default: one full-attention group); `pools`: the pool
        each group draws from, numbered from 0 in order of first use (default: one each);
        `num_blocks`: each pool's size (an int: every pool's).
        `host`: the host-memory tier of a model's one full-attention group, or None;
        `state_host`: its tier of state snapshots, for a model whose other groups are
        per-request state (`host_tier_groups`).
        `same_step_hits`: whether a request may hit blocks that the step it is scheduled in
        computes, which needs every write of a step before its reads (False under pipeline
        stages; `begin_step` then starts each step). `drop_last_hit`: a hit gives up its
        last block (vLLM's block drop for drafts that read the target's hidden states: an
        MTP entry at a block's end depends on the next block's first token)."""
        specs = (FullAttentionSpec(num_kv_heads=1, head_size=1),) if specs is None else specs
        self.specs = tuple(specs)
        self.pool_of = tuple(range(len(self.specs)) if pools is None else pools)
        num_pools = max(self.pool_of, default=-1) + 1
        if np.ndim(num_blocks) == 0:
            num_blocks = [num_blocks] * num_pools
        num_blocks = [int(n) for n in num_blocks]
        first_use = list(dict.fromkeys(self.pool_of))
        if len(self.pool_of) != len(self.specs) or first_use != list(range(num_pools)):
            raise ValueError(
                f"{len(self.specs)} KV-cache groups need one pool each, numbered from 0 in "
                f"order of first use; got {list(self.pool_of)}."
            )
        if len(num_blocks) != num_pools:
            raise ValueError(
                f"{num_pools} KV-cache pools need {num_pools} block counts, got {num_blocks}."
            )
        if min(num_blocks) < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {min(num_blocks)}.")
        self.num_blocks = max(num_blocks)  # the largest pool (the runner's padding slot)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.drop_last_hit = drop_last_hit
        # A pool of per-request state takes its snapshots as hits from the step after
        # the one that caches them (StateManager): they are copied one step late.
        state = {p for spec, p in zip(self.specs, self.pool_of, strict=True) if _is_state(spec)}
        self.pools = [
            BlockPool(n, same_step_hits and p not in state) for p, n in enumerate(num_blocks)
        ]
        self.managers = [
            (StateManager if _is_state(spec) else SingleTypeManager)(
                spec,
                self.pools[p],
                block_size,
                tag=b"" if self.pool_of.count(p) == 1 else b"group:%d" % g,
            )
            for g, (spec, p) in enumerate(zip(self.specs, self.pool_of, strict=True))
        ]
        # The first block's parent key: ROOT_KEY, then a new one with every weight update
        # (`new_weights`), so no block computed with other weights is ever a hit; and the
        # requests that hold blocks computed with other weights (they cache no more).
        self.root = ROOT_KEY
        self.weight_updates = 0
        self.stale: set[str] = set()
        self.req_blocks: dict[str, tuple[list[int], ...]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.host, self.state_host = host, state_host
        self.host_hits: list[int] = []  # the last lookup's host blocks (get_computed_blocks)
        # The last lookup's state snapshot on the host: (request, host slot, key), loaded
        # into the request's live slot when it is admitted.
        self.host_state_hit: tuple[str, int, bytes] | None = None
        # The copies the next step makes, (pool, source, destination) each: stores of
        # evicted blocks (device block, host block), then loads of host hits (host block,
        # device block).
        self.kv_stores: list[tuple[int, int, int]] = []
        self.kv_loads: list[tuple[int, int, int]] = []
        self.attention_group, self.state_group = 0, None  # the groups the host tiers keep
        if host is not None:
            self.attention_group, self.state_group = host_tier_groups(self.specs)
            if not enable_prefix_caching:
                raise ValueError("The host KV tier (kv_offloading_size) needs prefix caching.")
            if (self.state_group is None) != (state_host is None):
                raise ValueError("A hybrid model's host tier keeps its state snapshots too.")
            self.pools[self.pool_of[self.attention_group]].on_evict = self._store
            if state_host is not None:
                self.pools[self.pool_of[self.state_group]].on_evict = self._store_state

    def _store(self, block: int, key: bytes) -> None:
        host_block = self.host.store(key)
        if host_block is not None:
            self.kv_stores.append((self.pool_of[self.attention_group], block, host_block))

    def _store_state(self, slot: int, key: bytes) -> None:
        host_slot = self.state_host.store(key)
        if host_slot is not None:
            self.kv_stores.append((self.pool_of[self.state_group], slot, host_slot))

    def take_copies(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The stores and loads gathered since the last call, for the step that runs next."""
        stores, loads = self.kv_stores, self.kv_loads
        self.kv_stores, self.kv_loads = [], []
        for tier in (self.host, self.state_host):
            if tier is not None:
                tier.step_scheduled()
        return stores, loads

    def take_state_copies(self) -> list[tuple[int, int, int]]:
        """The per-request state copies the step being handed on makes before its forward,
        in order: (group, source slot, destination slot) (StateManager.take_copies)."""
        return [
            (g, src, dst)
            for g, manager in enumerate(self.managers)
            if isinstance(manager, StateManager)
            for src, dst in manager.take_copies()
        ]

    def _state_managers(self, req: Request):
        blocks = self.req_blocks.get(req.request_id)
        for manager, held in zip(self.managers, blocks or (), strict=False):
            if isinstance(manager, StateManager) and manager.spec.backups and held:
                yield manager, held

    def save_state(self, req: Request) -> None:
        """`req` verifies drafts in the step being scheduled: its per-request state is kept
        as it is before the step (StateManager.save)."""
        for manager, held in self._state_managers(req):
            manager.save(held)

    def restore_state(self, req: Request) -> bool:
        """`req`'s last step rejected drafts: its per-request state goes back to before that
        step (StateManager.restore). False when it keeps no such state (nothing to do)."""
        kept = list(self._state_managers(req))
        for manager, held in kept:
            manager.restore(held)
        return bool(kept)

    def align(self, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, cut to end where a per-request state group
        snapshots (StateManager.align) when prefix caching is on."""
        if not self.enable_prefix_caching:
            return num_new
        for manager in self.managers:
            if isinstance(manager, StateManager):
                num_new = manager.align(start, num_new)
        return num_new

    def begin_step(self) -> None:
        """A new step is being scheduled: the blocks cached by the last one are written
        before it runs (steps run in order), so it may hit them."""
        for pool in self.pools:
            pool.begin_step()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the pool with the fewest: a step that needs no more than this in
        any group fits (`group_num_free` has each group's pool's)."""
        return min(pool.num_free for pool in self.pools)

    @property
    def group_num_free(self) -> tuple[int, ...]:
        """Each group's pool's free blocks (groups of one pool show the same count)."""
        return tuple(m.pool.num_free for m in self.managers)

    @property
    def group_num_blocks(self) -> tuple[int, ...]:
        """Each group's pool's size."""
        return tuple(m.pool.num_blocks for m in self.managers)

    @property
    def all_blocks_free(self) -> bool:
        """No request holds a block in any pool (with unequal pools `num_free_blocks` cannot
        tell: it is the smallest pool's count)."""
        return all(pool.num_free == pool.num_blocks - 1 for pool in self.pools)

    @property
    def usage(self) -> float:
        """The fullest pool's share of its blocks in use: the pool that runs out first."""
        return max(pool.usage for pool in self.pools)

    def shortfall(self, num_tokens: int, max_step_tokens: int) -> str | None:
        """Why a request of `num_tokens` slots can never run, even alone (its groups need
        more blocks of a pool than the pool has), or None when it fits. Start-up sizes the
        pools so that a max_model_len request fits; num_gpu_blocks_override skips that."""
        need = [0] * len(self.pools)
        for manager, p in zip(self.managers, self.pool_of, strict=True):
            need[p] += manager.spec.max_blocks_per_request(
                num_tokens, self.block_size, max_step_tokens
            )
        short = [
            f"{n} blocks of pool {p} ({pool.num_blocks - 1} usable)"
            for p, (n, pool) in enumerate(zip(need, self.pools, strict=True))
            if n > pool.num_blocks - 1
        ]
        if not short:
            return None
        return f"a request of {num_tokens} tokens needs {', '.join(short)}"

    def no_blocks(self) -> tuple[list[int], ...]:
        return tuple([] for _ in self.specs)

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
            embeds = req.embeds_digest(i * size, (i + 1) * size)
            req.block_hashes.append(
                block_key(parent, block, req.cache_salt, req.lora_digest, images, self.root, embeds)
            )

    def get_computed_blocks(self, req: Request) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix of `req` that every group accepts as a hit, in whole blocks
        and leaving one token to compute: (each group's blocks, NULL_BLOCK where no later
        step reads, and the tokens they hold). A request asking for prompt logprobs reads
        none (vLLM's rule: they are computed for the whole prompt); its blocks are still
        cached for others. With the host tier, `host_hits` has the host blocks of the keys
        that follow the device's hits (their tokens are not counted here)."""
        self.host_hits, self.host_state_hit = [], None
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return self.no_blocks(), 0
        self._update_hashes(req, req.num_tokens - 1)
        keys = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        n = self._hit_length(keys, len(keys))
        if self.drop_last_hit and n:
            n = self._hit_length(keys, n - 1)
        hits = tuple(manager.hit_blocks(keys, n) for manager in self.managers)
        if self.state_host is not None:
            hits, n = self._hybrid_host_hit(req, keys, hits, n)
        elif self.host is not None:
            self.host_hits = self.host.lookup(keys[n:])
        return hits, n * self.block_size

    def cached_prefix_tokens(self, req: Request) -> int:
        """The tokens of `req`'s prompt this cache holds as a prefix hit on the device, found
        without touching anything (a data-parallel engine asks every shard before it picks
        one; engine/data_parallel.py). Computes the request's block keys once."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return 0
        self._update_hashes(req, req.num_tokens - 1)
        keys = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        return self._hit_length(keys, len(keys)) * self.block_size

    def _hybrid_host_hit(self, req: Request, keys: list[bytes], hits, n: int):
        """A hybrid's hit through the host tiers, when longer than the device's `n` blocks:
        its attention blocks from the device, then the host (`host_hits`), and the state
        snapshot at its end from the device or the host (`host_state_hit`). Returns (each
        group's device hits, the device's share of the attention blocks)."""
        attention = self.managers[self.attention_group]
        state = self.managers[self.state_group]
        on_device = attention.hit_length(keys, len(keys))
        from_host = self.host.lookup(keys[on_device:])
        top = on_device + len(from_host)
        for m in range(top // state.stride * state.stride, n, -state.stride):
            device_state = state.hit_length(keys, m) == m
            key = keys[m - 1] + state.tag
            host_state = [] if device_state else self.state_host.lookup([key])
            if not (device_state or host_state):
                continue
            first = min(m, on_device)
            hits = list(hits)
            hits[self.attention_group] = attention.hit_blocks(keys, first)
            hits[self.state_group] = state.hit_blocks(keys, m) if device_state else []
            self.host_hits = from_host[: m - first]
            if host_state:
                self.host_state_hit = (req.request_id, host_state[0], key)
            return tuple(hits), first
        return hits, n

    def _hit_length(self, keys: list[bytes], n: int) -> int:
        """The longest hit of at most `n` blocks every group accepts: a fixed point, as
        vLLM's hybrid coordinator (each group may cut n)."""
        while True:
            m = min(manager.hit_length(keys, n) for manager in self.managers)
            if m == n:
                return n
            n = m

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
        fresh blocks before the step); None if any pool is short, having changed nothing
        but released the blocks no later step reads (out of a window or chunk)."""
        blocks = self.req_blocks.get(req.request_id)
        if blocks is None:
            blocks = self.req_blocks[req.request_id] = self.no_blocks()
        hits = new_computed_blocks or self.no_blocks()
        # blocks of context the hits hold (a state group's one snapshot says nothing)
        paged = [h for h, spec in zip(hits, self.specs, strict=True) if not _is_state(spec)]
        num_hit = max(map(len, paged), default=0)
        num_loaded = len(host_hits)
        start = req.num_computed_tokens + (num_hit + num_loaded) * self.block_size
        total = start + num_new_tokens
        groups = list(zip(self.managers, blocks, hits, strict=True))
        for manager, held, _ in groups:
            manager.free_skipped(held, start)
        grow = [manager.num_fresh(held, hit, total + lookahead) for manager, held, hit in groups]
        if num_hit or num_loaded or any(grow):
            taken = [0] * len(self.pools)  # per pool: fresh blocks and free blocks hit
            for g, (manager, _, hit) in enumerate(groups):
                taken[self.pool_of[g]] += grow[g] + manager.pool.num_reused_free(hit)
            if any(n > pool.num_free for n, pool in zip(taken, self.pools, strict=True)):
                if not any(blocks):  # a waiting request holds nothing: no entry either
                    del self.req_blocks[req.request_id]
                return None
            # Every group's hits first: a fresh block of one group must not evict a free
            # block that another group of its pool is about to take as a hit.
            for manager, _, hit in groups:
                manager.pool.take(hit)
            for g, ((manager, held, hit), n) in enumerate(zip(groups, grow, strict=True)):
                fresh = manager.pool.allocate(n)
                if num_loaded and g == self.attention_group:  # the host hits' contents
                    pool = self.pool_of[g]
                    loaded = zip(host_hits, fresh[:num_loaded], strict=True)
                    self.kv_loads.extend((pool, h, d) for h, d in loaded)
                    first = len(held) + len(hit)
                    self._update_hashes(req, (first + num_loaded) * self.block_size)
                    self.host.touch(req.block_hashes[first : first + num_loaded])
                    self.host.loads += num_loaded
                manager.extend(held, hit, fresh)
                if g == self.state_group and fresh:
                    self._load_state(req, fresh[0])
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens), total)
        return blocks

    def _load_state(self, req: Request, live: int) -> None:
        """`req` was admitted on a state snapshot from the host: load it into its live
        slot before the step."""
        if self.host_state_hit is None or self.host_state_hit[0] != req.request_id:
            return
        _, host_slot, key = self.host_state_hit
        self.host_state_hit = None
        self.kv_loads.append((self.pool_of[self.state_group], host_slot, live))
        self.state_host.touch([key])
        self.state_host.loads += 1

    def new_weights(self, requests) -> None:
        """The model's weights changed: from now on keys chain from a new root, so the
        blocks cached so far are never hit again (they age out as free blocks do). Of
        `requests` (every live one), those holding blocks go on with them but cache no
        more; the others forget their keys."""
        self.weight_updates += 1
        self.root = hashlib.sha256(ROOT_KEY + b"weights:%d" % self.weight_updates).digest()
        for req in requests:
            if any(self.req_blocks.get(req.request_id, ())):
                self.stale.add(req.request_id)
            else:  # its keys chain from the old root: a hit on them reads old weights' KV
                req.block_hashes.clear()

    def _cache_full_blocks(self, req: Request, blocks, num_tokens: int, step_end: int) -> None:
        if req.request_id in self.stale:
            return
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self._update_hashes(req, num_tokens)
        for manager, held in zip(self.managers, blocks, strict=True):
            manager.cache_blocks(held, req.block_hashes, start, end, step_end)
        self.num_cached_blocks[req.request_id] = end

    def forget_uncomputed(self, req: Request, num_computed: int) -> None:
        """Drop the prefix-cache keys of `req`'s blocks past its first `num_computed`
        tokens: blocks registered when a step was scheduled that will not run them (the
        request is taken back out of the step), whose contents were never written."""
        blocks = self.req_blocks.get(req.request_id, self.no_blocks())
        first = num_computed // self.block_size
        for manager, held in zip(self.managers, blocks, strict=True):
            manager.forget(held, req.block_hashes, first)
        if req.request_id in self.num_cached_blocks:
            self.num_cached_blocks[req.request_id] = min(
                first, self.num_cached_blocks[req.request_id]
            )

    def free(self, req: Request) -> None:
        """Release `req`'s blocks in every group (a per-request state group's slot too);
        tail blocks go first in the eviction order."""
        blocks = self.req_blocks.pop(req.request_id, self.no_blocks())
        self.num_cached_blocks.pop(req.request_id, None)
        if req.request_id in self.stale:  # recomputed, if ever, under the new root
            self.stale.discard(req.request_id)
            req.block_hashes.clear()
        for manager, held in zip(self.managers, blocks, strict=True):
            if isinstance(manager, StateManager):
                manager.drop(held)
            manager.pool.release(held)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (the host tier's too); refused (False) while any
        request holds blocks. Snapshots of linear-attention state not copied yet (the last
        step's, copied before the next step's forward) are dropped with their keys."""
        if any(any(blocks) for blocks in self.req_blocks.values()):
            return False
        for manager in self.managers:
            if isinstance(manager, StateManager):
                manager.discard_pending()
        if not self.all_blocks_free:
            return False
        for pool in self.pools:
            pool.reset()
        for tier in (self.host, self.state_host):
            if tier is not None:
                tier.reset()
        self.kv_stores.clear()  # stores not sent yet: their keys are forgotten too
        return True


def host_tier_groups(specs) -> tuple[int, int | None]:
    """The groups the host tier keeps: (the one full-attention group, the per-request state
    group with snapshots, or None); ValueError naming the model's kinds when it has others."""
    attention = [g for g, s in enumerate(specs) if isinstance(s, FullAttentionSpec)]
    state = [g for g, s in enumerate(specs) if _is_state(s) and s.prefix_cacheable]
    if len(attention) != 1 or len(state) > 1 or len(attention) + len(state) != len(specs):
        raise ValueError(
            "The host KV tier (kv_offloading_size) needs one KV-cache group of full "
            "attention, and at most one of per-request state with snapshots beside it; this "
            f"model has {', '.join(s.describe() for s in specs)}."
        )
    return attention[0], (state[0] if state else None)

"""The KV manager over every spec kind and over shared pools, in pure Python: chunked local
attention frees what lies before the current chunk and hits need only that chunk, MLA holds
and hits as full attention, per-request state takes one slot from admission to finish or
preemption and no hit, and groups of one pool take their blocks from it without ever
holding one block together."""

from __future__ import annotations

import dataclasses

import pytest
from kv_specs import MLA, STATE, attention, chunked, groups

from jllm.engine.block_pool import NULL_BLOCK
from jllm.engine.host_kv_tier import HostKVTier
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request
from jllm.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_id=None, seed=0)


def run(kv: KVCacheManager, r: Request, num_steps: int, chunk: int = 1) -> None:
    """`r` as the scheduler runs it: chunks of its unknown tokens, a sampled token after
    each step that reaches the end."""
    for _ in range(num_steps):
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(r.num_tokens)


# ---- chunked local attention ----------------------------------------------------------------
def test_chunked_group_frees_the_blocks_before_the_current_chunk():
    """C=8, S=4: a step from position c reads from c - c % 8 on, so a request holds the
    current chunk's blocks (at most 2, chunks being block-aligned), the earlier ones NULL."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=False, specs=[chunked(8)])
    r = req("a", list(range(5)))
    for _ in range(60):
        c = r.num_computed_tokens  # the step's first position
        run(kv, r, 1)
        (held,) = kv.block_ids("a")
        first = (c - c % 8) // 4
        assert held[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in held[first:]
        live = sum(b != NULL_BLOCK for b in held)
        assert live <= chunked(8).max_blocks_per_request(10_000, 4, 1) == 2
    assert r.num_tokens == 61 and kv.num_free_blocks == 15 - live
    kv.free(r)
    assert kv.all_blocks_free


def test_chunked_hit_needs_only_the_current_chunk():
    """C=8, S=4, 21 tokens: a hit of 5 blocks goes on from position 20, whose chunk starts at
    16 (block 4): only block 4 is needed; a hit of 4 blocks goes on from 16, a chunk's start,
    and needs nothing cached."""
    kv = KVCacheManager(32, 4, enable_prefix_caching=True, specs=[attention(), chunked(8)])
    tokens = list(range(21))
    a = req("a", tokens)
    full, local = kv.allocate_slots(a, 21)
    hits, n = kv.get_computed_blocks(req("b", tokens))
    assert n == 20 and hits == (full[:5], [0, 0, 0, 0, local[4]])
    pool = kv.pools[1]
    for b in local[:4]:  # the chunked group forgets blocks 0-3: no hit is shorter for it
        del pool.cached[pool.block_hash[b]]
        pool.block_hash[b] = None
    assert kv.get_computed_blocks(req("b", tokens))[1] == 20
    del pool.cached[pool.block_hash[local[4]]]  # and block 4: a hit of 4 blocks needs none
    pool.block_hash[local[4]] = None
    assert kv.get_computed_blocks(req("b", tokens)) == ((full[:4], [0, 0, 0, 0]), 16)
    b = req("b", tokens)
    hits, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 5, hits) is not None
    assert kv.block_ids("b")[1][:4] == [0, 0, 0, 0] and 0 not in kv.block_ids("b")[1][4:]


# ---- MLA --------------------------------------------------------------------------------------
def test_mla_group_holds_and_hits_as_full_attention():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, specs=[MLA])
    a = req("a", list(range(13)))
    (blocks,) = kv.allocate_slots(a, 13)
    assert len(blocks) == 4 and NULL_BLOCK not in blocks
    run(kv, a, 0)
    hits, n = kv.get_computed_blocks(req("b", list(range(13))))
    assert n == 12 and hits == (blocks[:3],)


# ---- per-request state ------------------------------------------------------------------------
def test_state_takes_one_slot_from_admission_to_finish_or_preemption():
    """Beside a full-attention group: one state slot per request whatever its length, taken
    at admission, returned when it finishes or is preempted; a request the state pool cannot
    seat gets nothing in the other group either."""
    kv = KVCacheManager([32, 3], 4, enable_prefix_caching=True, specs=[attention(), STATE])
    a, b = req("a", list(range(10))), req("b", list(range(50, 55)))
    full, state = kv.allocate_slots(a, 10)
    assert len(full) == 3 and len(state) == 1 and state[0] != NULL_BLOCK
    a.num_computed_tokens = 10
    run(kv, a, 30)
    assert len(kv.block_ids("a")[0]) == 10 and kv.block_ids("a")[1] == state
    assert kv.allocate_slots(b, 5)[1] not in (state, [])
    assert kv.group_num_free == (31 - 10 - 2, 0)
    c = req("c", list(range(100, 104)))
    assert kv.allocate_slots(c, 4) is None and kv.block_ids("c") == ([], [])
    assert kv.group_num_free == (31 - 10 - 2, 0)
    kv.free(b)  # preempted: its slot goes back, and c is seated
    assert kv.allocate_slots(c, 4) is not None
    kv.free(a)
    kv.free(c)
    assert kv.all_blocks_free


def test_state_takes_no_prefix_hit():
    """No state snapshots (cache_interval 0, mamba_cache_mode="none"): a group of
    per-request state accepts only the empty hit, so a model with one computes every
    prompt, though its attention blocks are cached."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, specs=[attention(), STATE])
    kv.allocate_slots(req("a", list(range(13))), 13)
    assert kv.get_computed_blocks(req("b", list(range(13)))) == (([], []), 0)
    alone = KVCacheManager(16, 4, enable_prefix_caching=True, specs=[attention()])
    alone.allocate_slots(req("a", list(range(13))), 13)
    assert alone.get_computed_blocks(req("b", list(range(13))))[1] == 12


def test_state_snapshots_are_hits_from_the_next_step_and_copy_in_order():
    """cache_interval 8 (S=4: every 2 blocks): a step ending at 8 tokens snapshots the live
    slot into a slot cached under block 1's key. The copy is made before the next step's
    forward, so the snapshot is a hit from that step on, and that step's copies put the
    snapshot first and the hit's load after it; each slot is held until its copy is handed
    on, then the snapshot stays cached as a free slot. Hits land only on snapshots."""
    snap = dataclasses.replace(STATE, cache_interval=8)
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, specs=[attention(), snap])
    state = kv.pools[1]
    a = req("a", list(range(13)))
    live_a = kv.allocate_slots(a, 8)[1][0]
    b = req("b", list(range(13)))
    assert kv.get_computed_blocks(b)[1] == 0  # written by the step after this one
    assert kv.take_state_copies() == []  # this step computes it: nothing to copy yet
    kv.begin_step()
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits[1]) == 1
    (snapshot,) = hits[1]
    assert state.ref_cnt[snapshot] == 1  # held until its copy is handed on
    kv.allocate_slots(b, 5, hits)
    (live_b,) = kv.block_ids("b")[1]
    assert kv.take_state_copies() == [(1, live_a, snapshot), (1, snapshot, live_b)]
    assert state.ref_cnt[snapshot] == 0 and snapshot in state.cached.values()
    c = req("c", list(range(7)) + [99] * 6)  # shares block 0 only: before any snapshot
    assert kv.get_computed_blocks(c)[1] == 0


def test_state_backups_save_restore_and_drop():
    """With speculative decoding a request holds [live, backup]: a row verifying drafts
    saves live into backup; a step that rejected drafts restores backup into live (and a
    save in the same step is then left out: the backup already holds that state); a
    request that gives its slots back drops its copies not handed on yet."""
    spec = dataclasses.replace(STATE, backups=True)
    kv = KVCacheManager(16, 4, enable_prefix_caching=False, specs=[attention(), spec])
    a = req("a", list(range(5)))
    live, backup = kv.allocate_slots(a, 5)[1]
    kv.save_state(a)
    assert kv.take_state_copies() == [(1, live, backup)]
    assert kv.restore_state(a)
    kv.save_state(a)
    assert kv.take_state_copies() == [(1, backup, live)]
    kv.save_state(a)
    kv.free(a)
    assert kv.take_state_copies() == []
    plain = KVCacheManager(16, 4, enable_prefix_caching=False, specs=[attention(), STATE])
    plain.allocate_slots(a, 5)
    assert not plain.restore_state(a)  # nothing kept: the caller changes nothing


def test_state_snapshot_align_cuts_chunks_at_the_interval():
    snap = dataclasses.replace(STATE, cache_interval=8)
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, specs=[attention(), snap])
    assert [kv.align(0, 13), kv.align(8, 5), kv.align(3, 4), kv.align(5, 20)] == [8, 5, 4, 19]
    off = KVCacheManager(16, 4, enable_prefix_caching=False, specs=[attention(), snap])
    assert off.align(0, 13) == 13


# ---- shared pools -----------------------------------------------------------------------------
def test_blocks_a_window_frees_serve_full_attention_in_a_shared_pool():
    """W=8, S=4, one pool of 19 usable blocks for a full and a sliding group: a request of
    64 tokens needs 16 full blocks and at most 3 sliding ones, and runs to its end only
    because the sliding group's freed blocks go back to the pool the full group grows from
    (separately, the same memory would give each group 9 blocks)."""
    kv = KVCacheManager(20, 4, enable_prefix_caching=True, specs=groups(None, 8), pools=[0, 0])
    assert kv.group_num_blocks == (20, 20) and len(kv.pools) == 1
    r = req("a", [7, 7, 7])
    seen_sliding, seen_full = set(), set()
    while r.num_tokens < 64:
        run(kv, r, 1)
        full, sliding = kv.block_ids("a")
        assert not (set(full) & set(sliding)) - {NULL_BLOCK}  # never one block in both
        seen_sliding |= set(sliding) - {NULL_BLOCK}
        seen_full |= set(full)
    assert len(full) == 16 and sum(b != NULL_BLOCK for b in sliding) <= 3
    assert seen_sliding & seen_full  # a block the window let go now holds full attention
    assert len(seen_sliding | seen_full) > 19 - 3
    kv.free(r)
    assert kv.all_blocks_free and kv.group_num_free == (19, 19)
    # The same 20 blocks as two pools of 10: the full group runs out at 9 blocks.
    apart = KVCacheManager(10, 4, enable_prefix_caching=True, specs=groups(None, 8))
    r = req("a", [7, 7, 7])
    while apart.allocate_slots(r, 1) is not None:
        run(apart, r, 1)
    assert r.num_computed_tokens == 36 and len(apart.block_ids("a")[0]) == 9


def test_groups_of_one_pool_cache_under_their_own_keys():
    """Two full-attention groups in one pool (a model's layers of two kinds with equal
    arrays): the same tokens give each group its own blocks, a hit returns each group's own,
    and freeing returns every block."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, specs=groups(None, None), pools=[0, 0])
    a_blocks = kv.allocate_slots(req("a", list(range(9))), 9)
    assert not set(a_blocks[0]) & set(a_blocks[1]) and kv.num_free_blocks == 15 - 6
    hits, n = kv.get_computed_blocks(req("b", list(range(9))))
    assert n == 8 and hits == (a_blocks[0][:2], a_blocks[1][:2])
    b_blocks = kv.allocate_slots(req("b", list(range(9))), 1, hits)
    assert kv.num_free_blocks == 15 - 6 - 2
    assert kv.pools[0].ref_cnt[a_blocks[1][0]] == 2 and b_blocks[1][:2] == a_blocks[1][:2]


def test_hits_are_taken_before_fresh_blocks_evict_them():
    """In a shared pool a fresh block of one group must not be a free cached block another
    group is taking as a hit in the same call. Here the second group's hits are the first
    free blocks (the LRU order after other requests): the first group's fresh block must
    come from behind them."""
    kv = KVCacheManager(7, 4, enable_prefix_caching=True, specs=groups(None, None), pools=[0, 0])
    a = req("a", list(range(8)))
    first, second = kv.allocate_slots(a, 8)  # 2 full blocks each, both cached
    kv.free(a)
    for block in reversed(second):  # the second group's blocks next to be reused
        kv.pools[0].free_queue.move_to_end(block, last=False)
    b = req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == (first, second)
    b_first, b_second = kv.allocate_slots(b, 1, hits)
    assert b_first[:2] == first and b_second[:2] == second
    assert not set(b_first) & set(b_second) and kv.num_free_blocks == 0


def test_a_hybrid_hit_comes_back_from_both_host_tiers():
    """Full attention beside state snapshots every 2 blocks (S=4): a request's two blocks
    and its snapshot at block 2, evicted from their small pools by another request, are
    stored in the host tiers ((pool, device, host) copies); the next request with that
    prefix hits them there: its attention blocks and its state load from host memory into
    fresh blocks and its live slot, and the hit counts all 8 tokens."""
    snap = dataclasses.replace(STATE, cache_interval=8)
    attn_tier, state_tier = HostKVTier(8), HostKVTier(4)
    kv = KVCacheManager(
        [5, 3], 4, True, specs=[attention(), snap], host=attn_tier, state_host=state_tier
    )
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 8) is not None  # caches blocks 0, 1 and snapshots at 2
    kv.take_state_copies()
    kv.begin_step()
    assert kv.take_state_copies()[0][0] == 1  # the snapshot's copy, handed on
    a_blocks, (a_snapshot,) = kv.block_ids("a")[0][:2], [kv.pools[1].cached[a.block_hashes[1]]]
    kv.free(a)
    x = req("x", list(range(100, 117)))  # 4 attention blocks, its live slot and snapshot
    assert kv.allocate_slots(x, 16) is not None
    stores, loads = kv.take_copies()
    assert sorted((p, d) for p, d, _ in stores) == [
        (0, a_blocks[0]),
        (0, a_blocks[1]),
        (1, a_snapshot),
    ]
    assert not loads
    kv.take_state_copies()
    kv.free(x)
    kv.begin_step()
    kv.take_state_copies()  # x's snapshot copied: its slots free
    kv.begin_step()
    b = req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert hits == ([], []) and n == 0 and len(kv.host_hits) == 2
    assert kv.allocate_slots(b, 1, hits, host_hits=kv.host_hits) is not None
    _, loads = kv.take_copies()
    b_attn, (b_live,) = kv.block_ids("b")
    assert sorted(loads) == sorted(
        [(0, h, d) for h, d in zip(kv.host_hits, b_attn[:2], strict=True)]
        + [(1, loads[-1][1], b_live)]
    )
    assert attn_tier.loads == 2 and state_tier.loads == 1


def hybrid_tiered(attention_blocks: int, state_slots: int) -> KVCacheManager:
    snap = dataclasses.replace(STATE, cache_interval=8)
    specs = [attention(), snap]
    return KVCacheManager(
        [attention_blocks, state_slots],
        4,
        True,
        specs,
        host=HostKVTier(8),
        state_host=HostKVTier(4),
    )


def step(kv: KVCacheManager):
    """The copies of the step scheduled so far, handed on; the next step begins."""
    copies = kv.take_copies(), kv.take_state_copies()
    kv.begin_step()
    return copies


def test_a_device_snapshot_beside_host_blocks_counts_no_block():
    """The snapshot still on the device, the prefix's attention blocks all in host memory:
    the hit's blocks are the host's two, and the request computes from token 8, holding
    the blocks of its 9 tokens (3), not one more."""
    kv = hybrid_tiered(5, 6)
    a = req("a", list(range(9)))
    kv.allocate_slots(a, 8)
    step(kv), step(kv)
    kv.free(a)
    x = req("x", list(range(100, 117)))
    kv.allocate_slots(x, 15)  # 4 attention blocks (a's evicted), no snapshot of its own
    step(kv)
    kv.free(x)
    b = req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 0 and len(hits[1]) == 1 and len(kv.host_hits) == 2  # the device snapshot
    blocks = kv.allocate_slots(b, 1, hits, host_hits=kv.host_hits)
    assert len(blocks[0]) == 3


def test_the_host_tier_and_pool_numbers_are_checked():
    with pytest.raises(ValueError, match="one KV-cache group of full attention"):
        KVCacheManager(8, 4, True, [MLA], host=HostKVTier(4))
    with pytest.raises(ValueError, match="one KV-cache group of full attention"):
        KVCacheManager(8, 4, True, groups(None, None), pools=[0, 0], host=HostKVTier(4))
    snap = dataclasses.replace(STATE, cache_interval=8)
    with pytest.raises(ValueError, match="state snapshots too"):
        KVCacheManager(8, 4, True, [attention(), snap], host=HostKVTier(4))
    with pytest.raises(ValueError, match="one KV-cache group of full attention"):
        KVCacheManager(8, 4, True, [attention(), STATE], host=HostKVTier(4))
    with pytest.raises(ValueError, match="need one pool each"):
        KVCacheManager(8, 4, True, groups(None, None), pools=[0])
    with pytest.raises(ValueError, match="numbered from 0"):
        KVCacheManager(8, 4, True, groups(None, None), pools=[0, 2])

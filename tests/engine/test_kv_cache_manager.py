"""Block pool, ref counts, prefix-cache keys (sha256, cache_salt), LRU eviction and
sliding-window groups, in pure Python."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from kv_specs import attention, groups

from jllm.engine.block_pool import NULL_BLOCK, ROOT_KEY
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request
from jllm.sampling_params import SamplingParams
from jllm.utils import cdiv


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), eos_token_id=None, seed=0)


def test_allocate_and_free_counts_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = req("a", list(range(10)))
    (blocks,) = kv.allocate_slots(r, 10)  # one KV-cache group
    assert len(blocks) == 3 and 0 not in blocks  # block 0 is the null block
    assert kv.num_free_blocks == 6
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == ([*blocks],)  # 12 slots fit in 3 blocks
    assert len(kv.allocate_slots(r, 3)[0]) == 4
    assert kv.allocate_slots(req("b", [1] * 40), 40) is None  # 10 blocks > 5 free
    kv.free(r)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(12)))
    (a_blocks,) = kv.allocate_slots(a, 12)
    b = req("b", list(range(12)))
    hit, n = kv.get_computed_blocks(b)
    # All 3 blocks are cached but one token must be computed: only 2 blocks are hits.
    assert n == 8 and hit == (a_blocks[:2],)
    (b_blocks,) = kv.allocate_slots(b, 4, hit)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    pool = kv.pools[0]
    assert pool.ref_cnt[a_blocks[0]] == 2
    c = req("c", list(range(8)) + [99, 98, 97, 96, 95])
    hit, n = kv.get_computed_blocks(c)
    assert n == 8  # diverges in the third block
    kv.free(a)
    kv.free(b)
    assert pool.ref_cnt[a_blocks[0]] == 0
    # Freed blocks stay cached until reused.
    d = req("d", list(range(12)))
    assert kv.get_computed_blocks(d)[1] == 8


def test_chained_hash_depends_on_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    kv.allocate_slots(req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]), 9)
    # Same second block, different first block: no hit at all.
    assert kv.get_computed_blocks(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]))[1] == 0


def test_lru_eviction_reuses_oldest_free_blocks_first():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    a, b = req("a", [1, 2, 3]), req("b", [7, 8, 9])
    kv.allocate_slots(a, 3)
    kv.allocate_slots(b, 3)
    kv.free(a)
    kv.free(b)
    # Pool: 4 usable blocks, all free; the full blocks [1,2] and [7,8] are cached.
    c = req("c", [5, 5, 5, 5, 5, 5])
    kv.allocate_slots(c, 6)  # needs 3: the two uncached tails first, then a's cached block
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[1] == 0
    assert kv.get_computed_blocks(req("y", [7, 8, 0]))[1] == 2


def test_penalty_requests_take_prefix_hits():
    """Penalty state is written at admission (runner/penalty_state.py), so a request with
    penalties takes prefix-cache hits like any other."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    kv.allocate_slots(req("a", list(range(9))), 9)
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 8
    assert kv.get_computed_blocks(req("c", list(range(9)), repetition_penalty=1.2))[1] == 8


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=1, block_size=4, enable_prefix_caching=True)


def sha256_chain(root: bytes, tokens: list[int], block_size: int, salt: str | None) -> list:
    """The key scheme written out independently: sha256(parent || int64 tokens [|| salt])."""
    keys, parent = [], root
    for i in range(len(tokens) // block_size):
        data = parent + b"".join(
            t.to_bytes(8, "little", signed=True)
            for t in tokens[i * block_size : (i + 1) * block_size]
        )
        if i == 0 and salt is not None:
            data += b"cache_salt:" + salt.encode()
        parent = hashlib.sha256(data).digest()
        keys.append(parent)
    return keys


def test_block_keys_are_a_sha256_chain_from_the_process_root():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = [5, 70000, 2**31 + 3, 9, 1, 2, 3, 4, 8]
    for salt in (None, "tenant-a"):
        r = Request("a", tokens, SamplingParams(), None, seed=0, cache_salt=salt)
        kv.allocate_slots(r, len(tokens))
        assert r.block_hashes == sha256_chain(ROOT_KEY, tokens, 4, salt)
        kv.free(r)


def test_salted_requests_share_blocks_only_with_their_salt():
    """The same tokens collide under a key of tokens alone (the old scheme): with salts,
    different tenants never share a block, and one tenant still gets its hits."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    tokens = list(range(13))

    def salted(rid, salt):
        return Request(rid, tokens, SamplingParams(), None, seed=0, cache_salt=salt)

    a = salted("a", "alice")
    (a_blocks,) = kv.allocate_slots(a, 13)
    assert kv.get_computed_blocks(salted("b", "bob")) == (([],), 0)
    assert kv.get_computed_blocks(req("c", tokens)) == (([],), 0)  # no salt: its own tenant
    assert kv.get_computed_blocks(salted("a2", "alice")) == ((a_blocks[:3],), 12)
    # Later blocks chain from the salted first block: no hit past it either.
    b = salted("b", "bob")
    (b_blocks,) = kv.allocate_slots(b, 13)
    assert not set(a_blocks) & set(b_blocks)


def test_root_key_is_random_per_process_unless_pythonhashseed():
    code = "from jllm.engine.kv_cache_manager import block_key; print(block_key(None, [1]).hex())"

    def key(env):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | env
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert key({}) != key({})  # keys cannot be computed offline by another party
    assert key({"PYTHONHASHSEED": "7"}) == key({"PYTHONHASHSEED": "7"})


def test_groups_grow_hit_and_free_together():
    """Two KV-cache groups (a model's and a draft model's): each takes its own blocks from
    its own pool for the same tokens, a prefix hit is what every group holds, and a request
    that does not fit one group gets blocks in none."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, specs=groups(None, None))
    a = req("a", list(range(9)))
    target, draft = kv.allocate_slots(a, 9)
    assert len(target) == len(draft) == 3 and kv.block_ids("a") == (target, draft)
    assert [p.num_free for p in kv.pools] == [4, 4]
    kv.free(a)
    assert [p.num_free for p in kv.pools] == [7, 7]
    # The draft's group forgets a's first block (as an eviction there would): no group
    # hits past it, although the target's group still holds both full blocks.
    pool = kv.pools[1]
    del pool.cached[pool.block_hash[draft[0]]]
    pool.block_hash[draft[0]] = None
    assert kv.get_computed_blocks(req("b", list(range(9)))) == (([], []), 0)
    # A request that one group cannot hold takes nothing from either.
    pool.allocate(5)  # the draft's group keeps 2 free blocks
    assert kv.allocate_slots(req("d", list(range(12))), 12) is None
    assert [p.num_free for p in kv.pools] == [7, 2] and kv.block_ids("d") == ([], [])


def test_groups_share_a_prefix_both_hold():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, specs=groups(None, None))
    a_blocks = kv.allocate_slots(req("a", list(range(12))), 12)
    hits, n = kv.get_computed_blocks(req("b", list(range(12))))
    assert n == 8 and hits == tuple(blocks[:2] for blocks in a_blocks)
    b_blocks = kv.allocate_slots(req("b", list(range(12))), 4, hits)
    for g in range(2):
        assert b_blocks[g][:2] == a_blocks[g][:2] and b_blocks[g][2] != a_blocks[g][2]
        assert kv.pools[g].ref_cnt[a_blocks[g][0]] == 2
    assert not kv.reset_prefix_cache()  # requests hold blocks


# ---- sliding-window groups -----------------------------------------------------------------
def check_window(kv: KVCacheManager, r: Request, num_new: int, max_step: int) -> None:
    """What a step computing `num_new` tokens of `r` from its computed position c reads is
    live in every group (a window's: keys from c-W+1 on); a window's earlier entries are
    NULL_BLOCK, and a group holds no more real blocks than `max_blocks_per_request`."""
    c, size = r.num_computed_tokens, kv.block_size
    for held, spec in zip(kv.block_ids(r.request_id), kv.specs, strict=True):
        first = spec.num_skipped_tokens(c) // size
        assert len(held) >= cdiv(c + num_new, size)
        assert all(b == NULL_BLOCK for b in held[:first])
        assert NULL_BLOCK not in held[first:]
        bound = spec.max_blocks_per_request(r.num_tokens + max_step, size, max_step)
        assert len(held) - first <= bound


def grow(kv: KVCacheManager, r: Request, num_steps: int, chunk: int = 1) -> list[int]:
    """Run `r` as the scheduler would: its unknown tokens in chunks of `chunk`, a sampled
    token (its position's number) after each step that reaches the end. Returns each step's
    real block count of the last group."""
    held = []
    for _ in range(num_steps):
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        check_window(kv, r, n, chunk)
        held.append(sum(b != NULL_BLOCK for b in kv.block_ids(r.request_id)[-1]))
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(r.num_tokens)
    return held


def evict(kv: KVCacheManager, group: int, key: bytes) -> None:
    """Drop one block from a group's prefix cache, as a reuse of the block there would."""
    pool = kv.pools[group]
    pool.block_hash[pool.cached.pop(key)] = None


def test_max_blocks_per_request_is_the_widest_span():
    """The bound against every step position c and size n: the blocks c-W+1 .. c+n-1 touch."""
    for size, window, max_step in [(4, 1, 1), (4, 5, 1), (4, 8, 3), (16, 20, 7), (4, 20, 4)]:
        widest = max(
            cdiv(c + n, size) - max(0, c - window + 1) // size
            for c in range(200)
            for n in range(1, max_step + 1)
        )
        assert attention(window).max_blocks_per_request(10_000, size, max_step) == widest
        assert attention(window).max_blocks_per_request(10, size, max_step) <= cdiv(10, size)
    assert attention(None).max_blocks_per_request(1000, 16, 8) == 63


@pytest.mark.parametrize("window, chunk", [(1, 1), (4, 1), (6, 1), (13, 1), (13, 3), (20, 8)])
def test_sliding_group_holds_only_its_window(window, chunk):
    kv = KVCacheManager(64, 4, enable_prefix_caching=False, specs=groups(window))
    r = req("a", list(range(10)))
    held = grow(kv, r, 150, chunk)
    assert r.num_tokens > 150 and len(kv.block_ids("a")[0]) > 35  # logical blocks
    if chunk == 1:  # every position and alignment occurs: the bound is reached
        assert max(held[10:]) == attention(window).max_blocks_per_request(10_000, 4, 1)
    assert kv.num_free_blocks == 63 - held[-1]
    kv.free(r)
    assert kv.num_free_blocks == 63 and not any(kv.pools[0].ref_cnt)


def test_blocks_out_of_the_window_are_reused():
    """W=8, S=4: a request running through 10 logical blocks cycles through 3 block ids, and
    a block its window lets go is the next one any request gets."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, specs=groups(8))
    a = req("a", [1, 2, 3])
    seen = set()
    for _ in range(38):
        grow(kv, a, 1)
        seen |= set(kv.block_ids("a")[0])
    held = list(kv.block_ids("a")[0])
    assert len(held) == 10 and seen == {NULL_BLOCK, *held[7:]} and kv.num_free_blocks == 4
    grow(kv, a, 2)  # from position 39 the window starts in block 8: block 7 goes back
    assert kv.block_ids("a")[0][7] == NULL_BLOCK and kv.num_free_blocks == 5
    assert kv.allocate_slots(req("b", [7, 7, 7, 7]), 4) == ([held[7]],)


def test_eight_blocks_serve_a_long_generation_in_a_window():
    """W=20, S=4, steps of at most 4 tokens: 7 blocks live at most, where full attention
    would need 110 for a 40-token prompt and 400 generated tokens."""
    assert attention(20).max_blocks_per_request(440, 4, 4) == 7
    assert attention(None).max_blocks_per_request(440, 4, 4) == 110
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, specs=groups(20))
    r = req("a", list(range(40)))
    grow(kv, r, 10 + 399, chunk=4)  # the prefill in 10 chunks gives the first token
    assert r.num_output_tokens == 400 and r.num_computed_tokens == 439
    assert KVCacheManager(8, 4, False).allocate_slots(req("b", list(range(40))), 40) is None


def test_prefix_hit_with_full_and_sliding_groups():
    """W=8, S=4: a hit of n blocks goes on from position 4n, whose window starts in block
    n-2; the sliding group needs only blocks n-2 and n-1 cached and returns the rest NULL."""
    kv = KVCacheManager(32, 4, enable_prefix_caching=True, specs=groups(None, 8))
    tokens = list(range(21))  # 5 full blocks and one more token
    a = req("a", tokens)
    full, sliding = kv.allocate_slots(a, 21)
    keys = a.block_hashes  # its 5 full blocks' keys
    b = req("b", tokens)
    hits, n = kv.get_computed_blocks(b)
    assert n == 20 and hits == (full[:5], [0, 0, 0, *sliding[3:5]])
    b_full, b_sliding = kv.allocate_slots(b, 1, hits)
    assert b_full[:5] == full[:5] and b_sliding[:5] == [0, 0, 0, *sliding[3:5]]
    assert [kv.pools[1].ref_cnt[x] for x in sliding[:5]] == [1, 1, 1, 2, 2]
    assert kv.group_num_free == (31 - 6 - 1, 31 - 6 - 1)
    # The sliding group loses its earliest blocks: no hit is shorter for it.
    evict(kv, 1, keys[0])
    evict(kv, 1, keys[1])
    assert kv.get_computed_blocks(req("c", tokens))[1] == 20
    # It loses block 4: the hit shortens to 4 blocks, whose window reads blocks 2 and 3.
    evict(kv, 1, keys[4])
    assert kv.get_computed_blocks(req("c", tokens)) == ((full[:4], [0, 0, *sliding[2:4]]), 16)
    evict(kv, 1, keys[2])  # only block 3 left: no n has its window's blocks
    assert kv.get_computed_blocks(req("c", tokens)) == (([], []), 0)
    # With blocks 0, 1 and 3 cached (not a prefix, and a hit of 5 blocks not taken):
    # from position 20 the window reads 3 and 4; from 16, 2 and 3; from 12, 1 and 2; from
    # 8, 0 and 1.
    for i, block in enumerate(sliding[:2]):
        kv.pools[1].cache(block, keys[i])
    assert kv.get_computed_blocks(req("c", tokens)) == ((full[:2], sliding[:2]), 8)


def test_prefix_hit_is_a_length_every_window_accepts():
    """Groups full, W=8 (reads 2 blocks back) and W=4 (1 block back). At 5 blocks the W=4
    group lacks block 4, so it offers 4; at 4 the W=8 group lacks block 2, so it offers 2,
    which the others accept: the fixed point, not the smallest first answer (4)."""
    kv = KVCacheManager(32, 4, enable_prefix_caching=True, specs=groups(None, 8, 4))
    tokens = list(range(21))
    a = req("a", tokens)
    blocks = kv.allocate_slots(a, 21)
    evict(kv, 2, a.block_hashes[4])
    evict(kv, 1, a.block_hashes[2])
    hits, n = kv.get_computed_blocks(req("b", tokens))
    assert n == 8 and hits == (blocks[0][:2], blocks[1][:2], [0, blocks[2][1]])


def test_blocks_a_window_lets_go_stay_cached():
    """Released out of the window, a block keeps its key until reused: a later request with
    the same prefix takes it back from the free queue."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=True, specs=groups(8))
    a = req("a", list(range(10)))
    grow(kv, a, 30)  # from position 29 the window starts in block 5
    (held,) = kv.block_ids("a")
    assert held[:5] == [NULL_BLOCK] * 5 and kv.num_free_blocks == 63 - 3
    b = req("b", a.all_token_ids[:21])
    hits, n = kv.get_computed_blocks(b)
    released = [kv.pools[0].cached[key] for key in a.block_hashes[3:5]]
    assert n == 20 and hits == ([0, 0, 0, *released],)
    assert not any(kv.pools[0].ref_cnt[x] for x in released)
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.num_free_blocks == 63 - 3 - 3  # the two hits and a new block


def test_preempted_sliding_request_is_readmitted_from_its_hit():
    """Preemption frees every group; the request comes back from its prefix-cache hit
    (a window's blocks before it NULL) and runs on."""
    kv = KVCacheManager([64, 6], 4, enable_prefix_caching=True, specs=groups(None, 8))
    a = req("a", list(range(10)))
    grow(kv, a, 49)
    assert kv.block_ids("a")[1][0] == NULL_BLOCK and a.num_tokens == 50
    kv.free(a)  # preempted: recomputed from its prefix-cache hit
    a.num_computed_tokens = 0
    assert kv.group_num_free == (63, 5) and kv.block_ids("a") == ([], [])
    assert not any(kv.pools[0].ref_cnt) and not any(kv.pools[1].ref_cnt)
    hits, n = kv.get_computed_blocks(a)
    assert n == 48 and NULL_BLOCK not in hits[0]
    assert hits[1][:10] == [NULL_BLOCK] * 10 and NULL_BLOCK not in hits[1][10:]
    assert kv.allocate_slots(a, 2, hits) is not None
    a.num_computed_tokens = n
    check_window(kv, a, 2, 2)
    a.num_computed_tokens += 2
    a.append_output_token(50)
    grow(kv, a, 30)
    assert a.num_tokens == 81


def test_reset_prefix_cache_with_unequal_pools():
    kv = KVCacheManager([16, 6], 4, enable_prefix_caching=True, specs=groups(None, 8))
    a = req("a", list(range(13)))
    kv.allocate_slots(a, 13)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.get_computed_blocks(req("b", list(range(13))))[1] == 12
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", list(range(13)))) == (([], []), 0)
    assert not kv.pools[0].cached and not kv.pools[1].cached


def test_unequal_pools_and_their_usage():
    kv = KVCacheManager([10, 4], 4, enable_prefix_caching=False, specs=groups(None, 4))
    assert kv.num_groups == 2 and kv.group_num_blocks == (10, 4) and kv.specs == groups(None, 4)
    assert kv.num_blocks == 10
    a = req("a", list(range(20)))
    assert kv.allocate_slots(a, 20) is None  # 5 blocks: the sliding group has 3
    assert kv.group_num_free == (9, 3) and kv.block_ids("a") == ([], [])
    grow(kv, a, 5, chunk=4)  # 4 tokens a step: at most 3 blocks in the window's group
    assert kv.group_num_free == (4, 1) and kv.num_free_blocks == 1
    assert kv.usage == pytest.approx(2 / 3)  # the fuller group: 2 of 3
    assert not kv.all_blocks_free
    kv.free(a)
    assert kv.usage == 0.0 and kv.num_free_blocks == 3 and kv.all_blocks_free


def test_group_arguments_are_checked():
    assert KVCacheManager(8, 4, False, groups(None, None)).group_num_blocks == (8, 8)
    assert KVCacheManager(8, 4, False, specs=groups(None, 16)).num_groups == 2
    with pytest.raises(ValueError, match="3 KV-cache pools need 3 block counts"):
        KVCacheManager([8, 8], 4, False, groups(None, None, None))
    with pytest.raises(ValueError, match="numbered from 0 in order of first use"):
        KVCacheManager(8, 4, False, groups(None, None), pools=[1, 0])
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager([8, 1], 4, False, groups(None, None))
    with pytest.raises(ValueError, match="at least 1 token"):
        KVCacheManager(8, 4, False, specs=groups(0))


@pytest.mark.parametrize("windows", [None, [None, 8]], ids=["full", "full+sliding"])
def test_without_same_step_hits_a_block_is_a_hit_from_the_next_step(windows):
    """`same_step_hits=False` (pipeline stages): the blocks a step caches are no hit for a
    request scheduled in that step, which computes them itself (its copies stay out of the
    cache); the next step hits them. A preempted writer's forgotten blocks stay out too."""
    tokens = list(range(13))  # 3 full blocks and one token
    for same_step in (True, False):
        specs = None if windows is None else groups(*windows)
        kv = KVCacheManager(32, 4, True, specs, same_step_hits=same_step)
        kv.begin_step()
        a = req("a", tokens)
        a_blocks = kv.allocate_slots(a, 13)
        b = req("b", tokens)
        hits, n = kv.get_computed_blocks(b)
        if same_step:
            assert n == 12 and hits[0] == a_blocks[0][:3]
            continue
        assert (hits, n) == (kv.no_blocks(), 0)
        b_blocks = kv.allocate_slots(b, 13, hits)
        assert not set(b_blocks[0]) & set(a_blocks[0])
        kv.begin_step()
        hits, n = kv.get_computed_blocks(req("c", tokens))
        assert n == 12 and hits[0] == a_blocks[0][:3]
        # A step that registers d's blocks, then takes d back out before it runs.
        other = [100 + t for t in tokens]
        kv.begin_step()
        d = req("d", other)
        kv.allocate_slots(d, 13)
        kv.forget_uncomputed(d, 0)
        kv.free(d)
        kv.begin_step()
        assert kv.get_computed_blocks(req("e", other)) == (kv.no_blocks(), 0)


def test_a_request_that_waited_for_blocks_across_a_weight_update_takes_no_old_hit():
    """A waiting request whose admission found the pool short holds nothing; a weight
    update must then drop its keys (chained from the old root) rather than keep them as a
    running request's, or its admission hits blocks the old weights computed."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    hog = req("hog", [500 + i for i in range(16)])
    assert kv.allocate_slots(hog, 16) is not None  # the pool is full
    w = req("w", [*range(12), 7, 7, 7, 7, 7])
    hit, n = kv.get_computed_blocks(w)
    assert n == 12 and kv.allocate_slots(w, 5, hit) is None  # it waits
    assert "w" not in kv.req_blocks
    kv.new_weights([a, hog, w])
    assert kv.stale == {"a", "hog"}
    kv.free(a)
    kv.free(hog)
    assert kv.get_computed_blocks(w)[1] == 0

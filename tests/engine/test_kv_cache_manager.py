"""Block pool, ref counts, prefix-cache keys (sha256, cache_salt) and LRU eviction, in pure
Python."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from jllm.engine import kv_cache_manager as kv_module
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request
from jllm.sampling_params import SamplingParams


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
        assert r.block_hashes == sha256_chain(kv_module.ROOT_KEY, tokens, 4, salt)
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
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, num_groups=2)
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
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True, num_groups=2)
    a_blocks = kv.allocate_slots(req("a", list(range(12))), 12)
    hits, n = kv.get_computed_blocks(req("b", list(range(12))))
    assert n == 8 and hits == tuple(blocks[:2] for blocks in a_blocks)
    b_blocks = kv.allocate_slots(req("b", list(range(12))), 4, hits)
    for g in range(2):
        assert b_blocks[g][:2] == a_blocks[g][:2] and b_blocks[g][2] != a_blocks[g][2]
        assert kv.pools[g].ref_cnt[a_blocks[g][0]] == 2
    assert not kv.reset_prefix_cache()  # requests hold blocks

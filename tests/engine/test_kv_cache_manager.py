"""Block pool, ref counts, prefix hashing and LRU eviction, in pure Python."""

from __future__ import annotations

import pytest

from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request
from jllm.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), eos_token_id=None, seed=0)


def test_allocate_and_free_counts_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = req("a", list(range(10)))
    blocks = kv.allocate_slots(r, 10)
    assert len(blocks) == 3 and 0 not in blocks  # block 0 is the null block
    assert kv.num_free_blocks == 6
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == blocks  # 12 slots fit in 3 blocks
    assert len(kv.allocate_slots(r, 3)) == 4
    assert kv.allocate_slots(req("b", [1] * 40), 40) is None  # 10 blocks > 5 free
    kv.free(r)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(12)))
    a_blocks = kv.allocate_slots(a, 12)
    b = req("b", list(range(12)))
    hit, n = kv.get_computed_blocks(b)
    # All 3 blocks are cached but one token must be computed: only 2 blocks are hits.
    assert n == 8 and hit == a_blocks[:2]
    b_blocks = kv.allocate_slots(b, 4, hit)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert kv.ref_cnt[a_blocks[0]] == 2
    c = req("c", list(range(8)) + [99, 98, 97, 96, 95])
    hit, n = kv.get_computed_blocks(c)
    assert n == 8  # diverges in the third block
    kv.free(a)
    kv.free(b)
    assert kv.ref_cnt[a_blocks[0]] == 0
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


def test_penalty_requests_skip_prefix_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    kv.allocate_slots(req("a", list(range(9))), 9)
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 8
    assert kv.get_computed_blocks(req("c", list(range(9)), repetition_penalty=1.2))[1] == 0


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=1, block_size=4, enable_prefix_caching=True)

"""The KV manager under random mixes of spec kinds (full, sliding, chunked local, MLA,
per-request state), pools shared by random groups, admissions from prefix hits, growth in
chunks with lookahead slots, steps, preemption (some taken back out of the step they were
scheduled in) and finishes, over prompts with shared prefixes and two salts. After every
operation:

- each pool's ref counts are its holders (a request's list in a group of the pool), free
  blocks are exactly the unheld ones, and no block is in two groups of one pool;
- two requests hold one block only at one logical index of one group, as a prefix hit: the
  same salt and the same tokens up to it;
- a group's NULL_BLOCKs are a prefix of its list, a windowed group holds no more live blocks
  than its spec's `max_blocks_per_request`, per-request state holds its one slot;
- a hit's blocks are cached under the request's own keys in each group;

and once every request finishes, every pool is back to its starting free count.
Derandomized: a run is reproducible.
"""

from __future__ import annotations

import types

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_specs import MLA, STATE, attention, chunked

from jllm.engine.block_pool import NULL_BLOCK
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request
from jllm.kv_cache_interface import MambaSpec
from jllm.sampling_params import SamplingParams
from jllm.utils import cdiv

MAX_CHUNK, MAX_AHEAD = 6, 2
PREFIXES = [list(range(100 * i, 100 * i + 40)) for i in range(3)]


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["full", "sliding", "chunked", "mla", "state"]))
    if kind == "sliding":
        return attention(draw(st.integers(1, 12)))
    if kind == "chunked":
        return chunked(draw(st.integers(1, 12)))
    return {"full": attention(), "mla": MLA, "state": STATE}[kind]


@st.composite
def scenarios(draw):
    s = types.SimpleNamespace()
    s.block_size = draw(st.sampled_from([1, 2, 4]))
    s.specs = draw(st.lists(specs(), min_size=1, max_size=4))
    s.pools = []
    for _ in s.specs:  # join a pool already drawn, or open the next one
        s.pools.append(draw(st.integers(0, max(s.pools, default=-1) + 1)))
    s.num_blocks = [draw(st.integers(2, 40)) for _ in range(max(s.pools) + 1)]
    s.caching = draw(st.booleans())
    s.same_step_hits = draw(st.booleans())
    s.ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["admit", "admit", "step", "step", "step", "preempt", "finish"]),
                st.integers(0, 10**6),
            ),
            min_size=30,
            max_size=80,
        )
    )
    return s


class Driver:
    """Runs requests against the manager as the scheduler does (its prefix hits, chunks
    and lookahead), keeping each request's computed position."""

    def __init__(self, s, data):
        self.s, self.data = s, data
        self.kv = KVCacheManager(
            s.num_blocks,
            s.block_size,
            s.caching,
            s.specs,
            pools=s.pools,
            same_step_hits=s.same_step_hits,
        )
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.count = 0

    def request(self) -> Request:
        d = self.data.draw
        prefix = PREFIXES[d(st.integers(0, 2))][: d(st.sampled_from([0, 9, 20, 40]))]
        tail = [1000 + self.count * 50 + i for i in range(d(st.integers(1, 12)))]
        salt = d(st.sampled_from([None, None, "s"]))
        self.count += 1
        rid = f"r{self.count}"
        return Request(rid, prefix + tail, SamplingParams(), None, seed=0, cache_salt=salt)

    def step(self, r: Request, hits=(), num_hit: int = 0) -> bool:
        """One step of `r` from its hits: False (and nothing taken) when a pool is short."""
        d = self.data.draw
        start = num_hit or r.num_computed_tokens
        n = min(d(st.integers(1, MAX_CHUNK)), r.num_tokens - start)
        ahead = d(st.integers(0, MAX_AHEAD))
        if r.request_id not in self.running:
            r.num_computed_tokens = 0  # the hits are counted from the first token
        blocks = self.kv.allocate_slots(r, n, hits, ahead)
        if blocks is None:
            return False
        for held, spec in zip(blocks, self.kv.specs, strict=True):
            assert len(held) >= spec.num_blocks(start + n + ahead, self.s.block_size)
        r.num_computed_tokens = start + n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(r.num_tokens % 997)
        return True

    def admit(self) -> None:
        r = self.waiting.pop(0) if self.waiting and self.data.draw(st.booleans()) else None
        r = r or self.request()
        hits, num_hit = self.kv.get_computed_blocks(r)
        if num_hit:
            self.check_hit(r, hits, num_hit)
        if self.step(r, hits, num_hit):
            self.running[r.request_id] = r
        elif r not in self.waiting:
            self.waiting.append(r)

    def preempt(self, r: Request, taken_back: bool) -> None:
        if taken_back:  # scheduled in this step, then taken back out before it runs
            start = r.num_computed_tokens
            if self.kv.allocate_slots(r, 1) is not None:
                self.kv.forget_uncomputed(r, start)
        self.kv.free(r)
        del self.running[r.request_id]
        r.num_computed_tokens = 0
        self.waiting.append(r)

    def run(self) -> None:
        for op, pick in self.s.ops:
            if pick % 5 == 0:
                self.kv.begin_step()
            live = sorted(self.running)
            r = self.running[live[pick % len(live)]] if live else None
            if op == "admit":
                self.admit()
            elif r is not None and op == "step" and not self.step(r):
                self.preempt(r, taken_back=False)
            elif r is not None and op == "preempt":
                self.preempt(r, taken_back=pick % 2 == 0)
            elif r is not None and op == "finish":
                self.kv.free(r)
                del self.running[r.request_id]
            self.check()
        for r in [*self.running.values(), *self.waiting]:
            self.kv.free(r)
        assert self.kv.all_blocks_free
        assert [p.num_free for p in self.kv.pools] == [n - 1 for n in self.s.num_blocks]

    def check_hit(self, r: Request, hits, num_hit: int) -> None:
        size = self.s.block_size
        n = num_hit // size
        for manager, blocks in zip(self.kv.managers, hits, strict=True):
            assert len(blocks) == n
            first = manager.spec.hit_start(n, size)
            assert blocks[:first] == [NULL_BLOCK] * first
            for i in range(first, n):  # cached under this request's key in this group
                key = r.block_hashes[i] + manager.tag
                assert manager.pool.block_hash[blocks[i]] == key

    def check(self) -> None:
        kv, size = self.kv, self.s.block_size
        for p, pool in enumerate(kv.pools):
            holders, owner = [0] * pool.num_blocks, {}
            for g in (g for g, q in enumerate(kv.pool_of) if q == p):
                for rid, blocks in kv.req_blocks.items():
                    for i, b in enumerate(blocks[g]):
                        if b == NULL_BLOCK:
                            continue
                        holders[b] += 1
                        first = owner.setdefault(b, (g, i, rid))
                        assert first[:2] == (g, i)  # one group, one logical index
                        other = self.running.get(first[2])
                        mine = self.running.get(rid)
                        if other is not mine and other is not None and mine is not None:
                            assert other.cache_salt == mine.cache_salt
                            assert other.block_hashes[: i + 1] == mine.block_hashes[: i + 1]
            assert holders[1:] == pool.ref_cnt[1:]
            assert set(pool.free_queue) == {b for b in range(1, pool.num_blocks) if not holders[b]}
        for rid, blocks in kv.req_blocks.items():
            r = self.running.get(rid)
            for held, spec in zip(blocks, kv.specs, strict=True):
                live = [b for b in held if b != NULL_BLOCK]
                assert held[len(held) - len(live) :] == live  # the NULLs are a prefix
                if r is None:
                    assert not live  # a request that is not running holds nothing
                elif isinstance(spec, MambaSpec):
                    assert len(held) == len(live) == 1
                else:
                    step = MAX_CHUNK + MAX_AHEAD
                    bound = spec.max_blocks_per_request(r.num_tokens + step, size, step)
                    assert len(live) <= bound
                    assert len(held) >= cdiv(r.num_computed_tokens, size)


SETTINGS = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(scenarios(), st.data())
def test_manager_invariants(s, data):
    Driver(s, data).run()

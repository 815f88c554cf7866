"""The scheduler under random mixes of everything it weighs, driven by the engine core over a
mock runner that keeps the device's side of the bookkeeping: the content of every KV slot it
writes (a key chained over the tokens, adapter, salt and images before it) and each
request's block tables from the scheduler's deltas.

Hypothesis draws arrivals, prompt lengths over shared prefixes, max_tokens, priorities under
both policies, aborts, prompt logprobs, images beside a small encoder cache, LoRA adapters
beside few slots, drafts (a proposer, or a draft model's lookahead slots), tiles, chunked
prefill on and off, a sliding-window or chunked local attention group (in a pool of its own
or sharing the full-attention group's), async scheduling, and pools from one request's
worth of blocks up. Every step must:

- conserve blocks: in each pool every block is free or held, by one group, its ref count
  its holders';
- read only slots written before (by an earlier step, or by the same step where same-step
  prefix hits are allowed) with the content the reading request expects, in its own group
  (a slot is a pool's: two groups of one pool write one array), so a prefix-cache hit, a
  preempted row taken back out of its step, a rejected draft or another group's write never
  leaves a row reading a slot nobody computed for it;
- keep the step within its tokens (tile costs), prompt-logprob rows, encoder slots and
  `max_num_seqs`;
- follow the policy: waiting requests admitted in queue order (arrival order under fcfs,
  priority order under priority) except those whose adapter has no slot, none in a step
  that preempted; running requests passed over only when the step is full, their last token
  is in flight or their prompt logprobs or images wait for room; victims the last admitted
  (fcfs) or the lowest priority (priority).

Every request then finishes or is aborted and all blocks, adapter slots and images come back.
Derandomized: a run is reproducible.
"""

from __future__ import annotations

import types
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_specs import attention, chunked

import jllm.engine.step_budget as step_budget
from jllm.config import SchedulerConfig
from jllm.engine.core import EngineCore
from jllm.engine.encoder_cache import EncoderCache
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.multimodal import ImageItem
from jllm.engine.request import RequestStatus
from jllm.engine.request_queue import priority_key
from jllm.engine.scheduler import Scheduler
from jllm.engine.step_budget import prompt_logprob_rows
from jllm.lora.manager import LoraSlots
from jllm.runner.sampled import SampledToken
from jllm.sampling_params import SamplingParams
from jllm.scheduler_output import ModelRunnerOutput
from jllm.utils import cdiv

MAX_LEN = 48
ADAPTERS = [types.SimpleNamespace(digest=bytes([i]) * 32, request=None) for i in range(2)]
PREFIXES = [list(range(100 + 200 * i, 100 + 200 * i + MAX_LEN)) for i in range(3)]


def prompt(prefix: int, kind: int, n: int) -> list[int]:
    """n tokens: one of the shared prefixes whole, half of it, or none, then a tail (whose
    continuations reach the end-of-sequence token 999)."""
    cut = (n, n // 2, 0)[kind]
    return PREFIXES[prefix][:cut] + [970 + i for i in range(n - cut)]


ENC_PAGE = 2  # tokens per encoder-cache page: images of 1..4 tokens take 1 or 2 pages


def image(h: int, offset: int) -> ImageItem:
    """Image h: h + 1 tokens (equal images are equally long) from `offset`."""
    return ImageItem(bytes([h]) * 32, offset, h + 1, np.zeros((1, 1, 1), np.float32))


class Proposer:
    """Drafts the rule's next k tokens, the second one wrong for every third length."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, req, num_running=1):
        last, wrong = req.all_token_ids[-1], req.num_tokens % 3 == 0
        return [(last + i + 7 * (wrong and i == 2)) % 1000 for i in range(1, self.k + 1)]


class CheckingRunner:
    """The device's side, from the scheduler's deltas only (as the real runner): each
    request's tokens and block tables, and the content key of every KV slot written (a
    pool's slots, written by the group and the key). A row reads its positions before this
    step (those its group's spec does not skip) and writes its new ones; the key of position
    p chains the key of p - 1 with its token and image, from the request's salt and
    adapter. Samples (last token + 1) mod 1000, accepting drafts
    while they equal it; with `draft_k` it also drafts like a draft model."""

    def __init__(self, kv: KVCacheManager, same_step_hits: bool, draft_k: int = 0):
        self.kv, self.same_step_hits, self.draft_k = kv, same_step_hits, draft_k
        self.meta: dict[str, tuple] = {}  # request id -> (salt, adapter, images)
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.slots: list[dict] = [{} for _ in kv.pools]  # (block, slot) -> (group, key)
        self.adapter_in: dict[int, bytes] = {}  # LoRA slot -> the digest written there
        self.lora_slot: dict[str, int] = {}
        self.num_rows = 0

    def dispatch(self, out):
        return self.execute(out)

    def fetch(self, handle):
        return handle

    def _keys(self, rid: str, seq: list[int]) -> list[int]:
        salt, lora, images = self.meta[rid]
        if lora is not None:  # its adapter is still in its slot
            assert self.adapter_in[self.lora_slot[rid]] == lora.digest
        key, keys = hash((salt, None if lora is None else lora.digest)), []
        for p, tok in enumerate(seq):
            img = next((it.hash for it in images if it.offset <= p < it.end), None)
            key = hash((key, tok, img))
            keys.append(key)
        return keys

    def execute(self, out):
        for rid in out.finished_req_ids | out.preempted_req_ids:
            del self.tokens[rid], self.tables[rid]
        start = {}
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.tables[new.req_id] = [list(b) for b in new.block_ids]
            start[new.req_id] = new.num_computed_tokens
            self.lora_slot[new.req_id] = new.lora_slot
            if new.lora is not None:
                assert new.lora_slot > 0
                self.adapter_in[new.lora_slot] = new.lora.digest
        c = out.scheduled_cached_reqs
        for rid, ids, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True):
            for table, more in zip(self.tables[rid], ids, strict=True):
                table.extend(more)
            start[rid] = n
        rows = []
        for rid, n in out.num_scheduled_tokens.items():
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            c = start[rid]
            known = self.tokens[rid][: c + n - len(drafts)]
            assert len(known) == c + n - len(drafts)
            rows.append((rid, c, n, self._keys(rid, known + drafts)))
        if not self.same_step_hits:  # a step's reads see earlier steps' writes only
            self._check_reads(rows)
        writes = {}
        for rid, c, n, keys in rows:
            for g, table in enumerate(self.tables[rid]):
                assert len(table) >= cdiv(c + n, self.kv.block_size)
                pool = self.kv.pool_of[g]
                for p in range(c, c + n):
                    block, slot = table[p // self.kv.block_size], p % self.kv.block_size
                    assert block != 0
                    content = (g, keys[p])
                    assert writes.setdefault((pool, block, slot), content) == content
        for (pool, block, slot), content in writes.items():
            self.slots[pool][block, slot] = content
        if self.same_step_hits:
            self._check_reads(rows)
        self.num_rows += len(rows)
        return self._sample(out, start)

    def _check_reads(self, rows) -> None:
        size = self.kv.block_size
        for rid, c, _, keys in rows:
            groups = zip(self.tables[rid], self.kv.block_ids(rid), self.kv.specs, strict=True)
            for g, (table, held, spec) in enumerate(groups):
                first = spec.num_skipped_tokens(c)
                live = first // size
                assert table[live:] == held[live:]  # the runner's tables agree
                slots = self.slots[self.kv.pool_of[g]]
                for p in range(first, c):
                    block = table[p // size]
                    assert block != 0 and slots.get((block, p % size)) == (g, keys[p])

    def _sample(self, out, start) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            if start[rid] + n - len(drafts) < len(tokens):
                continue  # mid-prompt: nothing sampled
            emitted = []
            for d in [*drafts, None]:
                emitted.append(((emitted or tokens)[-1] + 1) % 1000)
                if d != emitted[-1]:
                    break
            tokens.extend(emitted)
            result.sampled[rid] = [SampledToken(t, 0.0, 1, [], []) for t in emitted]
            if self.draft_k:
                last, wrong = emitted[-1], emitted[-1] % 4 == 0
                result.spec_token_ids[rid] = [
                    (last + i + 5 * wrong) % 1000 for i in range(1, self.draft_k + 1)
                ]
        return result


class CheckedScheduler(Scheduler):
    """Checks each step's outputs against the state before it."""

    lp_rows = step_budget.PROMPT_LOGPROB_ROWS
    arrival: dict[str, int]

    def _preempt(self, req):
        self.victims.append(req)
        super()._preempt(req)

    def schedule(self):
        running, waiting = list(self.running), list(self.waiting)
        in_flight = {
            r.request_id
            for r in running
            if r.num_output_placeholders
            and r.reached_length(self.config.max_model_len, r.num_output_placeholders)
        }
        self.victims = []
        out = super().schedule()
        self._check_queue(waiting)
        self._check_victims(running, out)
        self._check_admission(waiting, out)
        self._check_running(running, in_flight, out)
        self._check_room(out)
        return out

    def _check_queue(self, waiting):
        if self.config.policy == "priority":
            assert waiting == sorted(waiting, key=priority_key)
            return
        fresh = [self.arrival[r.request_id] for r in waiting if not r.num_preemptions]
        assert fresh == sorted(fresh)  # arrival order
        kinds = [not r.num_preemptions for r in waiting]
        assert kinds == sorted(kinds)  # the preempted ones in front

    def _check_victims(self, running, out):
        k = len(self.victims)
        assert out.num_preempted == k
        if self.config.policy == "priority":
            want = sorted(running, key=priority_key, reverse=True)[:k]
        else:
            want = running[::-1][:k]
        assert self.victims == want
        assert all(r.status == RequestStatus.PREEMPTED for r in self.victims)
        assert not set(out.num_scheduled_tokens) & {r.request_id for r in self.victims}

    def _check_admission(self, waiting, out):
        admitted = [n.req_id for n in out.scheduled_new_reqs]
        if self.victims:
            assert not admitted
        ids = [r.request_id for r in waiting]
        at = [ids.index(rid) for rid in admitted]
        assert at == sorted(at)
        for req in waiting[: max(at) if at else 0]:
            if req.request_id not in admitted:  # passed over: no slot for its adapter
                assert req.lora is not None and not self.lora_slots.available(req.lora)
        if not self.config.enable_chunked_prefill:
            for new in out.scheduled_new_reqs:
                req = self.requests[new.req_id]
                assert req.num_computed_tokens == req.num_tokens  # the whole prompt at once

    def _check_running(self, running, in_flight, out):
        cached = out.scheduled_cached_reqs.req_ids
        order = [r.request_id for r in running]
        at = [order.index(rid) for rid in cached]
        assert at == sorted(at)  # running rows in admission order
        left = [r for r in running if r not in self.victims]
        for i, req in enumerate(left):
            rid = req.request_id
            if rid in out.num_scheduled_tokens or rid in in_flight:
                continue
            waits_for_room = any(it.end > req.num_computed_tokens for it in req.mm_items) or (
                req.sampling_params.prompt_logprobs is not None
                and req.num_computed_tokens < req.num_prompt_tokens - 1
            )
            if not waits_for_room:
                # The running pass ended here: the step's tokens ran out, or it preempted
                # the request it was scheduling (its last victim, before this one).
                ended = running.index(self.victims[-1]) if self.victims else len(running)
                assert self._cost(out) == self.config.max_num_batched_tokens or (
                    ended < running.index(req)
                )
                assert not set(out.num_scheduled_tokens) & {r.request_id for r in left[i:]}
                assert not out.scheduled_new_reqs

    def _cost(self, out):
        tile = self.config.tile_size
        return sum(n if n == 1 else cdiv(n, tile) * tile for n in out.num_scheduled_tokens.values())

    def _check_room(self, out):
        assert self._cost(out) <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        rows = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            assert n >= 1 and len(drafts) <= self.config.num_lookahead_slots
            rows += prompt_logprob_rows(req, req.num_computed_tokens - n, n)
        assert rows <= self.lp_rows
        images = {pages for slots in out.mm_slots.values() for _, _, pages in slots}
        if self.encoder_cache is not None:
            assert sum(map(len, images)) <= self.encoder_cache.num_pages


def check_blocks(kv: KVCacheManager, sched: Scheduler) -> None:
    """Every block of each pool is free or held (by one group of the pool), never both; ref
    counts are holders; only running requests hold blocks."""
    running = {r.request_id for r in sched.running}
    for p, pool in enumerate(kv.pools):
        holders, group = [0] * pool.num_blocks, {}
        for g in (g for g, q in enumerate(kv.pool_of) if q == p):
            for rid, blocks in kv.req_blocks.items():
                assert rid in running or not blocks[g]
                for b in blocks[g]:
                    holders[b] += b != 0
                    assert b == 0 or group.setdefault(b, g) == g
        assert holders == [0, *pool.ref_cnt[1:]]
        free = set(pool.free_queue)
        assert free == {b for b in range(1, pool.num_blocks) if not holders[b]}


@st.composite
def scenarios(draw):
    s = types.SimpleNamespace()
    s.policy = draw(st.sampled_from(["fcfs", "priority"]))
    s.async_ = draw(st.booleans())
    s.spec = "none" if s.async_ else draw(st.sampled_from(["none", "proposer", "draft_model"]))
    s.k = draw(st.integers(1, 3))
    s.block_size = draw(st.sampled_from([2, 2, 4, 8]))
    s.tile = draw(st.sampled_from([1, 1, 4]))
    s.chunked = draw(st.sampled_from([True, True, False]))
    s.budget = draw(st.sampled_from([8, 12, 24])) if s.chunked else cdiv(MAX_LEN, s.tile) * s.tile
    s.max_seqs = draw(st.sampled_from([1, 3, 8, 8]))
    s.caching = draw(st.booleans())
    s.same_step_hits = draw(st.booleans())
    s.second = draw(st.sampled_from([None, None, attention(8), chunked(8)]))
    s.shared = s.second is not None and draw(st.booleans())  # one pool for both groups
    s.spare = [draw(st.sampled_from([0, 1, 2, 4, 8])), draw(st.integers(0, 3))]
    s.lora_slots = draw(st.sampled_from([0, 1, 2]))
    # Encoder-cache pages: at least what a prompt's two largest images take (a prompt is
    # whole in a step without chunked prefill), as the engine sizes it.
    s.enc_slots = draw(st.sampled_from([0, 4, 5]))
    s.bidirectional = draw(st.booleans())
    s.lp_rows = draw(st.sampled_from([6, 16, 256]))
    # Later arrivals first, sometimes: a running request then meets a victim scheduled
    # before it in the same step (priority preemption takes that row back).
    s.later_first = s.policy == "priority" and draw(st.booleans())
    s.requests = []
    for i in range(draw(st.integers(2, 12))):
        length = draw(st.integers(1, 30))
        images = []
        if s.enc_slots and draw(st.booleans()):
            at = draw(st.integers(0, length - 1))
            for h in draw(st.lists(st.integers(0, 3), max_size=2)):
                if at + h + 1 > length:
                    break
                images.append(image(h, at))
                at += h + 1 + draw(st.integers(0, 3))
        prompt_logprobs = draw(st.sampled_from([None, None, 0]))
        if not s.chunked and length - 1 > s.lp_rows:
            prompt_logprobs = None  # the engine refuses these (llm_engine.py)
        params = SamplingParams(
            max_tokens=draw(st.sampled_from([1, 3, 6, 12, 20])),
            detokenize=False,
            ignore_eos=draw(st.booleans()),
            prompt_logprobs=prompt_logprobs,
        )
        step = draw(st.integers(0, 4))
        s.requests.append(
            dict(
                rid=f"r{i}",
                step=step,
                prompt=prompt(draw(st.integers(0, 2)), draw(st.integers(0, 2)), length),
                params=params,
                priority=-step if s.later_first else draw(st.integers(-1, 1)),
                lora=draw(st.sampled_from([None, *ADAPTERS])) if s.lora_slots else None,
                salt=draw(st.sampled_from([None, None, "s"])),
                images=images,
                abort=draw(st.sampled_from([None, None, None, 1, 4, 9])),
            )
        )
    return s


def build(s):
    ahead = s.k if s.spec == "draft_model" else 0
    # Pools from the blocks of the longest request alone (so that every request finishes),
    # plus the block 0 no request gets, plus the spares drawn.
    longest = max(min(MAX_LEN, len(r["prompt"]) + r["params"].max_tokens) for r in s.requests)
    specs = [attention()]
    need = [cdiv(longest + ahead, s.block_size) + 1]
    if s.second is not None:
        specs.append(s.second)
        step_max = s.budget + s.k
        need.append(s.second.max_blocks_per_request(longest + ahead, s.block_size, step_max) + 1)
    pools = [0, 0] if s.shared else None
    if s.shared:  # one request's blocks of both groups, one null block
        need = [need[0] + need[1] - 1]
    kv = KVCacheManager(
        [n + spare for n, spare in zip(need, s.spare, strict=False)],
        s.block_size,
        s.caching,
        specs,
        pools=pools,
        same_step_hits=s.same_step_hits,
    )
    lookahead = s.k if s.spec != "none" else 0
    config = SchedulerConfig(
        s.max_seqs, s.budget, MAX_LEN, s.chunked, s.tile, lookahead, s.policy,
        num_draft_lookahead=ahead,
    )  # fmt: skip
    sched = CheckedScheduler(
        config,
        kv,
        LoraSlots(s.lora_slots) if s.lora_slots else None,
        EncoderCache(s.enc_slots, ENC_PAGE) if s.enc_slots else None,
        s.bidirectional,
    )
    sched.lp_rows, sched.arrival = s.lp_rows, {}
    runner = CheckingRunner(kv, s.same_step_hits, draft_k=s.k if ahead else 0)
    proposer = Proposer(s.k) if s.spec == "proposer" else None
    core = EngineCore(
        sched, runner, MAX_LEN, eos_token_id=999, proposer=proposer,
        async_scheduling=s.async_,
    )  # fmt: skip
    return core, sched, kv, runner


SETTINGS = settings(
    max_examples=400,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(scenarios())
def test_scheduler_invariants(s):
    with mock.patch.object(step_budget, "PROMPT_LOGPROB_ROWS", s.lp_rows):
        core, sched, kv, runner = build(s)
        last = max(r["step"] + (r["abort"] or 0) for r in s.requests)
        for step in range(400):
            for r in s.requests:
                if r["step"] == step:
                    sched.arrival[r["rid"]] = len(sched.arrival)
                    runner.meta[r["rid"]] = (r["salt"], r["lora"], r["images"])
                    core.add_request(
                        r["rid"], r["prompt"], r["params"], cache_salt=r["salt"],
                        priority=r["priority"], lora=r["lora"], mm_items=r["images"],
                    )  # fmt: skip
                if r["abort"] is not None and r["step"] + r["abort"] == step:
                    core.abort_request([r["rid"]])
                    check_blocks(kv, sched)
            core.step()
            check_blocks(kv, sched)
            if step >= last and not core.has_unfinished_requests():
                break
    assert not core.has_unfinished_requests(), "the requests did not finish in 400 steps"
    assert not kv.req_blocks and kv.all_blocks_free
    if sched.lora_slots is not None:
        assert not any(sched.lora_slots.pins)
    if sched.encoder_cache is not None:
        assert not any(sched.encoder_cache.holders.values())
    assert runner.num_rows > 0


def test_new_weights_forget_held_image_embeddings_too():
    """After a weight update no image embedding the old encoder computed is found again,
    not even one a running request holds: a request admitted after the update (and the
    holder's next chunk) encodes the image anew; the pages all come back."""
    cache = EncoderCache(num_pages=4, page_tokens=16)
    assert cache.acquire("running", b"img", 20) == ((0, 1), True)
    cache.acquire("idle", b"other", 16)
    cache.release_all("idle")
    cache.new_weights()
    assert len(cache.free) == 4 and cache.usage == 0.0
    pages, new = cache.acquire("admitted after", b"img", 20)
    assert new and len(pages) == 2
    assert cache.acquire("running", b"img", 20) == (pages, False)
    cache.release_all("running")  # its own pages went back with the update: nothing twice
    cache.release_all("admitted after")  # idle, cached for the new weights
    assert sorted(cache.free + list(cache.slot_of[b"img"])) == [0, 1, 2, 3]

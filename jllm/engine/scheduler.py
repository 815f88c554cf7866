"""The scheduler: which requests compute how many tokens in the next step.

Each step has a request cap (`max_num_seqs`) and a budget (`engine/step_budget.py`: its
tokens, `max_num_batched_tokens`, its prompt-logprob rows, its encoder room and the
adapters' device slots), which two passes fill in turn. `_schedule_running` goes first, in
admission order (decodes, and the next chunks of chunked prefills); `_schedule_waiting`
then admits waiting requests in arrival order, their prompts chunked to fit what is left.
When the block pool runs dry in the running pass, the most recently admitted running
request is preempted: its blocks are freed and it is recomputed later (vLLM's recompute
mode). The pass records its victims and drops them from the running list once it is done:
a victim scheduled earlier in the step gives its row back to the budget, one not reached
yet is not scheduled, and a step that preempted admits no waiting request. Under
`scheduling_policy="priority"` the waiting queue is in priority order and the lowest
priority is preempted first (`engine/request_queue.py`).

With async scheduling the next step is scheduled before the results of the one in flight
are in: a request that samples in a step holds an output placeholder until its token is
appended, and the scheduler counts placeholders as known tokens (the runner takes the
token from the device).

A running request with draft tokens (`Request.spec_token_ids`, written by a proposer after
each step) is scheduled with them: 1 + k tokens whose row samples after each one. The step's
`SchedulerOutput` carries each request's full data once and deltas after that (see
`jllm/scheduler_output.py`).

Images (a vision-language model's `Request.mm_items`): a chunk's tokens that fall on an
image need its embeddings in the encoder cache (`engine/encoder_cache.py`); a chunk whose
images do not fit is cut before the first that does not. The step lists the images to
encode and, per request, the slot of every image its tokens touch. When an image's tokens
attend to each other in both directions (Gemma 3), a chunk never ends inside an image:
it stops before it, or takes the rest of it whole.
Host-side only: no JAX import.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from jllm.config import SchedulerConfig
from jllm.engine.encoder_cache import EncoderCache
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request, RequestStatus
from jllm.engine.request_queue import create_request_queue, priority_key
from jllm.engine.step_budget import StepBudget
from jllm.lora.manager import LoraSlots
from jllm.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Row:
    """One request's part of the step being scheduled."""

    req: Request
    start: int  # its first position this step (its computed tokens before it)
    num_new: int  # tokens, drafts included
    drafts: list[int] = field(default_factory=list)
    new: bool = False  # admitted in this step: the runner gets its full data


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        lora_slots: LoraSlots | None = None,
        encoder_cache: EncoderCache | None = None,
        bidirectional_images: bool = False,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        # With images: the device's image embeddings, and whether an image's tokens attend
        # to each other in both directions (its tokens are computed in one step).
        self.encoder_cache = encoder_cache
        self.bidirectional_images = bidirectional_images
        # With LoRA: the device slots running requests pin (jllm/lora/manager.py).
        self.lora_slots = lora_slots
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative, as vLLM reports it
        # Told to the runner with the next step: it drops these rows.
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # How many block ids of each group the runner already has, per request.
        self._sent_blocks: dict[str, tuple[int, ...]] = {}

    def check_fits(self, req: Request) -> None:
        """ValueError when `req` could never run, even alone: the KV cache cannot hold its
        prompt computed in the step's chunks, or its longest length (the prompt plus
        max_tokens, within the context) while it decodes. Only a cache smaller than
        start-up allows (num_gpu_blocks_override) does that; admitted, such a request would
        wait forever. (A request preempted late recomputes in chunks, which a windowed
        group in a pool that small may still not hold.)"""
        config = self.config
        # The last token is never computed; a draft model's lookahead slots are a wish.
        end = max(self._limit(req) - 1, req.num_prompt_tokens)
        chunk = config.max_num_batched_tokens + config.num_lookahead_slots
        prompt = req.num_prompt_tokens
        for tokens, step in ((prompt, min(prompt, chunk)), (end, 1 + config.num_lookahead_slots)):
            why = self.kv_cache.shortfall(tokens, step)
            if why is not None:
                raise ValueError(
                    f"The KV cache is too small for this request: {why}. Lower max_tokens "
                    "or the prompt's length, or give the cache more blocks."
                )

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = 0

    def _release_images(self, req: Request) -> None:
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(req.request_id)

    def _fit_images(self, req: Request, start: int, num_new: int, budget: StepBudget) -> int:
        """`num_new` cut so that the images its tokens touch fit the encoder cache beside
        the step's others, and, with bidirectional images, so that it does not end inside
        an image; 0 when nothing fits."""
        if not req.mm_items or self.encoder_cache is None:
            return num_new
        end = start + num_new
        if self.bidirectional_images:
            for item in req.mm_items:
                if item.offset < end < item.end:
                    end = item.offset
        return budget.fit_images(req, start, end)

    def _fit_row(self, req: Request, start: int, num_new: int, budget: StepBudget) -> int:
        """`num_new` (already within the step's tokens) cut where per-request state
        snapshots (KVCacheManager.align; with chunked prefill), then to the step's
        prompt-logprob rows and encoder room."""
        if self.config.enable_chunked_prefill:
            num_new = self.kv_cache.align(start, num_new)
        num_new = budget.fit_prompt_logprobs(req, start, num_new)
        if num_new and req.mm_items:
            num_new = self._fit_images(req, start, num_new, budget)
        return num_new

    def preempt_all(self) -> None:
        """Send every running request back to the front of the queue, in order, to be
        recomputed (a sleep released the KV cache)."""
        for req in reversed(self.running):
            self._preempt(req, log=False)
        self.running = []

    def _preempt(self, req: Request, log: bool = True) -> None:
        self.kv_cache.free(req)
        self._release_lora(req)
        self._release_images(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)
        if self._sent_blocks.pop(req.request_id, None) is not None:
            self._preempted_ids.add(req.request_id)
        if not log:
            return
        logger.warning(
            "Request %s is preempted by PreemptionMode.RECOMPUTE mode because there is not "
            "enough KV cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. "
            "total_num_cumulative_preemption=%d",
            req.request_id,
            self.num_preemptions,
        )

    def _victim(self, victims: dict[str, Request]) -> Request:
        """The running request to preempt next, among those not preempted yet: the last
        admitted (fcfs), or the lowest priority, the latest arrival among equals (priority),
        as vLLM."""
        left = [r for r in self.running if r.request_id not in victims]
        if self.config.policy == "priority":
            return max(left, key=priority_key)
        return left[-1]

    def _limit(self, req: Request) -> int:
        """The most tokens `req` can reach: its prompt plus max_tokens, within the context."""
        p = req.sampling_params
        if p.max_tokens is None:
            return self.config.max_model_len
        return min(self.config.max_model_len, req.num_prompt_tokens + p.max_tokens)

    def _drafts(self, req: Request) -> list[int]:
        """The drafts `req` can verify this step: only from a decode, and only as many as
        could still be emitted (k drafts bring up to k + 1 tokens; vLLM's bound): within
        max_tokens and the context length."""
        if req.num_output_placeholders or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(self._limit(req) - req.num_tokens - 1, self.config.num_lookahead_slots)
        return req.spec_token_ids[: max(0, room)]

    def _allocate(self, req: Request, num_new: int, hit_blocks, start: int, host_hits=()):
        """Slots for `num_new` tokens from position `start`, and, when the step makes the
        request sample, the slots past them that a draft model writes its drafts at (vLLM's
        lookahead), within what could still be emitted. The lookahead is a wish: without
        room for it the request runs without (the draft model drafts only inside a row's
        blocks), so it never preempts anything."""
        ahead, end = self.config.num_draft_lookahead, start + num_new
        if ahead and end >= req.num_tokens + req.num_output_placeholders:
            ahead = max(0, min(ahead, self._limit(req) - end))
            if ahead:
                blocks = self.kv_cache.allocate_slots(req, num_new, hit_blocks, ahead, host_hits)
                if blocks is not None:
                    return blocks
        return self.kv_cache.allocate_slots(req, num_new, hit_blocks, host_hits=host_hits)

    def schedule(self) -> SchedulerOutput:
        self.kv_cache.begin_step()
        config = self.config
        budget = StepBudget(
            tokens=config.max_num_batched_tokens,
            tile_size=config.tile_size,
            encoder_cache=self.encoder_cache,
            lora_slots=self.lora_slots,
        )
        rows, victims = self._schedule_running(budget)
        if not victims:  # a step that preempted has no room to admit anything
            rows += self._schedule_waiting(budget)
        out = SchedulerOutput(num_preempted=len(victims))
        self._fill_output(out, rows)
        return out

    def _schedule_running(self, budget: StepBudget) -> tuple[list[_Row], dict[str, Request]]:
        """Running requests, in admission order: decodes (with their drafts when the step
        has room to verify them) and the next chunks of chunked prefills. When the pool is
        short, victims are preempted until the row fits; the pass ends when the victim is
        the request itself, or the step's tokens run out. Returns the rows and the victims
        (by id, in preemption order), whom the running list loses after the pass."""
        rows: dict[str, _Row] = {}
        victims: dict[str, Request] = {}
        for req in self.running:
            if req.request_id in victims:  # preempted before its turn
                continue
            if budget.tokens <= 0:
                break
            pending = req.num_output_placeholders
            if pending and req.reached_length(self.config.max_model_len, pending):
                continue  # its last token is in flight: nothing to add
            start = req.num_computed_tokens
            drafts = self._drafts(req)
            known = req.num_tokens + pending - start
            num_new = budget.fit(known + len(drafts))
            if num_new < known + len(drafts):  # no room to verify: the known tokens only
                drafts, num_new = [], budget.fit(known)
            if num_new == 0:
                break
            num_new = self._fit_row(req, start, num_new, budget)
            if num_new == 0:  # its prompt logprobs or its images wait for the next step
                continue
            drafts = drafts[: max(0, num_new - known)]  # a row cut short verifies fewer
            if not self._make_room(req, num_new, rows, victims, budget):
                break
            rows[req.request_id] = _Row(req=req, start=start, num_new=num_new, drafts=drafts)
            budget.take(req, start, num_new)
            if drafts:  # a linear-attention state is kept as it is before the drafts
                self.kv_cache.save_state(req)
        if victims:
            self.running = [r for r in self.running if r.request_id not in victims]
        return list(rows.values()), victims

    def _make_room(
        self,
        req: Request,
        num_new: int,
        rows: dict[str, _Row],
        victims: dict[str, Request],
        budget: StepBudget,
    ) -> bool:
        """Slots for `num_new` tokens of running `req`, preempting victims (`_victim`)
        while the pool is short; False when `req` itself was preempted."""
        while self._allocate(req, num_new, (), req.num_computed_tokens) is None:
            victim = self._victim(victims)
            victims[victim.request_id] = victim
            row = rows.pop(victim.request_id, None)
            if row is not None:  # scheduled earlier in this step: take its row back
                budget.give_back(victim, row.start, row.num_new)
                # Its blocks registered for this step's tokens will not be computed.
                self.kv_cache.forget_uncomputed(victim, row.start)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, budget: StepBudget) -> list[_Row]:
        """Waiting requests in the queue's order (arrival, or priority), from their
        prefix-cache hits, their prompts chunked to what is left of the step, until one does
        not fit. One whose adapter cannot get a device slot waits; those behind it may go
        first."""
        rows: list[_Row] = []
        skipped: list[Request] = []
        config, kv = self.config, self.kv_cache
        while self.waiting and budget.tokens > 0 and len(self.running) < config.max_num_seqs:
            req = self.waiting.peek()
            if not budget.adapter_fits(req):
                skipped.append(self.waiting.pop())
                continue
            hit_blocks, num_device_hit = kv.get_computed_blocks(req)
            host_hits = kv.host_hits  # loaded from host memory into fresh blocks
            num_hit = num_device_hit + len(host_hits) * kv.block_size
            remaining = req.num_tokens - num_hit
            num_new = self._fit_row(req, num_hit, budget.fit(remaining), budget)
            if num_new == 0 or (num_new < remaining and not config.enable_chunked_prefill):
                break
            req.num_computed_tokens = 0  # the hits are counted from the first token
            if self._allocate(req, num_new, hit_blocks, num_hit, host_hits) is None:
                break
            self.waiting.pop()
            req.lora_slot = budget.take_adapter(req)
            kv.record_prefix_lookup(req.num_tokens, num_device_hit)
            kv.record_host_lookup(req, num_device_hit, host_hits)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            rows.append(_Row(req=req, start=num_hit, num_new=num_new, new=True))
            budget.take(req, num_hit, num_new)
        for req in reversed(skipped):
            self.waiting.prepend(req)
        return rows

    def _fill_output(self, out: SchedulerOutput, rows: list[_Row]) -> None:
        if not rows:  # no step runs: the runner hears of these with the next one
            return
        out.kv_stores, out.kv_loads = self.kv_cache.take_copies()
        out.state_copies = self.kv_cache.take_state_copies()
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        out.preempted_req_ids, self._preempted_ids = self._preempted_ids, set()
        cached = out.scheduled_cached_reqs
        if self.encoder_cache is not None:
            self._place_images(out, rows)
        for row in rows:
            req, num_new, drafts = row.req, row.num_new, row.drafts
            rid = req.request_id
            blocks = self.kv_cache.block_ids(rid)
            if row.new:
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.sampling_params,
                        req.seed,
                        req.eos_token_id,
                        tuple(list(b) for b in blocks),
                        req.num_computed_tokens,
                        req.lora_slot,
                        req.lora,
                        prompt_is_embeds=req.prompt_embeds is not None,
                        mrope_spans=tuple(
                            (it.offset, it.length, *it.llm_grid)
                            for it in req.mm_items
                            if it.grid is not None
                        ),
                    )
                )
            else:
                cached.req_ids.append(rid)
                sent = self._sent_blocks[rid]
                new = [b[n:] for b, n in zip(blocks, sent, strict=True)]
                cached.new_block_ids.append(tuple(new))
                cached.num_computed_tokens.append(req.num_computed_tokens)
            self._sent_blocks[rid] = tuple(map(len, blocks))
            out.num_scheduled_tokens[rid] = num_new
            out.total_num_scheduled_tokens += num_new
            if req.prompt_embeds is not None and row.start < len(req.prompt_embeds):
                out.prompt_embeds[rid] = req.prompt_embeds[row.start : row.start + num_new]
            if drafts:
                out.scheduled_spec_decode_tokens[rid] = list(drafts)
            req.spec_token_ids = []
            known = req.num_tokens + req.num_output_placeholders
            if req.num_computed_tokens + num_new - len(drafts) == known:
                req.num_output_placeholders += 1  # this step samples its next token
                if req.sampling_params.structured_outputs is not None:
                    out.structured_output_request_ids.add(rid)
            req.num_computed_tokens += num_new
            if req.mm_items and self.encoder_cache is not None:
                self.encoder_cache.release_passed(rid, req.mm_items, req.num_computed_tokens)

    def _place_images(self, out: SchedulerOutput, rows: list[_Row]) -> None:
        """Hold the images each scheduled chunk touches (the cached ones first, so that a
        new one never evicts an image this step reads), list the new ones to encode, and
        tell the runner each touched image's slot."""
        touched = [
            (row.req, item)
            for row in rows
            for item in row.req.mm_items
            if item.overlaps(row.start, row.start + row.num_new)
        ]
        cache = self.encoder_cache
        touched.sort(key=lambda pair: pair[1].hash not in cache.slot_of)
        for req, item in touched:
            pages, new = cache.acquire(req.request_id, item.hash, item.length)
            if new:
                out.encoder_inputs.append((pages, item.pixels, item.grid))
            out.mm_slots.setdefault(req.request_id, []).append((item.offset, item.length, pages))

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End `req` (stop, length or abort) and give its blocks back."""
        if req.is_finished():
            return
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_cache.free(req)
        self._release_lora(req)
        self._release_images(req)
        self.requests.pop(req.request_id, None)
        if self._sent_blocks.pop(req.request_id, None) is not None:
            self._finished_ids.add(req.request_id)

    def reject_drafts(self, req: Request, num_rejected: int, num_scheduled: int) -> None:
        """A verification row of `num_scheduled` tokens accepted fewer drafts than it
        computed: their positions are computed again later (their KV slots get
        overwritten; their blocks were never cached, see `KVCacheManager.allocate_slots`).
        A model with per-request state (linear attention) ran the rejected drafts into it:
        the state goes back to its backup from before the step, and the whole row is
        computed again from its first token (the accepted drafts and the token sampled
        after them now known)."""
        req.num_computed_tokens -= num_rejected
        if num_rejected and self.kv_cache.restore_state(req):
            req.num_computed_tokens -= num_scheduled - num_rejected

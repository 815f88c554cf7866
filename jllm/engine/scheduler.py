"""The scheduler: which requests compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`).
Running requests go first (decodes, and the next chunks of chunked prefills), then waiting
requests in arrival order, their prompts chunked to fit what is left of the budget. When the
block pool runs dry, the most recently admitted running request is preempted: its blocks
are freed and it is recomputed later (vLLM's recompute mode). Under
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

from jllm.config import SchedulerConfig
from jllm.engine.encoder_cache import EncoderCache
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request, RequestStatus
from jllm.engine.request_queue import create_request_queue, priority_key
from jllm.lora.manager import LoraSlots
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS, NewRequestData, SchedulerOutput
from jllm.utils import cdiv

logger = logging.getLogger(__name__)


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

    def _fit_images(self, req: Request, start: int, num_new: int, step_images: set) -> int:
        """`num_new` cut so that the images its tokens touch fit the encoder cache beside
        the step's others (`step_images`, which it joins), and, with bidirectional images,
        so that it does not end inside an image; 0 when nothing fits."""
        if not req.mm_items or self.encoder_cache is None:
            return num_new
        end = start + num_new
        if self.bidirectional_images:
            for item in req.mm_items:
                if item.offset < end < item.end:
                    end = item.offset
        while True:
            if end <= start:
                return 0
            touched = [it for it in req.mm_items if it.overlaps(start, end)]
            needed = {it.hash for it in touched}
            if self.encoder_cache.can_take(step_images | needed):
                step_images |= needed
                return end - start
            end = max(it.offset for it in touched)

    def _preempt(self, req: Request) -> None:
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
        logger.warning(
            "Request %s is preempted by PreemptionMode.RECOMPUTE mode because there is not "
            "enough KV cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. "
            "total_num_cumulative_preemption=%d",
            req.request_id,
            self.num_preemptions,
        )

    def _victim(self) -> Request:
        """The running request to preempt: the last admitted (fcfs), or the lowest priority,
        the latest arrival among equals (priority), as vLLM."""
        if self.config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    @staticmethod
    def _listed(req: Request, start: int, num_new: int) -> int:
        """Prompt tokens among positions start .. start + num_new - 1 whose prompt logprobs
        the step computes (every prompt token but the last, when the request asks)."""
        if req.sampling_params.prompt_logprobs is None:
            return 0
        return max(0, min(start + num_new, req.num_prompt_tokens - 1) - start)

    def _cap_prompt_logprobs(
        self, req: Request, start: int, num_new: int, room: int, budget: int
    ) -> int:
        """`num_new` cut so that the step's prompt-logprob tokens fit `room` (the runner's
        fixed PROMPT_LOGPROB_ROWS); 0 when none fit."""
        if self._listed(req, start, num_new) <= room:
            return num_new
        return self._fit(room, budget) if room > 0 else 0

    def _cost(self, n: int) -> int:
        """Budget a row of n tokens takes: n, or with tiles (`tile_size` > 1) several tokens
        (a prefill chunk or a verification row) occupy whole tiles of the device batch."""
        tile = self.config.tile_size
        return n if n == 1 else cdiv(n, tile) * tile

    def _fit(self, remaining: int, budget: int) -> int:
        """How many of `remaining` tokens fit in `budget` (0 if none)."""
        if self._cost(remaining) <= budget:
            return remaining
        n = budget // self.config.tile_size * self.config.tile_size
        return n if n > 1 else min(1, budget)

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
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        lp_room = PROMPT_LOGPROB_ROWS  # prompt tokens with prompt logprobs this step
        step_images: set[bytes] = set()  # the images this step's tokens touch
        scheduled: list[tuple[Request, int, list[int], bool]] = []
        # 1. Running requests, in admission order; preempt from the back when short.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.num_output_placeholders
            if pending and req.reached_length(self.config.max_model_len, pending):
                # its last token is in flight: nothing to add
                i += 1
                continue
            drafts = self._drafts(req)
            known = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            num_new = self._fit(known + len(drafts), budget)
            if num_new < known + len(drafts):  # no room to verify: the known tokens only
                drafts, num_new = [], self._fit(known, budget)
            if num_new == 0:
                break
            num_new = self._cap_prompt_logprobs(
                req, req.num_computed_tokens, num_new, lp_room, budget
            )
            if num_new and req.mm_items:
                num_new = self._fit_images(req, req.num_computed_tokens, num_new, step_images)
            if num_new == 0:  # its prompt logprobs or its images wait for the next step
                i += 1
                continue
            while True:
                blocks = self._allocate(req, num_new, (), req.num_computed_tokens)
                if blocks is not None:
                    break
                victim = self._victim()
                j = self.running.index(victim)
                self.running.pop(j)
                if j < i:  # passed earlier in this step: scheduled (take it back) or skipped
                    i -= 1
                    k = next((n for n, s in enumerate(scheduled) if s[0] is victim), None)
                    if k is not None:
                        num_back = scheduled.pop(k)[1]
                        budget += self._cost(num_back)
                        lp_room += self._listed(victim, victim.num_computed_tokens, num_back)
                        # Its blocks registered for this step's tokens will not be computed.
                        self.kv_cache.forget_uncomputed(victim, victim.num_computed_tokens)
                self._preempt(victim)
                out.num_preempted += 1
                preempted = True
                if victim is req:
                    break
            if blocks is None:
                break
            scheduled.append((req, num_new, drafts, False))
            budget -= self._cost(num_new)
            lp_room -= self._listed(req, req.num_computed_tokens, num_new)
            i += 1
        # 2. Waiting requests, first come first served, unless this step already preempted.
        # One whose adapter cannot get a device slot waits; those behind it may go first.
        skipped: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.lora is not None and not self.lora_slots.available(req.lora):
                skipped.append(self.waiting.pop())
                continue
            hit_blocks, num_device_hit = self.kv_cache.get_computed_blocks(req)
            host_hits = self.kv_cache.host_hits  # loaded from host memory into fresh blocks
            num_hit = num_device_hit + len(host_hits) * self.kv_cache.block_size
            num_new = self._fit(req.num_tokens - num_hit, budget)
            num_new = self._cap_prompt_logprobs(req, num_hit, num_new, lp_room, budget)
            if num_new and req.mm_items:
                num_new = self._fit_images(req, num_hit, num_new, step_images)
            if num_new == 0 or (
                num_new < req.num_tokens - num_hit and not self.config.enable_chunked_prefill
            ):
                break
            req.num_computed_tokens = 0
            blocks = self._allocate(req, num_new, hit_blocks, num_hit, host_hits)
            if blocks is None:
                break
            self.waiting.pop()
            if req.lora is not None:
                req.lora_slot = self.lora_slots.acquire(req.lora)
            self.kv_cache.record_prefix_lookup(req.num_tokens, num_device_hit)
            self.kv_cache.record_host_lookup(req, num_device_hit, host_hits)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new, [], True))
            budget -= self._cost(num_new)
            lp_room -= self._listed(req, num_hit, num_new)
        for req in reversed(skipped):
            self.waiting.prepend(req)
        self._fill_output(out, scheduled)
        return out

    def _fill_output(self, out: SchedulerOutput, scheduled) -> None:
        if not scheduled:  # no step runs: the runner hears of these with the next one
            return
        out.kv_stores, out.kv_loads = self.kv_cache.take_copies()
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        out.preempted_req_ids, self._preempted_ids = self._preempted_ids, set()
        cached = out.scheduled_cached_reqs
        if self.encoder_cache is not None:
            self._place_images(out, scheduled)
        for req, num_new, drafts, new in scheduled:
            rid = req.request_id
            blocks = self.kv_cache.block_ids(rid)
            if new:
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

    def _place_images(self, out: SchedulerOutput, scheduled) -> None:
        """Hold the images each scheduled chunk touches (the cached ones first, so that a
        new one never evicts an image this step reads), list the new ones to encode, and
        tell the runner each touched image's slot."""
        touched = [
            (req, item)
            for req, num_new, _, _ in scheduled
            for item in req.mm_items
            if item.overlaps(req.num_computed_tokens, req.num_computed_tokens + num_new)
        ]
        cache = self.encoder_cache
        touched.sort(key=lambda pair: pair[1].hash not in cache.slot_of)
        for req, item in touched:
            slot, new = cache.acquire(req.request_id, item.hash)
            if new:
                out.encoder_inputs.append((slot, item.pixels))
            out.mm_slots.setdefault(req.request_id, []).append((item.offset, item.length, slot))

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

    def reject_drafts(self, req: Request, num_rejected: int) -> None:
        """A verification row accepted fewer drafts than it computed: their positions are
        computed again later (their KV slots get overwritten; their blocks were never
        cached, see `KVCacheManager.allocate_slots`)."""
        req.num_computed_tokens -= num_rejected

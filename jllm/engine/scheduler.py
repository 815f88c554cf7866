"""The scheduler: which requests compute how many tokens in the next step.

Each step has a token budget (`max_num_batched_tokens`) and a request cap (`max_num_seqs`).
Running requests go first (decodes, and the next chunks of chunked prefills), then waiting
requests in arrival order, their prompts chunked to fit what is left of the budget. When the
block pool runs dry, the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (vLLM's recompute mode).
Host-side only: no JAX import.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from jllm.config import SchedulerConfig
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    block_ids: list[int]
    new: bool = False  # admitted this step (first time, or resumed after preemption)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative, as vLLM reports it

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.warning(
            "Request %s is preempted by PreemptionMode.RECOMPUTE mode because there is not "
            "enough KV cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. "
            "total_num_cumulative_preemption=%d",
            req.request_id,
            self.num_preemptions,
        )

    def _cost(self, n: int) -> int:
        tile = self.config.tile_size
        return n if n == 1 else -(-n // tile) * tile

    def _fit(self, remaining: int, budget: int) -> int:
        """How many of `remaining` tokens fit in `budget` (0 if none)."""
        if self._cost(remaining) <= budget:
            return remaining
        n = budget // self.config.tile_size * self.config.tile_size
        return n if n > 1 else min(1, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_running: list[Request] = []
        preempted = False
        # 1. Running requests, in admission order; preempt from the back when short.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._fit(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:
                break
            while True:
                blocks = self.kv_cache.allocate_slots(req, num_new)
                if blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                preempted = True
                if victim is req:
                    break
            if blocks is None:
                break
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new, blocks))
            scheduled_running.append(req)
            budget -= self._cost(num_new)
            i += 1
        # 2. Waiting requests, first come first served, unless this step already preempted.
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            hit_blocks, num_hit = self.kv_cache.get_computed_blocks(req)
            num_new = self._fit(req.num_tokens - num_hit, budget)
            if num_new == 0 or (
                num_new < req.num_tokens - num_hit and not self.config.enable_chunked_prefill
            ):
                break
            req.num_computed_tokens = 0
            blocks = self.kv_cache.allocate_slots(req, num_new, hit_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            self.kv_cache.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_hit, num_new, blocks, new=True))
            budget -= self._cost(num_new)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        return out

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
        self.requests.pop(req.request_id, None)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)

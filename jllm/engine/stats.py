"""Periodic engine statistics, logged like vLLM's (throughput, queue sizes, cache usage).

Host-side only: no JAX import.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("jllm.engine.stats")


class StatLogger:
    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def record_step(self, sched_out, num_generated: int, scheduler) -> None:
        prompt = sched_out.total_num_tokens - sum(
            1 for s in sched_out.scheduled if s.num_computed_tokens >= s.request.num_prompt_tokens
        )
        self._prompt_tokens += prompt
        self._generation_tokens += num_generated
        self.total_prompt_tokens += prompt
        self.total_generation_tokens += num_generated
        now = time.monotonic()
        if now - self._last >= self.interval:
            self.log(scheduler, now)

    def log(self, scheduler, now: float | None = None) -> None:
        now = now if now is not None else time.monotonic()
        elapsed = max(now - self._last, 1e-9)
        kv = scheduler.kv_cache
        hit_rate = kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
            len(scheduler.running),
            len(scheduler.waiting),
            kv.usage * 100,
            hit_rate * 100,
            scheduler.num_preemptions,
        )
        self._prompt_tokens = self._generation_tokens = 0
        self._last = now

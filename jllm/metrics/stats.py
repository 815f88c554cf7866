"""What the engine reports each step, and the log line that summarises it.

`EngineCore.step()` fills a `StepStats` (tokens computed, time to first token and inter-token
latencies of the tokens it produced, requests that finished) and reads a `SchedulerStats`
snapshot; every stat logger gets both. `LoggingStatLogger` prints vLLM's periodic throughput
line; `jllm.metrics.prometheus` exports the same numbers under vLLM's metric names.
Host-side only: no JAX import.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("jllm.metrics")


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length" or "abort"
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    n: int


@dataclass
class StepStats:
    num_computed_tokens: int = 0  # prefill chunks + decodes computed this step
    num_prefill_tokens: int = 0  # of which prompt (or recomputed) tokens
    num_generation_tokens: int = 0
    # Prompt lengths of sequences that got their first token this step (vLLM counts prompt
    # tokens there, once per sequence).
    num_prompt_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use, 0..1
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found
    num_preemptions: int  # cumulative

    @classmethod
    def from_scheduler(cls, scheduler) -> SchedulerStats:
        kv = scheduler.kv_cache
        return cls(
            len(scheduler.running),
            len(scheduler.waiting),
            kv.usage,
            kv.prefix_queries,
            kv.prefix_hits,
            scheduler.num_preemptions,
        )


class LoggingStatLogger:
    """vLLM's periodic log line: throughput, queue sizes, cache usage, hit rate."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record(self, step: StepStats, sched: SchedulerStats) -> None:
        self._prompt_tokens += step.num_prefill_tokens
        self._generation_tokens += step.num_generation_tokens
        now = time.monotonic()
        if now - self._last >= self.interval:
            self.log(sched, now)

    def log(self, sched: SchedulerStats, now: float | None = None) -> None:
        now = now if now is not None else time.monotonic()
        elapsed = max(now - self._last, 1e-9)
        queries = sched.prefix_cache_queries
        hit_rate = sched.prefix_cache_hits / queries if queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
            sched.num_running,
            sched.num_waiting,
            sched.kv_cache_usage * 100,
            hit_rate * 100,
            sched.num_preemptions,
        )
        self._prompt_tokens = self._generation_tokens = 0
        self._last = now

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
    finish_reason: str  # "stop", "length", "abort" or "error"
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    n: int
    # vLLM's phases, from the first scheduling: to the first token (prefill), from it to the
    # last (decode), and both (inference); preemptions included.
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    num_preemptions: int = 0


@dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counts: a draft is one request's drafts in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's drafts in a step: the first `num_accepted` were accepted."""
        per_pos = [1] * num_accepted + [0] * (num_draft_tokens - num_accepted)
        self.add(SpecDecodingStats(1, num_draft_tokens, num_accepted, per_pos))

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        grow = len(other.accepted_per_pos) - len(self.accepted_per_pos)
        self.accepted_per_pos += [0] * max(0, grow)
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n


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
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use, 0..1
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found
    num_preemptions: int  # cumulative
    # The host KV tier (engine/host_kv_tier.py), cumulative: tokens looked up there (past
    # the device's hits) and found (vLLM's external prefix cache), bytes stored and loaded;
    # and its usage. None when there is no host tier.
    host_queries: int = 0
    host_hits: int = 0
    host_store_bytes: int = 0
    host_load_bytes: int = 0
    host_usage: float | None = None
    # Requests waiting outside the scheduler (a grammar still compiling): vLLM's "deferred".
    num_deferred: int = 0
    # With data parallelism, each shard's own (engine/data_parallel.py); None with one.
    shards: list | None = None

    @classmethod
    def from_scheduler(cls, scheduler) -> SchedulerStats:
        kv = scheduler.kv_cache
        shards = getattr(scheduler, "shards", None)
        stats = cls(
            len(scheduler.running),
            len(scheduler.waiting),
            kv.usage,
            kv.prefix_queries,
            kv.prefix_hits,
            scheduler.num_preemptions,
        )
        host = kv.host
        if host is not None:
            tiers = [t for t in (host, kv.state_host) if t is not None]
            stats.host_queries, stats.host_hits = host.queries, host.hits
            stats.host_store_bytes = sum(t.stores * t.block_bytes for t in tiers)
            stats.host_load_bytes = sum(t.loads * t.block_bytes for t in tiers)
            stats.host_usage = host.usage
        if shards is not None:
            stats.shards = [cls.from_scheduler(s) for s in shards]
        return stats


class LoggingStatLogger:
    """vLLM's periodic log line: throughput, queue sizes, cache usage, hit rate."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._spec = SpecDecodingStats()

    def record(self, step: StepStats, sched: SchedulerStats) -> None:
        self._prompt_tokens += step.num_prefill_tokens
        self._generation_tokens += step.num_generation_tokens
        self._spec.add(step.spec_decoding)
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
        for d, shard in enumerate(sched.shards or ()):  # vLLM's line per engine
            queries = shard.prefix_cache_queries
            logger.info(
                "Engine %03d: Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%, Preemptions: %d",
                d,
                shard.num_running,
                shard.num_waiting,
                shard.kv_cache_usage * 100,
                (shard.prefix_cache_hits / queries if queries else 0.0) * 100,
                shard.num_preemptions,
            )
        if sched.host_usage is not None:
            queries = sched.host_queries
            logger.info(
                "External prefix cache hit rate: %.1f%%, Host KV cache usage: %.1f%%, "
                "stored %.1f MiB, loaded %.1f MiB",
                (sched.host_hits / queries if queries else 0.0) * 100,
                sched.host_usage * 100,
                sched.host_store_bytes / 2**20,
                sched.host_load_bytes / 2**20,
            )
        spec = self._spec
        if spec.num_drafts:
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: "
                "%.2f tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, "
                "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance "
                "rate: %.1f%%",
                1 + spec.num_accepted_tokens / spec.num_drafts,
                spec.num_accepted_tokens / elapsed,
                spec.num_draft_tokens / elapsed,
                spec.num_accepted_tokens,
                spec.num_draft_tokens,
                ", ".join(f"{n / spec.num_drafts:.3f}" for n in spec.accepted_per_pos),
                100 * spec.num_accepted_tokens / spec.num_draft_tokens,
            )
        self._spec = SpecDecodingStats()
        self._prompt_tokens = self._generation_tokens = 0
        self._last = now

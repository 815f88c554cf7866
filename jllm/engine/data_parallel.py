"""Data parallelism's host half: one scheduler per data shard, behind the one scheduler the
engine core talks to.

With `data_parallel_size` D the engine holds D replicas of the model on the mesh's `data`
axis (sharding/), each with its own slice of KV-cache blocks and its own input-batch rows,
and runs them as one SPMD program per step (runner/data_parallel.py). Here each shard is a
plain `Scheduler` over its own `KVCacheManager`, so a shard schedules, preempts and caches
prefixes exactly as a one-replica engine does, within its own blocks and `max_num_seqs`
rows; `DataParallelScheduler` routes requests to shards and merges their step outputs.

Routing, as vLLM's internal load balancer with a prefix affinity of ours:

- a request whose prompt a shard holds cached blocks of goes to the shard with the longest
  hit (a shard's requests can only read its own blocks, so elsewhere it would recompute);
- otherwise to the least loaded shard by vLLM's score (`DPLBAsyncMPClient`): waiting plus
  running requests, waiting ones weighing more as the shard's cache fills (from half
  full, up to three times more when full); ties go round-robin.

A request keeps its shard until it finishes (a preempted one waits in its shard's queue:
its blocks were there). The core's view merges the shards: `requests` and `running` span
them, `schedule()` returns one `DataParallelOutput` whose `shards` the runner lays side by
side, and utility calls (reset the prefix cache, new weights, preempt all) reach every
shard.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap

from jllm.engine.request import Request, RequestStatus
from jllm.engine.scheduler import Scheduler
from jllm.scheduler_output import CachedRequestData, SchedulerOutput


@dataclasses.dataclass
class DataParallelOutput(SchedulerOutput):
    """A step of every data shard: `shards[d]` is shard d's own output (its requests, its
    block ids); the inherited fields merge them for the engine core (each request id
    appears in one shard). The shards share one `grammar_bitmask` dict, which the core
    fills."""

    shards: list[SchedulerOutput] = dataclasses.field(default_factory=list)

    @classmethod
    def merge(cls, shards: list[SchedulerOutput]) -> DataParallelOutput:
        out = cls(shards=shards, scheduled_cached_reqs=CachedRequestData())
        for s in shards:
            out.scheduled_new_reqs += s.scheduled_new_reqs
            out.num_scheduled_tokens |= s.num_scheduled_tokens
            out.total_num_scheduled_tokens += s.total_num_scheduled_tokens
            out.scheduled_spec_decode_tokens |= s.scheduled_spec_decode_tokens
            out.finished_req_ids |= s.finished_req_ids
            out.preempted_req_ids |= s.preempted_req_ids
            out.num_preempted += s.num_preempted
            out.structured_output_request_ids |= s.structured_output_request_ids
            s.grammar_bitmask = out.grammar_bitmask
        return out


class _ShardCaches:
    """The shards' KV-cache managers as the one the core and the metrics read: utility
    calls reach every shard, and the figures add up (usage: the fullest shard's)."""

    def __init__(self, shards: list[Scheduler]) -> None:
        self.shards = shards
        self.managers = [s.kv_cache for s in shards]

    def reset_prefix_cache(self) -> bool:
        """Every shard forgets its cached prefixes; False when any shard still holds
        blocks (that shard forgets nothing, as a one-replica engine)."""
        return all([kv.reset_prefix_cache() for kv in self.managers])

    def new_weights(self, requests=None) -> None:
        """New weights: every shard's cached prefixes become unreachable (each shard's own
        live requests keep their blocks)."""
        for s in self.shards:
            s.kv_cache.new_weights(s.requests.values())

    @property
    def usage(self) -> float:
        return max(kv.usage for kv in self.managers)

    @property
    def prefix_queries(self) -> int:
        return sum(kv.prefix_queries for kv in self.managers)

    @property
    def prefix_hits(self) -> int:
        return sum(kv.prefix_hits for kv in self.managers)

    @property
    def host(self):
        return None  # the host KV tier is refused under data parallelism

    @property
    def num_blocks(self):
        return self.managers[0].num_blocks  # each shard's (vLLM's per engine)

    @property
    def block_size(self) -> int:
        return self.managers[0].block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self.managers[0].enable_prefix_caching


class DataParallelScheduler:
    """D shard schedulers behind the `Scheduler` interface the engine core uses."""

    def __init__(self, shards: list[Scheduler]) -> None:
        self.shards = shards
        self.config = shards[0].config
        self.kv_cache = _ShardCaches(shards)
        self.encoder_cache = None  # images are refused under data parallelism
        self.lora_slots = None
        # Every shard's requests, as one live mapping (a shard adds and drops its own).
        self.requests = ChainMap(*(s.requests for s in shards))
        self.owner: dict[str, int] = {}  # request id -> its shard, while it lives
        self._start = 0  # where the next tie-break scan starts (vLLM's rotation)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.shards for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.shards for r in s.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.shards)

    def shard_of(self, req: Request) -> Scheduler:
        return self.shards[self.owner[req.request_id]]

    # ---- requests ------------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        self.shards[0].check_fits(req)  # the shards are alike

    def choose(self, req: Request) -> int:
        """The shard for a new request: the longest cached prefix, else the least load."""
        hits = [s.kv_cache.cached_prefix_tokens(req) for s in self.shards]
        best = max(hits)
        candidates = [d for d, h in enumerate(hits) if h == best]
        if len(candidates) == 1:
            return candidates[0]
        D = self.num_shards
        order = [(self._start + i) % D for i in range(D)]
        self._start = (self._start + 1) % D
        return min((d for d in order if d in candidates), key=lambda d: self._score(d))

    def _score(self, d: int) -> float:
        s = self.shards[d]
        waiting, running = len(s.waiting), len(s.running)
        return waiting + running + waiting * 6.0 * max(0.0, s.kv_cache.usage - 0.5)

    def add_request(self, req: Request) -> None:
        d = self.owner.get(req.request_id)
        if d is None:
            d = self.owner[req.request_id] = self.choose(req)
        self.shards[d].add_request(req)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.shards)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        d = self.owner.pop(req.request_id, None)
        if d is not None:
            self.shards[d].finish_request(req, status)
        elif not req.is_finished():  # never scheduled (a grammar still compiling)
            req.status = status

    def reject_drafts(self, req: Request, num_rejected: int, num_scheduled: int) -> None:
        self.shard_of(req).reject_drafts(req, num_rejected, num_scheduled)

    def preempt_all(self) -> None:
        for s in self.shards:
            s.preempt_all()

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> DataParallelOutput:
        return DataParallelOutput.merge([s.schedule() for s in self.shards])


def check_data_parallel(args, *, tiles: bool, vision, state: bool, pooling) -> None:
    """ValueError naming what does not split by data shard yet, when data_parallel_size > 1
    (at start-up, before anything is compiled)."""
    if args.data_parallel_size == 1:
        return
    refused = {
        "a draft model or MTP (speculative_config; n-gram speculation splits)": (
            args.speculative_config is not None and args.speculative_config.method != "ngram"
        ),
        "the host KV tier (kv_offloading_size)": bool(args.kv_offloading_size),
        "routed experts (enable_return_routed_experts)": args.enable_return_routed_experts,
        "images (a vision-language model)": vision is not None,
        "linear-attention layers (per-request state)": state,
        "the xla attention backend (its tiled steps): use the packed kernels "
        "(cpu_kernel on the CPU, pallas on TPU and GPU)": tiles,
    }
    what = [name for name, on in refused.items() if on]
    if what:
        raise ValueError(
            f"data_parallel_size={args.data_parallel_size} is not supported by jllm yet with "
            + "; ".join(what)
            + "."
        )

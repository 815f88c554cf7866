"""Prometheus metrics under vLLM's names (`vllm:` prefix), so dashboards, autoscalers and
routers built for vLLM read jllm unchanged.

`PrometheusStatLogger` is a stat logger like `LoggingStatLogger`: the engine core hands it a
`StepStats` and a `SchedulerStats` after every step, and it updates gauges, counters and
histograms in its own registry, which the server exposes at `/metrics`.
Host-side only: no JAX import.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from jllm.metrics.stats import SchedulerStats, StepStats

# vLLM's histogram buckets (seconds).
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# fmt: on
FINISH_REASONS = ("stop", "length", "abort", "error")

# No `*_created` series, as in vLLM.
disable_created_metrics()


def length_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's request-length buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_model_len: int, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        names = ["model_name", "engine"]
        labels = {"model_name": model_name, "engine": str(engine_index)}
        self.engine_label = str(engine_index)
        reg = self.registry

        # The scheduler's figures, per data shard under data parallelism (vLLM's `engine`
        # label: one series per shard); every other series is the engine's as a whole.
        self.model_name = model_name
        self._per_engine: dict[str, Gauge | Counter] = {}

        def gauge(name, doc):
            family = self._per_engine[name] = Gauge(name, doc, names, registry=reg)
            return family.labels(**labels)

        def counter(name, doc):
            family = self._per_engine[name] = Counter(name, doc, names, registry=reg)
            return family.labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        # The host KV tier (vLLM's CPU offloading names; the usage gauge is jllm's).
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries (the host KV tier), in terms of number of queried "
            "tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits (the host KV tier), in terms of number of cached tokens.",
        )
        self.offload_store_bytes = counter(
            "vllm:kv_offload_store_bytes", "Total bytes stored from the device to host memory."
        )
        self.offload_load_bytes = counter(
            "vllm:kv_offload_load_bytes", "Total bytes loaded from host memory to the device."
        )
        self.host_usage = gauge(
            "jllm:kv_offload_host_usage_perc",
            "Host KV tier usage: the share of its blocks holding a cached block. 1 means 100 "
            "percent usage.",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        lengths = length_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", lengths
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", lengths
        )
        self.request_n = histogram(
            "vllm:request_params_n", "The n request parameter.", [1, 2, 5, 10, 20]
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Number of tokens per engine_step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "End to end request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Number of preemptions per finished request.",
            [1, 2, 3, 4, 5, 10, 20],
        )
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason: capacity (the scheduler had no room) or "
            "deferred (a grammar still compiling).",
            [*names, "reason"],
            registry=reg,
        )
        self.waiting_capacity = by_reason.labels(**labels, reason="capacity")
        self.waiting_deferred = by_reason.labels(**labels, reason="deferred")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*names, "position"],
            registry=reg,
        )
        self.spec_accepted_per_pos = lambda pos: per_pos.labels(**labels, position=str(pos))
        self._seen = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self._shards_seen: list[SchedulerStats] = []

    def _engine(self, name: str, engine: int):
        return self._per_engine[name].labels(model_name=self.model_name, engine=str(engine))

    def _record_shards(self, shards: list[SchedulerStats]) -> None:
        """Each data shard's running and waiting requests, KV usage, prefix-cache counts and
        preemptions, under its engine label."""
        while len(self._shards_seen) < len(shards):
            self._shards_seen.append(SchedulerStats(0, 0, 0.0, 0, 0, 0))
        for d, (shard, seen) in enumerate(zip(shards, self._shards_seen, strict=False)):
            self._engine("vllm:num_requests_running", d).set(shard.num_running)
            self._engine("vllm:num_requests_waiting", d).set(shard.num_waiting)
            self._engine("vllm:kv_cache_usage_perc", d).set(shard.kv_cache_usage)
            queries = shard.prefix_cache_queries - seen.prefix_cache_queries
            self._engine("vllm:prefix_cache_queries", d).inc(queries)
            hits = shard.prefix_cache_hits - seen.prefix_cache_hits
            self._engine("vllm:prefix_cache_hits", d).inc(hits)
            preempted = shard.num_preemptions - seen.num_preemptions
            self._engine("vllm:num_preemptions", d).inc(preempted)
        self._shards_seen = list(shards)

    def record(self, step: StepStats, sched: SchedulerStats) -> None:
        self.waiting_capacity.set(sched.num_waiting)
        self.waiting_deferred.set(sched.num_deferred)
        if sched.shards is not None:
            self._record_shards(sched.shards)
        else:
            self.running.set(sched.num_running)
            self.waiting.set(sched.num_waiting + sched.num_deferred)
            self.kv_usage.set(sched.kv_cache_usage)
            # The scheduler keeps cumulative counts; counters advance by the difference.
            self.prefix_queries.inc(sched.prefix_cache_queries - self._seen.prefix_cache_queries)
            self.prefix_hits.inc(sched.prefix_cache_hits - self._seen.prefix_cache_hits)
            self.preemptions.inc(sched.num_preemptions - self._seen.num_preemptions)
        if sched.host_usage is not None:
            seen = self._seen
            self.external_queries.inc(sched.host_queries - seen.host_queries)
            self.external_hits.inc(sched.host_hits - seen.host_hits)
            self.offload_store_bytes.inc(sched.host_store_bytes - seen.host_store_bytes)
            self.offload_load_bytes.inc(sched.host_load_bytes - seen.host_load_bytes)
            self.host_usage.set(sched.host_usage)
        self._seen = sched
        self.prompt_tokens.inc(step.num_prompt_tokens)
        self.generation_tokens.inc(step.num_generation_tokens)
        # vLLM's count: the prompt tokens computed and the tokens sampled, the one that ends
        # a prefill included.
        iteration = step.num_prefill_tokens + step.num_generation_tokens
        if iteration:
            self.iteration_tokens.observe(iteration)
        spec = step.spec_decoding
        if spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.accepted_per_pos):
                self.spec_accepted_per_pos(pos).inc(n)
        for t in step.time_to_first_tokens:
            self.ttft.observe(t)
        for t in step.inter_token_latencies:
            self.itl.observe(t)
        for f in step.finished:
            self.success[f.finish_reason].inc()
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queued_time)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            self.request_n.observe(f.n)
            self.inference_time.observe(f.inference_time)
            self.prefill_time.observe(f.prefill_time)
            self.decode_time.observe(f.decode_time)
            self.request_preemptions.observe(f.num_preemptions)
            if f.max_tokens_param is not None:
                self.request_max_tokens.observe(f.max_tokens_param)

    def log_cache_config(self, info: dict) -> None:
        """vLLM's `vllm:cache_config_info`: the cache settings as labels of a gauge at 1."""
        info = {k: str(v) for k, v in info.items()}
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*info, "engine"],
            registry=self.registry,
        )
        gauge.labels(**info, engine=self.engine_label).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

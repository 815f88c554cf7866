"""Request tracing with OpenTelemetry: vLLM's `--otlp-traces-endpoint` and
`--collect-detailed-traces`.

With an endpoint set, every finished request becomes one span named "llm_request" (kind
SERVER), from the request's arrival to its end, in the trace that the HTTP request's W3C
`traceparent` / `tracestate` headers name, with vLLM's attribute names (`SpanAttributes`).
One span per user request: its `n` sequences are summed into it, as vLLM's V0 engine did.
The SDK's batch processor sends spans over OTLP: gRPC by default, HTTP/protobuf with
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (the SDK's other OTEL_* variables apply).

How it fits: `start_tracing` gives the engine's output processor a `RequestTracer`, whose
`trace` the output processor calls once per finished request (engine/output_processor.py:
inline under `LLM`, on AsyncLLM's output thread when serving); the server passes each HTTP
request's trace headers to `AsyncLLM.generate`. With `collect_detailed_traces` the engine
core also adds each step's scheduling and runner time to every request in the step
(engine/core.py), and its outputs carry the sums to the front end.

The OpenTelemetry SDK is an optional extra (`pip install "jllm[otel]"`): nothing imports it
until an endpoint is configured (jllm/config/observability.py checks it then), so without
one tracing costs nothing. Host-side only: no JAX.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping

from jllm.config.observability import (
    EXPORTERS,
    check_otel_available,
    is_otel_available,
    traces_protocol,
)
from jllm.model_loader.locate import DEFAULT_MODEL_NAME

__all__ = [
    "RequestTracer",
    "SpanAttributes",
    "extract_trace_headers",
    "is_otel_available",  # vLLM's name, from the config side
    "span_exporter",
    "start_tracing",
]

logger = logging.getLogger("jllm")

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (OpenTelemetry's gen-AI conventions, and vLLM's own)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_SCHEDULER = "gen_ai.latency.time_in_scheduler"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def extract_trace_headers(headers: Mapping[str, str] | None, enabled: bool) -> dict | None:
    """The W3C trace headers of an HTTP request when tracing is on; None otherwise (with a
    warning, once, if the request carried some)."""
    if headers is None:
        return None
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    if found and not enabled:
        _warn_tracing_disabled()
    return (found or None) if enabled else None


_warned = False


def _warn_tracing_disabled() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "Received a request with trace context but tracing is disabled "
            "(--otlp-traces-endpoint)."
        )


def span_exporter(endpoint: str):
    """The OTLP exporter of OTEL_EXPORTER_OTLP_TRACES_PROTOCOL ("grpc", the default, or
    "http/protobuf", which takes the full URL, e.g. http://collector:4318/v1/traces)."""
    protocol = traces_protocol()
    exporter = importlib.import_module(EXPORTERS[protocol]).OTLPSpanExporter
    if protocol == "grpc":
        # Plain text unless the endpoint is https:// (the exporter's own rule), as vLLM.
        return exporter(endpoint=endpoint, insecure=True)
    return exporter(endpoint=endpoint)


class RequestTracer:
    """Turns finished requests (engine/output_processor.py's `ParentRequest`) into spans."""

    def __init__(self, endpoint: str, model: str, detailed: list[str] | None = None) -> None:
        check_otel_available()
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.model = model
        detailed = detailed or []
        self.forward_time = "model" in detailed or "all" in detailed
        self.execute_time = "worker" in detailed or "all" in detailed
        # The engine's own provider, not the process's global one (vLLM sets that): other
        # libraries' spans (recent FastAPI makes its own) stay where their owner sends them.
        self.provider = TracerProvider()  # its resource reads OTEL_SERVICE_NAME etc.
        self.provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("jllm")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = trace.SpanKind.SERVER
        logger.info("Tracing requests to %s (%s).", endpoint, traces_protocol())

    @property
    def step_times(self) -> bool:
        """Whether the engine core must time each step for the spans."""
        return self.forward_time or self.execute_time

    def attributes(self, parent, now: float) -> dict:
        """vLLM's attributes of a finished request (`ParentRequest`) at time `now`."""
        A = SpanAttributes
        params, children = parent.params, parent.children
        arrival = parent.arrival_time
        attrs = {
            A.GEN_AI_RESPONSE_MODEL: self.model,
            A.GEN_AI_REQUEST_ID: parent.request_id,
            A.GEN_AI_REQUEST_N: params.n,
            A.GEN_AI_USAGE_NUM_SEQUENCES: len(children),
            A.GEN_AI_USAGE_PROMPT_TOKENS: len(parent.prompt_token_ids),
            A.GEN_AI_USAGE_COMPLETION_TOKENS: sum(c.num_output_tokens for c in children),
            A.GEN_AI_LATENCY_E2E: now - arrival,
        }
        for name, value in (
            (A.GEN_AI_REQUEST_TEMPERATURE, params.temperature),
            (A.GEN_AI_REQUEST_TOP_P, params.top_p),
            (A.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
        ):
            if value is not None:
                attrs[name] = value
        # A request that never ran (its grammar failed to compile) has no latencies.
        scheduled = _earliest(c.first_scheduled_time for c in children)
        first = _earliest(c.first_token_time for c in children)
        last = max((c.last_token_time for c in children if c.last_token_time), default=None)
        if scheduled is not None:
            attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled - arrival
        if first is not None:
            attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
        if self.step_times:
            # Each sequence sums the steps it was in (engine/core.py); they share most of
            # them, so the request takes the largest sum. jllm's forward and sampler are one
            # compiled step: "model" and "worker" both time the runner's calls for it.
            runner = max(c.model_execute_time for c in children)
            attrs[A.GEN_AI_LATENCY_TIME_IN_SCHEDULER] = max(c.scheduler_time for c in children)
            if self.forward_time:
                attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = runner
            if self.execute_time:
                attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = runner
        return attrs

    def trace(self, parent, now: float) -> None:
        """One span for a finished request, under the trace its headers name."""
        headers = parent.trace_headers
        span = self.tracer.start_span(
            SPAN_NAME,
            context=self.propagator.extract(headers) if headers else None,
            kind=self.kind,
            attributes=self.attributes(parent, now),
            start_time=int(parent.arrival_time * 1e9),
        )
        span.end(end_time=int(now * 1e9))

    def force_flush(self) -> bool:
        """Send every ended span now (blocks until the exporter returns)."""
        return self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()


def _earliest(times) -> float | None:
    return min((t for t in times if t is not None), default=None)


def start_tracing(engine) -> RequestTracer | None:
    """A `RequestTracer` attached to `engine` (an LLMEngine) when its arguments name an
    OTLP endpoint; None, importing nothing, otherwise."""
    args = getattr(engine, "args", None)
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if endpoint is None:
        return None
    tracer = RequestTracer(endpoint, args.model or DEFAULT_MODEL_NAME, args.collect_detailed_traces)
    engine.output_processor.tracer = tracer
    engine.core.step_timing = tracer.step_times
    return tracer

"""--otlp-traces-endpoint (jllm/tracing.py): a real server on the tiny Llama sends its spans
over OTLP/gRPC to a collector in this process, and each span is checked against the
response it belongs to and the `traceparent` header the request carried; the attribute
arithmetic is checked by hand on a request with set timestamps, sent over http/protobuf.
Spans are flushed explicitly (`RequestTracer.force_flush`), so nothing waits on a clock."""

from __future__ import annotations

import http.server
import sys
import threading
from concurrent import futures

import grpc
import openai
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from jllm.config import EngineArgs
from jllm.engine.output_processor import ParentRequest
from jllm.engine.request import Request
from jllm.entrypoints.openai.api_server import build_app, build_engine
from jllm.sampling_params import SamplingParams
from jllm.tracing import (
    SPAN_NAME,
    RequestTracer,
    SpanAttributes,
    extract_trace_headers,
    start_tracing,
)

A = SpanAttributes
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def attributes(span) -> dict:
    """A span's attributes as Python values (OTLP's AnyValue, one field set)."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


def spans_of(requests) -> list:
    return [
        span
        for request in requests
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def collector():
    """An OTLP/gRPC trace collector on 127.0.0.1 (a free port)."""
    service = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def traced(llama_dir, collector):
    service, endpoint = collector
    args = server_args(
        llama_dir, "--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"
    )
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    yield running, engine, service
    running.stop()
    engine.shutdown()


def test_server_sends_a_span_per_request_under_the_callers_trace(traced, llama_dir):
    running, engine, collector = traced
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello, my name is",
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": traceparent, "tracestate": "k=v"},
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chat_id = [chunk.id for chunk in stream][0]
    assert engine.tracer.force_flush()

    ours = spans_of(collector.requests)
    spans = {attributes(s)[A.GEN_AI_REQUEST_ID]: s for s in ours}
    assert len(ours) == len(spans) == 2
    assert set(spans) == {f"{completion.id}-0", f"{chat_id}-0"}
    span = spans[f"{completion.id}-0"]
    assert span.name == SPAN_NAME == "llm_request"
    assert span.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert span.trace_state == "k=v"
    attrs = attributes(span)
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == llama_dir  # the --model argument, as vLLM
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    assert attrs[A.GEN_AI_REQUEST_N] == 1
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == completion.usage.prompt_tokens
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == completion.usage.completion_tokens == 4
    ttft, e2e = attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN], attrs[A.GEN_AI_LATENCY_E2E]
    assert 0 < ttft <= e2e
    assert 0 <= attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] <= ttft
    # The span covers the request: float seconds since 1970 resolve about 0.25 us.
    duration = span.end_time_unix_nano - span.start_time_unix_nano
    assert duration == pytest.approx(e2e * 1e9, abs=1e3)
    # --collect-detailed-traces all: the steps' scheduling and runner times.
    assert attrs[A.GEN_AI_LATENCY_TIME_IN_SCHEDULER] > 0
    assert 0 < attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] <= e2e
    assert attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] > 0

    # No trace headers: a span at the root of a trace of its own.
    chat = spans[f"{chat_id}-0"]
    assert chat.parent_span_id == b"" and chat.trace_id.hex() != TRACE_ID
    assert attributes(chat)[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 3


class HttpCollector(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.requests.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def finished_request(n: int) -> ParentRequest:
    """A finished request with round timestamps: arrived at 100 s, scheduled at 100.5, first
    token at 101, last at 102 (its sequences' outputs: 3, 2, ... tokens)."""
    params = SamplingParams(n=n, max_tokens=8, temperature=0.0)
    children = []
    for i in range(n):
        child = Request(f"{i}_r", [1, 2, 3, 4, 5], params, None, i, 100.0)
        child.output_token_ids = [7] * (3 - i)
        child.first_scheduled_time, child.first_token_time = 100.5, 101.0
        child.last_token_time = 102.0 - i
        children.append(child)
    return ParentRequest("r", None, [1, 2, 3, 4, 5], params, children, 100.0)


def test_attributes_by_hand_over_http_protobuf(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    HttpCollector.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HttpCollector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        tracer = RequestTracer(endpoint, "some/model")  # no detailed traces
        tracer.trace(finished_request(2), now=103.0)
        assert tracer.force_flush()
        tracer.shutdown()
    finally:
        server.shutdown()
    (span,) = spans_of(HttpCollector.requests)
    assert span.name == "llm_request" and span.parent_span_id == b""
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (100 * 10**9, 103 * 10**9)
    assert attributes(span) == {
        A.GEN_AI_RESPONSE_MODEL: "some/model",
        A.GEN_AI_REQUEST_ID: "r",
        A.GEN_AI_REQUEST_N: 2,
        A.GEN_AI_USAGE_NUM_SEQUENCES: 2,
        A.GEN_AI_REQUEST_MAX_TOKENS: 8,
        A.GEN_AI_REQUEST_TEMPERATURE: 0.0,
        A.GEN_AI_REQUEST_TOP_P: 1.0,
        A.GEN_AI_USAGE_PROMPT_TOKENS: 5,
        A.GEN_AI_USAGE_COMPLETION_TOKENS: 3 + 2,
        A.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.5,
        A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 1.0,
        A.GEN_AI_LATENCY_E2E: 3.0,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.5,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 1.0,  # the last sequence's last token: 102
        A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: 1.5,
    }


def test_without_the_sdk_the_endpoint_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    with pytest.raises(ValueError, match=r'pip install "jllm\[otel\]"'):
        EngineArgs(model="m", otlp_traces_endpoint="http://127.0.0.1:4317")


def test_without_an_endpoint_nothing_imports_the_sdk(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import would fail

    class Engine:
        args = EngineArgs(model="m")

    assert start_tracing(Engine()) is None
    assert extract_trace_headers({"traceparent": "00-x"}, enabled=False) is None


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(collect_detailed_traces=["all"]), "requires otlp_traces_endpoint"),
        (dict(otlp_traces_endpoint="x", collect_detailed_traces="model,gpu"), "takes model"),
    ],
)
def test_bad_tracing_arguments_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        EngineArgs(model="m", **kwargs)


def test_an_unknown_protocol_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="Unsupported OTLP protocol 'http/json'"):
        EngineArgs(model="m", otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")


def test_only_the_w3c_headers_are_kept():
    headers = {"traceparent": "00-a-b-01", "tracestate": "k=v", "authorization": "secret"}
    assert extract_trace_headers(headers, enabled=True) == {
        "traceparent": "00-a-b-01",
        "tracestate": "k=v",
    }
    assert extract_trace_headers({"authorization": "secret"}, enabled=True) is None

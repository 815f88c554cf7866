"""vLLM's observability arguments (its `ObservabilityConfig`): `otlp_traces_endpoint` and
`collect_detailed_traces`, checked when the engine arguments are made, so a missing
OpenTelemetry SDK or an unknown OTLP protocol fails before any model loads. The spans
themselves are jllm/tracing.py's. Imports the SDK only to check it, and only when asked.
"""

from __future__ import annotations

import importlib
import os

# vLLM's --collect-detailed-traces values: "model" adds the forward time, "worker" the
# model-execute time, "all" both.
DETAILED_TRACE_MODULES = ("model", "worker", "all")
INSTALL_HINT = 'pip install "jllm[otel]"'
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
# The exporter module of each OTLP protocol vLLM takes.
EXPORTERS = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}


def traces_protocol() -> str:
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol not in EXPORTERS:
        raise ValueError(
            f"Unsupported OTLP protocol {protocol!r} in {PROTOCOL_ENV}: use one of "
            f"{sorted(EXPORTERS)}."
        )
    return protocol


def check_otel_available() -> None:
    """ValueError naming the extra to install when the OpenTelemetry SDK, or the OTLP
    exporter of the configured protocol, does not import (checked when the engine arguments
    name an endpoint, before any model loads)."""
    for module in ("opentelemetry.sdk.trace", EXPORTERS[traces_protocol()]):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(
                "OpenTelemetry is not available, so --otlp-traces-endpoint cannot send "
                f"traces ({module}: {e}). Install the SDK and its OTLP exporters with "
                f"`{INSTALL_HINT}`."
            ) from e


def is_otel_available() -> bool:
    try:
        check_otel_available()
    except ValueError:
        return False
    return True


def detailed_modules(value) -> list[str] | None:
    """vLLM's collect_detailed_traces as a list: a list of names, or the older
    comma-separated string ("model,worker"); unknown names are refused."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
    unknown = [n for n in names if n not in DETAILED_TRACE_MODULES]
    if unknown:
        raise ValueError(
            f"collect_detailed_traces takes {', '.join(DETAILED_TRACE_MODULES)} (a list, or "
            f"comma-separated); got {value!r}."
        )
    return names or None

"""The server's published OpenAPI document (`/openapi.json`), made to say what the server does.

FastAPI's generated document lists 422 for invalid bodies; the server answers them, as vLLM
does, with 400 and OpenAI's error body. This module replaces the 422 entries by the statuses
each route can answer (400 bad input, 401 without the API key when one is set: every route
but `auth.OPEN_PATHS`; 404 an unknown model, 500, and 503 once the engine has stopped or
the server is stopping), all with OpenAI's error schema; gives the streaming routes their
`text/event-stream` and `/health` and `/metrics` their real content types; and writes the
limits only the running engine knows (largest token id, context length, `max_logprobs`)
and the rules across fields (`openapi_rules.py`) into the request schemas, so that a request
valid under the document is one the server accepts.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from jllm.config.limits import INT64_MAX
from jllm.entrypoints.anthropic.protocol import is_anthropic_path
from jllm.entrypoints.openai.auth import OPEN_PATHS
from jllm.entrypoints.openai.openapi_rules import write_rules

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# Anthropic's error body, on its routes (anthropic/protocol.py).
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
DESCRIPTIONS = {
    "400": "Invalid request (OpenAI's error body).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "500": "Internal error.",
    "503": "The engine has stopped.",
}
STREAMING = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/invocations",
)
PLAIN = {"/health": "text/plain", "/ping": "text/plain", "/metrics": "text/plain"}


def _error(status: str, path: str) -> dict:
    ref = ANTHROPIC_ERROR_REF if is_anthropic_path(path) else ERROR_REF
    return {
        "description": DESCRIPTIONS[status],
        "content": {"application/json": {"schema": ref}},
    }


def _set_bound(schema: dict, bound: str, value: int) -> None:
    """`bound` ("maximum", "minimum") on an integer schema, or on each integer branch of an
    anyOf."""
    if schema.get("type") == "integer":
        schema[bound] = value
    for branch in schema.get("anyOf", []):
        _set_bound(branch, bound, value)
    if "items" in schema:
        _set_bound(schema["items"], bound, value)


def build_openapi(app, *, api_key: bool, limits: dict) -> dict:
    """`limits`: {"model_names", "vocab_size", "max_model_len", "max_logprobs" (-1: the
    vocabulary), "tokenizer_size" (the ids /detokenize takes), "priority" (whether the
    scheduling policy is priority), "grammar_backend" (the structured outputs backend),
    "images" (whether the model takes images), "prompt_embeds" (--enable-prompt-embeds),
    "trust_request_chat_template" (the flag),
    "renderer_parameters" (the chat_template_kwargs a request may not set)}."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, operations in doc["paths"].items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            statuses = ["500", "503"]
            if "requestBody" in op or path.startswith("/v1"):
                statuses += ["400", "404"]
            if api_key and path not in OPEN_PATHS:
                statuses.append("401")
            for status in statuses:
                responses[status] = _error(status, path)
            for param in op.get("parameters", []):  # GET /v1/models/{model}: a served one
                if param["in"] == "path" and param["name"] == "model":
                    param["schema"] = {"type": "string", "enum": list(limits["model_names"])}
            ok = responses.setdefault("200", {"description": "OK"})
            if path in STREAMING:
                ok["content"] = {"application/json": {"schema": {}}, "text/event-stream": {}}
            elif path in PLAIN:
                ok["content"] = {PLAIN[path]: {"schema": {"type": "string"}}}
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    schemas["AnthropicErrorResponse"] = ANTHROPIC_ERROR_SCHEMA
    top_token = limits["vocab_size"] - 1
    max_logprobs = limits["max_logprobs"]
    max_logprobs = limits["vocab_size"] if max_logprobs == -1 else max_logprobs
    context = limits["max_model_len"] - 1
    token_fields = {"allowed_token_ids": top_token, "stop_token_ids": top_token}
    maxima = {
        "CompletionRequest": {
            "prompt": top_token,
            "logprobs": max_logprobs,
            "prompt_logprobs": max_logprobs,
            "max_tokens": context,
            **token_fields,
        },
        "ChatCompletionRequest": {
            "top_logprobs": max_logprobs,
            "prompt_logprobs": max_logprobs,
            "max_tokens": context,
            "max_completion_tokens": context,
            **token_fields,
        },
        "DetokenizeRequest": {"tokens": limits["tokenizer_size"] - 1},
        "ResponsesRequest": {"stop_token_ids": top_token},
    }
    # -1 (the whole vocabulary) only where max_logprobs allows the whole vocabulary
    whole = max_logprobs >= limits["vocab_size"]
    for name, fields in maxima.items():
        props = schemas.get(name, {}).get("properties", {})
        for field, maximum in fields.items():
            if field in props:
                _set_bound(props[field], "maximum", maximum)
                if "logprobs" in field and not whole:
                    _set_bound(props[field], "minimum", 0)
    write_rules(schemas, limits)
    for schema in schemas.values():  # the served names: any other is a 404
        model = schema.get("properties", {}).get("model")
        if model is not None:
            nullable = {"type": "null"} in model.get("anyOf", [])
            model.clear()
            model["anyOf"] = [{"type": "string", "enum": list(limits["model_names"])}]
            if nullable:
                model["anyOf"].append({"type": "null"})
    _integer_bounds(doc)
    return doc


def _integer_bounds(node) -> None:
    """Every integer bound in the document as an integer, and every maximum at or past
    INT64_MAX as INT64_MAX exactly, the server's own bound. FastAPI writes the bounds as
    floats, so INT64_MAX arrives as 2.0^63, a value the server refuses. (Publishing a lower
    top, 2^63 - 1024, left the values between it and INT64_MAX taken though the document
    forbade them: the contract fuzzer sent max_tokens 2^63 - 1023 to /v1/messages.)"""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                value = node.get(bound)
                if isinstance(value, float) and value.is_integer():
                    node[bound] = int(value)
            if node.get("maximum", 0) >= INT64_MAX:
                node["maximum"] = INT64_MAX
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)

"""The server against its own published contract (`/openapi.json`), fuzzed by schemathesis:
every response's status, content type, headers and body must be the documented ones,
requests the document forbids must be refused, unsupported methods answered with 405 and
an Allow header, and no request may cause a server error. Bounded examples per route and a
fixed seed (derandomized), so a run is reproducible. The same with an API key: the fuzzed
requests carry it, and every route but the probes and docs answers 401 without it.

Every request the document allows is accepted (schemathesis' `positive_data_acceptance`):
rules across fields are in the document as OpenAPI 3.1 `if`/`then` and `anyOf`. Only what
no schema can describe may refuse a schema-valid request (`CONTENT_REFUSALS`)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai_server import MODEL_NAME, RunningServer, server_args
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jllm.entrypoints.openai.api_server import build_app
from jllm.entrypoints.openai.auth import OPEN_PATHS

EXCLUDED = [positive_data_acceptance]
# What no schema can say: a grammar, regex or JSON schema that does not compile, a text
# prompt or bad words past a limit in tokens, min_tokens over max_tokens (JSON Schema
# cannot compare two fields), and what the model's chat template refuses.
CONTENT_REFUSALS = (
    "for structured outputs",
    "longer than the maximum model length",
    "bad word",
    "bad-word token sequences",  # more multi-token bad words than a step's mask holds
    "bad_words entries must tokenize",  # a word of spaces only
    "min_tokens must be less than or equal to max_tokens",
    "thinking.budget_tokens must be less than max_tokens",  # Anthropic's, the same kind
    # A constraint the backend "auto" picks xgrammar for, with an option only guidance
    # takes and disable_fallback set: which backend a constraint gets is no schema's to say.
    "is not supported by the xgrammar backend",
    # The model's chat template may refuse what it likes (roles out of order, a generation
    # prompt after a message to continue).
    "Could not apply the chat template",
)

# The rules across fields chat's document leaves out: a stream takes neither prompt
# logprobs nor beams (with it, schemathesis' canonical form gave up on the document:
# jllm/entrypoints/openai/openapi_rules.py), and the tools' (a tool_choice needs tools and
# must name one of them; "auto" needs the server's tool parser).
CHAT_STREAM_REFUSALS = (
    "prompt_logprobs are not available when stream is enabled",
    "Stream options can only be defined when `stream=True`",
    "Streaming is not currently supported with beam search",
)
CHAT_TOOL_FIELDS = ("tools", "tool_choice")


@schemathesis.check
def schema_valid_is_accepted(ctx, response, case):
    """schemathesis' positive_data_acceptance, but for the refusals of CONTENT_REFUSALS."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code < 400:
        return None
    message = response.json().get("error", {}).get("message", "")
    if any(reason in message for reason in CONTENT_REFUSALS):
        return None
    if case.path.startswith("/v1/messages"):  # Anthropic's body: no param, the same rules
        message = response.json().get("error", {}).get("message", "")
        if any(reason in message for reason in CONTENT_REFUSALS + CHAT_STREAM_REFUSALS):
            return None
        if "tool" in message:  # tool_choice must name one of the tools; "auto" needs a parser
            return None
    if case.path.startswith("/v1/responses"):
        error = response.json()["error"]
        if error.get("param") in ("tools", "tool_choice", "previous_response_id"):
            return None  # the tool rules as chat's; an id no schema can know
        if "{response_id}" in case.path and response.status_code in (400, 404):
            return None  # a random id: not found, or not a background run to cancel
        if any(reason in error["message"] for reason in CONTENT_REFUSALS):
            return None
        if "arguments are not JSON" in error["message"]:  # a string holding JSON
            return None
    if case.path in ("/v1/chat/completions", "/invocations") and (
        any(r in message for r in CHAT_STREAM_REFUSALS)
        or response.json()["error"].get("param") in CHAT_TOOL_FIELDS
    ):
        return None
    raise AssertionError(f"a schema-valid request was refused: {response.status_code} {message}")


@pytest.fixture(scope="module")
def keyed(served):
    running, args, metrics = served
    keyed_args = server_args(args.model, "--api-key", "secret")
    server = RunningServer(build_app(keyed_args, running.engine, metrics), running.engine)
    yield server
    server.stop()


def fuzz(url: str, max_examples: int, headers: dict | None = None) -> dict:
    """Every documented operation, with generated valid and invalid requests, at most
    `max_examples` of each: how many requests each (method, path, mode) was sent. A failed
    check raises with schemathesis' report."""
    # `run` below is the same source for every run: the derandomized examples follow from it.
    SETTINGS = settings(  # noqa: N806
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    sent, counts = 0, {}
    for result in schema.get_all_operations():
        operation = result.ok()
        # The GET routes and the cancel route take no body: nothing invalid to send them (any
        # string is a path's id); /invocations dispatches to chat and completions, whose
        # refusals are fuzzed there.
        bodiless = operation.method.upper() == "GET" or not len(operation.body)
        positive_only = bodiless or operation.path == "/invocations"
        modes = [GenerationMode.POSITIVE] if positive_only else GenerationMode
        for mode in modes:
            before = sent

            @given(case=operation.as_strategy(generation_mode=mode))
            @SETTINGS
            def run(case):
                nonlocal sent
                sent += 1
                case.call_and_validate(
                    base_url=url, headers=headers, excluded_checks=EXCLUDED, timeout=120
                )

            run()
            counts[operation.method.upper(), operation.path, mode.value] = sent - before
    return counts


def test_contract(server):
    # 15 examples per operation and mode: the document grew to twice the operations (the
    # agent, token and probe routes), and the suite's time with it.
    sent = fuzz(server.url, max_examples=15)
    assert sum(sent.values()) > 200 and all(sent.values()), sent


def test_contract_with_an_api_key(keyed):
    """The same checks with the key on every request, on fewer examples: what the key
    changes is the same for every body (the fuzzing without it above explores the bodies),
    so each operation in each mode needs a few requests, not many."""
    sent = fuzz(keyed.url, max_examples=6, headers={"Authorization": "Bearer secret"})
    assert all(sent.values()) and len(sent) > 10, sent


def test_every_guarded_route_needs_the_key(keyed):
    """Every route but the probes and docs answers, and documents, 401 without the key."""
    doc = httpx.get(f"{keyed.url}/openapi.json").json()
    routes = [(p, m) for p, ops in doc["paths"].items() for m in ops if p not in OPEN_PATHS]
    assert {"/tokenize", "/detokenize", "/v1/completions"} <= {p for p, _ in routes}
    for path, method in routes:
        r = httpx.request(method.upper(), f"{keyed.url}{path}", json={})
        assert r.status_code == 401, (path, r.text)
        if path.startswith("/v1/messages"):  # Anthropic's body
            assert r.json()["error"]["type"] == "authentication_error"
        else:
            assert r.json()["error"]["code"] == 401
        assert "401" in doc["paths"][path][method]["responses"]
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 200
        assert "401" not in doc["paths"][path]["get"]["responses"]


def test_the_document_says_what_the_server_does(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    text = str(doc)
    assert "422" not in doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "HTTPValidationError" not in text
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert any(b.get("minLength") == 1 for b in completion["prompt"]["anyOf"])
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    for body in ({"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1]}):
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (body, r.text)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": "5"})
    assert r.status_code == 400  # strict: a string is not an integer
    health = httpx.get(f"{server.url}/health")
    assert health.headers["content-type"].startswith("text/plain")
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"\xff\xfe",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_integer_bounds_are_integers_a_double_holds(server):
    """FastAPI writes a schema's bounds as floats: INT64_MAX arrives as 2.0^63, one past what
    the server takes. The document states every integer bound as an integer, the 64-bit
    maxima as INT64_MAX exactly: what the server takes, no more and no less (the top value
    and the one past it, on a route the fuzzer found taking more than its document said)."""
    doc = httpx.get(f"{server.url}/openapi.json").json()
    bounds = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                bounds.extend(node[k] for k in ("minimum", "maximum") if k in node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert bounds and all(type(b) is int for b in bounds)
    assert max(bounds) == 2**63 - 1
    assert min(bounds) == -(2**63)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    for max_tokens, status in ((2**63 - 1, 200), (2**63, 400)):  # the first: up to the context
        r = httpx.post(
            f"{server.url}/v1/messages", json={**body, "max_tokens": max_tokens}, timeout=300
        )
        assert r.status_code == status, (max_tokens, r.text)


def test_responses_bounds_of_a_text_model(server):
    """What random fuzzing of /v1/responses found the document allowing and the server
    refusing: image parts for a text-only model, stop token ids past the vocabulary."""
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert schemas["InputImage"]["not"] == {} and schemas["ImageBlock"]["not"] == {}
    stop = schemas["ResponsesRequest"]["properties"]["stop_token_ids"]["anyOf"][0]["items"]
    chat = schemas["ChatCompletionRequest"]["properties"]["stop_token_ids"]["anyOf"][0]["items"]
    assert stop["maximum"] == chat["maximum"] < 1 << 20

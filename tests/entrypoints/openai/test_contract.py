"""The server against its own published contract (`/openapi.json`), fuzzed by schemathesis:
every response's status, content type, headers and body must be the documented ones,
requests the document forbids must be refused, unsupported methods answered with 405 and
an Allow header, and no request may cause a server error. Bounded examples per route and a
fixed seed (derandomized), so a run is reproducible. The same with an API key: the fuzzed
requests carry it, and every route but the probes and docs answers 401 without it.

Not checked: that every request the document allows is accepted (schemathesis'
`positive_data_acceptance`). Some refusals depend on several fields or on the engine and
cannot be written in OpenAPI: a prompt plus `max_tokens` over the context, `top_logprobs`
without `logprobs`, `prompt_logprobs` with `stream`, a regex or JSON schema that does not
compile. Those are 400s with OpenAI's error body, which the document lists and the
fuzzing checks."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai_server import RunningServer, server_args
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jllm.entrypoints.openai.api_server import build_app
from jllm.entrypoints.openai.auth import OPEN_PATHS

EXCLUDED = [positive_data_acceptance]
SETTINGS = settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)


@pytest.fixture(scope="module")
def keyed(served):
    running, args, metrics = served
    keyed_args = server_args(args.model, "--api-key", "secret")
    server = RunningServer(build_app(keyed_args, running.engine, metrics), running.engine)
    yield server
    server.stop()


def fuzz(url: str, headers: dict | None = None) -> int:
    """Every documented operation, with generated valid and invalid requests; returns how
    many requests were sent. A failed check raises with schemathesis' report."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        # The GET routes take no input: nothing invalid to send them.
        modes = [GenerationMode.POSITIVE] if operation.method.upper() == "GET" else GenerationMode
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @SETTINGS
            def run(case):
                nonlocal sent
                sent += 1
                case.call_and_validate(
                    base_url=url, headers=headers, excluded_checks=EXCLUDED, timeout=120
                )

            run()
    return sent


def test_contract(server):
    assert fuzz(server.url) > 200


def test_contract_with_an_api_key(keyed):
    assert fuzz(keyed.url, {"Authorization": "Bearer secret"}) > 200


def test_every_guarded_route_needs_the_key(keyed):
    """Every route but the probes and docs answers, and documents, 401 without the key."""
    doc = httpx.get(f"{keyed.url}/openapi.json").json()
    routes = [(p, m) for p, ops in doc["paths"].items() for m in ops if p not in OPEN_PATHS]
    assert {"/tokenize", "/detokenize", "/v1/completions"} <= {p for p, _ in routes}
    for path, method in routes:
        r = httpx.request(method.upper(), f"{keyed.url}{path}", json={})
        assert r.status_code == 401, (path, r.text)
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

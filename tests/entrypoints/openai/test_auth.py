"""API keys: every route that renders a template or runs the model needs one of the server's
keys (`--api-key`, else VLLM_API_KEY, else JLLM_API_KEY); probes and docs do not; every key
is compared, as digests."""

from __future__ import annotations

import argparse

import httpx
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args

from jllm.entrypoints.openai import auth
from jllm.entrypoints.openai.api_server import build_app

GUARDED = [
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v2/anything", {}),
    ("POST", "/pooling", {}),
]
OPEN = ["/health", "/version", "/metrics", "/openapi.json", "/docs"]


@pytest.fixture(scope="module")
def keyed(served):
    running, args, metrics = served
    flags = server_args(args.model, "--api-key", "first-key", "second-key")
    server = RunningServer(build_app(flags, running.engine, metrics), running.engine)
    yield server
    server.stop()


def call(server, method, path, body, key=None):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("method, path, body", GUARDED, ids=[p for _, p, _ in GUARDED])
def test_guarded_routes_need_a_key(keyed, method, path, body):
    for key in (None, "wrong", "first-ke", "first-key-and-more"):
        r = call(keyed, method, path, body, key)
        assert r.status_code == 401, (key, r.text)
        assert r.json()["error"]["code"] == 401


@pytest.mark.parametrize("method, path, body", GUARDED[:6], ids=[p for _, p, _ in GUARDED[:6]])
def test_either_key_is_accepted(keyed, method, path, body):
    for key in ("first-key", "second-key"):
        r = call(keyed, method, path, body, key)
        assert r.status_code == 200, (key, r.text)


def test_probes_and_docs_need_no_key(keyed):
    for path in OPEN:
        assert httpx.get(f"{keyed.url}{path}").status_code == 200, path


def test_cors_preflight_needs_no_key(keyed):
    r = httpx.options(
        f"{keyed.url}/v1/completions",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 200


def test_the_scheme_is_case_insensitive(keyed):
    r = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "bearer second-key"})
    assert r.status_code == 200


def test_every_key_is_compared(monkeypatch):
    """No early exit on the first key that matches (or fails): the time taken does not tell
    which key, or how much of one, was right."""
    compared = []

    def compare(a, b):
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(auth.secrets, "compare_digest", compare)
    middleware = auth.AuthenticationMiddleware(None, ["a", "b", "c"])
    for token in ("a", "c", "z"):
        compared.clear()
        headers = httpx.Headers({"authorization": f"Bearer {token}"})
        assert middleware.authorized(headers) == (token != "z")
        assert len(compared) == 3
        assert all(len(a) == len(b) == 32 for a, b in compared)  # sha256 digests


@pytest.mark.parametrize(
    "flag, env, expected",
    [
        (None, {}, []),
        (["k1", "k2"], {"VLLM_API_KEY": "env"}, ["k1", "k2"]),  # the flag wins
        (None, {"VLLM_API_KEY": "env"}, ["env"]),
        (None, {"VLLM_API_KEY": "env", "JLLM_API_KEY": "jllm"}, ["env"]),
        (None, {"JLLM_API_KEY": "jllm"}, ["jllm"]),
        (None, {"VLLM_API_KEY": ""}, []),
    ],
)
def test_key_precedence(monkeypatch, flag, env, expected):
    for name in ("VLLM_API_KEY", "JLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert auth.api_keys(argparse.Namespace(api_key=flag)) == expected


def test_vllm_api_key_environment_variable(served, monkeypatch):
    running, args, metrics = served
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    server = RunningServer(build_app(args, running.engine, metrics), running.engine)
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        ok = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert ok.status_code == 200
    finally:
        server.stop()

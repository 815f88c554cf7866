"""The rest of vLLM's server surface: return_token_ids, /ping, /load with load tracking,
/tokenizer_info, GET /v1/models/{id}, SageMaker's /invocations, a Unix socket,
prompt_tokens_details, stream_options' rules, the 64-bit seed range, the metric families
vLLM has, and the flags accepted as documented no-ops."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args
from oracle import prompt_ids

from jllm.entrypoints.openai.api_server import build_app

IDS = prompt_ids(1, 40, seed=9)[0]
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def flagged(served, tmp_path_factory):
    """The same engine behind an app with the optional routes and details on, on a socket."""
    running, args, metrics = served
    flags = (
        "--enable-tokenizer-info-endpoint",
        "--enable-server-load-tracking",
        "--enable-prompt-tokens-details",
        "--api-server-count",
        "2",
        "--disable-frontend-multiprocessing",
        "--show-hidden-metrics-for-version",
        "0.31",
    )
    app = build_app(server_args(args.model, *flags), running.engine, metrics)
    uds = str(tmp_path_factory.mktemp("uds") / "jllm.sock")
    server = RunningServer(app, running.engine, uds=uds)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://jllm")
    yield client
    client.close()
    server.stop()


def post(server, path, body, **kwargs):
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kwargs)


def test_return_token_ids(server):
    body = {"model": MODEL_NAME, "prompt": IDS, "max_tokens": 5, "return_token_ids": True}
    body["temperature"] = 0
    r = post(server, "/v1/completions", body).json()
    (choice,) = r["choices"]
    assert choice["prompt_token_ids"] == IDS and len(choice["token_ids"]) == 5
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == IDS
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "return_token_ids": True}
    chat["temperature"] = 0
    r = post(server, "/v1/chat/completions", chat).json()
    want = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert r["prompt_token_ids"] == want and len(r["choices"][0]["token_ids"]) == 4
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**chat, "stream": True}
    ) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == want
    streamed = [t for c in chunks[1:] for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == r["choices"][0]["token_ids"]
    plain = post(server, "/v1/completions", {**body, "return_token_ids": None}).json()
    assert "token_ids" not in plain["choices"][0]


def test_probes_models_and_invocations(server):
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    card = httpx.get(f"{server.url}/v1/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    r = httpx.get(f"{server.url}/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    chat = post(server, "/invocations", {"messages": CHAT, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion"
    cmpl = post(server, "/invocations", {"prompt": "Hello", "max_tokens": 2}).json()
    assert cmpl["object"] == "text_completion"
    r = post(server, "/invocations", {"neither": 1})
    assert r.status_code == 400 and "suitable handler" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 404  # off by default


def test_flags_tokenizer_info_load_and_cached_tokens(flagged):
    info = flagged.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and "chat_template" in info
    body = {"model": MODEL_NAME, "prompt": IDS, "max_tokens": 30, "stream": True}
    with flagged.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))
        assert flagged.get("/load").json()["server_load"] == 1  # the stream in flight
        for _ in lines:
            pass
    # The response's end reaches the client before the server's middleware counts it done.
    deadline = time.monotonic() + 10
    while flagged.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flagged.get("/load").json()["server_load"] == 0
    first = flagged.post("/v1/completions", json={**body, "stream": False}).json()
    again = flagged.post("/v1/completions", json={**body, "stream": False}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # two full blocks
    assert "prompt_tokens_details" in first["usage"]
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2}
    r = flagged.post("/v1/chat/completions", json=chat).json()
    assert "cached_tokens" in r["usage"]["prompt_tokens_details"]


def test_stream_options_rules(server):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    r = post(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert post(server, "/v1/completions", {**body, "stream_options": {}}).status_code == 200
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, "stream_options": {}}
    r = post(server, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": False}})
    assert r.status_code == 400
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**chat, "stream": True}
    ) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert all(c.get("usage") is None for c in chunks)  # an empty object asks for no usage


@pytest.mark.parametrize(
    "seed, status", [(-1, 200), (2**63 - 1, 200), (-(2**63), 200), (2**63, 400)]
)
def test_the_64_bit_seed_range(server, seed, status):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "seed": seed}
    assert post(server, "/v1/completions", body).status_code == status
    if status == 200 and seed != -1:  # a fixed seed: the same sample twice
        body["temperature"] = 1.0
        a, b = (post(server, "/v1/completions", body).json() for _ in range(2))
        assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_top_logprobs_minus_one_is_the_vocabulary(server):
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, "logprobs": True}
    r = post(server, "/v1/chat/completions", {**chat, "top_logprobs": -1})
    assert r.status_code == 400 and "max" in r.json()["error"]["message"].lower()


def test_metric_families(server):
    post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3})
    text = httpx.get(f"{server.url}/metrics").text
    for family in (
        "vllm:request_inference_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_num_preemptions_count",
        "vllm:num_preemptions_total",
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"}',
        "vllm:cache_config_info{",
        'enable_prefix_caching="True"',
    ):
        assert family in text, family

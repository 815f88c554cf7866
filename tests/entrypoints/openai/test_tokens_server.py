"""Token-in/token-out (`/inference/v1/generate`, `--enable-scale-out`): the same tokens and
logprobs as `/v1/completions` for the same ids, streamed or not; sampling params refused by
name; aborts by id; and 403 on a server without the flag."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from oracle import prompt_ids

from jllm.entrypoints.openai.serving_tokens import npy_base64

IDS = prompt_ids(1, 12, seed=5)[0]


def completion(url, **params) -> dict:
    body = {"model": "tiny-llama", "prompt": IDS, "temperature": 0, **params}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]


def test_tokens_and_logprobs_match_completions(agent_server):
    params = {"temperature": 0, "max_tokens": 8, "logprobs": 2, "ignore_eos": True}
    body = {"token_ids": IDS, "sampling_params": params, "return_token_ids": True}
    r = httpx.post(f"{agent_server.url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    want = completion(agent_server.url, max_tokens=8, logprobs=2, ignore_eos=True)
    (choice,) = out["choices"]
    assert out["prompt_token_ids"] == IDS and "text" not in choice
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
    got = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert got == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    assert all(len(c["top_logprobs"]) >= 2 for c in choice["logprobs"]["content"])
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{agent_server.url}/inference/v1/generate", json=stream) as s:
        chunks = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    streamed = [t for p in parsed for ch in p["choices"] for t in ch["token_ids"]]
    assert streamed == choice["token_ids"]
    assert parsed[0]["prompt_token_ids"] == IDS and parsed[-1]["usage"]["completion_tokens"] == 8
    text = {**body, "output_mode": "text"}
    r = httpx.post(f"{agent_server.url}/inference/v1/generate", json=text, timeout=120).json()
    assert r["choices"][0]["text"] == want["text"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": "x"}, "temperature"),
        ({"tempreature": 0.5}, "tempreature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"structured_outputs": {"regex": "(("}}, "structured"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ],
)
def test_bad_sampling_params(agent_server, params, message):
    body = {"token_ids": IDS, "sampling_params": params}
    r = httpx.post(f"{agent_server.url}/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 400 and message in r.text, r.text


def test_without_the_flag_it_is_403(server):
    body = {"token_ids": IDS, "sampling_params": {}}
    r = httpx.post(f"{server.url}/inference/v1/generate", json=body)
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    r = httpx.post(f"{server.url}/inference/v1/abort_requests", json={"request_ids": ["a"]})
    assert r.status_code == 403


def test_routed_experts_travel_as_npy():
    experts = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    back = np.load(io.BytesIO(base64.b64decode(npy_base64(experts))), allow_pickle=False)
    assert back.dtype == np.uint8 and (back == experts).all()
    assert npy_base64(None) is None


HOSTILE = {
    "ids-empty": {"token_ids": [], "sampling_params": {}},
    "ids-negative": {"token_ids": [-1], "sampling_params": {}},
    "ids-huge": {"token_ids": [2**63], "sampling_params": {}},
    "ids-past-vocab": {"token_ids": [10**7], "sampling_params": {}},
    "ids-float": {"token_ids": [1.5], "sampling_params": {}},
    "ids-long": {"token_ids": [5] * 100_000, "sampling_params": {}},
    "params-missing": {"token_ids": [5]},
    "params-type": {"token_ids": [5], "sampling_params": [1]},
    "n-huge": {"token_ids": [5], "sampling_params": {"n": 2**40}},
    "logprobs-huge": {"token_ids": [5], "sampling_params": {"logprobs": 2**40}},
    "seed-huge": {"token_ids": [5], "sampling_params": {"seed": 2**70}},
    "stop-empty": {"token_ids": [5], "sampling_params": {"stop": [""]}},
    "grammar-bad": {"token_ids": [5], "sampling_params": {"structured_outputs": {"x": 1}}},
    "extra-args": {"token_ids": [5], "sampling_params": {"extra_args": [1]}},
    "mode": {"token_ids": [5], "sampling_params": {}, "output_mode": "logits"},
    "salt-empty": {"token_ids": [5], "sampling_params": {}, "cache_salt": ""},
}


def test_hostile_generate_requests_get_4xx_and_harm_nothing(agent_server):
    """Each is refused with OpenAI's error body (or served); the server stays healthy and a
    well-formed request answers as before."""
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    body = {"token_ids": IDS, "sampling_params": params}
    url = f"{agent_server.url}/inference/v1/generate"
    before = httpx.post(url, json=body, timeout=120).json()["choices"][0]["token_ids"]
    failures = []
    for name, hostile in HOSTILE.items():
        r = httpx.post(url, json=hostile, timeout=120)
        if r.status_code >= 500 or (
            r.status_code >= 400 and r.json().get("error", {}).get("code") != r.status_code
        ):
            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
    for raw in (b"null", b"[]", b"5", b"{", b'{"token_ids": "\xff"}'):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        if r.status_code != 400:
            failures.append(f"{raw!r}: {r.status_code}")
    assert not failures, "\n".join(failures)
    assert httpx.get(f"{agent_server.url}/health").status_code == 200
    after = httpx.post(url, json=body, timeout=120).json()["choices"][0]["token_ids"]
    assert after == before

"""The pooling routes on a live server against the offline engine and the oracles: the
`openai` client's embeddings (floats, and its default base64), /pooling, /classify, /score
and /rerank with vLLM's bodies; the generation routes are not mounted; hostile requests
get 4xx and harm nothing beside them."""

from __future__ import annotations

import asyncio
import base64

import httpx
import ml_dtypes
import numpy as np
import openai
import pytest
from openai_server import MODEL_NAME, serving
from pooling_oracle import hf_last_logits

from jllm.entrypoints.openai.serving_engine import OpenAIError

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def embed_server(st_model):
    with serving(st_model[0]) as running:
        yield running


@pytest.fixture(scope="module")
def cross_server(cross_encoder_dir):
    with serving(cross_encoder_dir) as running:
        yield running


def st_vectors(st_model, texts):
    return np.stack([st_model[1].encode(t) for t in texts])


def test_openai_client_embeddings(embed_server, st_model):
    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="x", max_retries=0)
    want = st_vectors(st_model, TEXTS)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], want, atol=2e-5)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == MODEL_NAME
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    default = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])  # base64 on the wire
    np.testing.assert_allclose(default.data[0].embedding, want[0], atol=2e-5)


def test_embedding_body_fields(embed_server, st_model):
    url = f"{embed_server.url}/v1/embeddings"
    ids = st_model[1].tokenizer.encode(TEXTS[1])
    body = {"input": [ids], "encoding_format": "base64", "embed_dtype": "bfloat16"}
    r = httpx.post(url, json=body, headers={"X-Request-Id": "mine"})
    assert r.status_code == 200 and r.json()["id"] == "embd-mine"
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), ml_dtypes.bfloat16)
    want = st_vectors(st_model, TEXTS[1:2])[0]
    np.testing.assert_allclose(raw.astype(np.float32), want, atol=1e-2)
    big = {"input": TEXTS[0], "encoding_format": "base64", "endianness": "big"}
    vec = np.frombuffer(
        base64.b64decode(httpx.post(url, json=big).json()["data"][0]["embedding"]), ">f4"
    )
    np.testing.assert_allclose(vec, st_vectors(st_model, TEXTS[:1])[0], atol=2e-5)
    cut = httpx.post(url, json={"input": TEXTS[1], "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 2
    chat = httpx.post(url, json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]


def test_pooling_and_score_routes(embed_server, st_model):
    base = embed_server.url
    pooled = httpx.post(f"{base}/pooling", json={"input": TEXTS[:2]}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    np.testing.assert_allclose(
        [d["data"] for d in pooled["data"]], st_vectors(st_model, TEXTS[:2]), atol=2e-5
    )
    score = httpx.post(f"{base}/score", json={"queries": "Hello", "documents": TEXTS}).json()
    q = st_model[1].encode("Hello")
    want = st_vectors(st_model, TEXTS) @ q
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=2e-5)
    assert score["id"].startswith("score-") and score["object"] == "list"
    rerank = httpx.post(
        f"{base}/v1/rerank", json={"query": "Hello", "documents": TEXTS, "top_n": 2}
    ).json()
    order = list(np.argsort(-want)[:2])
    assert [r["index"] for r in rerank["results"]] == order
    assert rerank["results"][0]["document"] == {"text": TEXTS[order[0]], "multi_modal": None}
    assert "object" not in rerank and rerank["usage"]["total_tokens"] > 0


def test_cross_encoder_routes(cross_server, cross_encoder_dir):
    base = cross_server.url
    score = httpx.post(f"{base}/score", json={"data_1": "Where?", "data_2": TEXTS}).json()
    classify = httpx.post(f"{base}/classify", json={"input": TEXTS}).json()
    assert [d["num_classes"] for d in classify["data"]] == [1, 1, 1]
    assert classify["data"][0]["label"] == "label_0"
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(
        f"{base}/classify", json={"messages": messages, "add_generation_prompt": True}
    )
    tokenizer = cross_server.engine.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text))
    r = httpx.post(f"{base}/v1/embeddings", json={"input": "a"})
    assert r.status_code == 404  # not mounted: the model is a classifier
    tokenizer = cross_server.engine.get_tokenizer()
    for text, d in zip(TEXTS, score["data"], strict=True):
        (logit,) = hf_last_logits(cross_encoder_dir, tokenizer.encode("Where?" + text))
        assert d["score"] == pytest.approx(1 / (1 + np.exp(-logit)), abs=2e-5)


def test_generation_routes_are_not_mounted(embed_server):
    r = httpx.post(
        f"{embed_server.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 404
    assert httpx.post(f"{embed_server.url}/classify", json={"input": "a"}).status_code == 404


HOSTILE = [
    ({"input": []}, 400, "at least one prompt"),
    ({"input": ""}, 400, "cannot be empty"),
    ({"input": [[10**9]]}, 400, "out of vocabulary"),
    ({"input": "a", "normalize": True}, 400, "`normalize` was removed"),
    ({"input": "a", "dimensions": 8}, 400, "does not support Matryoshka"),
    ({"input": "a", "model": "nope"}, 404, "does not exist"),
    ({"input": "a", "truncate_prompt_tokens": 10**6}, 400, "greater than max_model_len"),
    ({"input": "a", "encoding_format": "bytes"}, 400, None),
    ({"input": "a", "embed_dtype": "int8"}, 400, None),
    ({"input": "a", "priority": 5}, 400, "Priority scheduling is not enabled"),
    ({"input": "a" * 4000}, 400, "maximum context length"),
    ({"input": {"a": 1}}, 400, None),
    ({"input": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "not both"),
]


def test_hostile_embedding_requests(embed_server, st_model):
    url = f"{embed_server.url}/v1/embeddings"
    want = st_vectors(st_model, TEXTS[:1])[0]

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            good = client.post(url, json={"input": TEXTS[0], "encoding_format": "float"})
            bad = [client.post(url, json=body) for body, _, _ in HOSTILE]
            return await asyncio.gather(good, *bad)

    good, *bad = asyncio.run(run())
    np.testing.assert_allclose(good.json()["data"][0]["embedding"], want, atol=2e-5)
    for (body, status, message), r in zip(HOSTILE, bad, strict=True):
        assert r.status_code == status, (body, r.text)
        if status != 200:
            assert set(r.json()["error"]) >= {"message", "type", "code"}
            if message:
                assert message in r.json()["error"]["message"], (body, r.text)
    assert httpx.get(f"{embed_server.url}/health").status_code == 200


def test_openapi_document_lists_the_pooling_routes(embed_server):
    doc = httpx.get(f"{embed_server.url}/openapi.json")
    assert doc.status_code == 200
    paths = doc.json()["paths"]
    assert {"/v1/embeddings", "/pooling", "/score", "/rerank"} <= set(paths)
    assert "/v1/chat/completions" not in paths and "/classify" not in paths


class HeldStreams:
    """Wraps the engine's `generate` so every stream keeps its request id registered (its
    first output held) until `count` streams have started, or fails prompt number `fail`
    (of a request without a client id): the requests then overlap in the engine whatever the
    machine's speed.
    `closed` counts the streams that ended."""

    def __init__(self, server, count: int, monkeypatch, fail: int | None = None) -> None:
        self.generate, self.count, self.fail = server.engine.generate, count, fail
        self.ids: list[str] = []
        self.closed = 0
        self.gate: asyncio.Event | None = None  # made on the server's loop
        monkeypatch.setattr(server.engine, "generate", self.held)

    async def held(self, prompt, params, request_id, *args):
        self.gate = self.gate or asyncio.Event()
        stream = self.generate(prompt, params, request_id, *args)
        try:
            if request_id.split("-")[2] == str(self.fail):  # embd-{uuid}-{i}-...
                raise OpenAIError("a prompt failed", 500)
            try:
                first = await anext(stream)  # from here the id is the engine's until aclose
            except Exception:
                self.gate.set()  # refused by the engine: the others must not wait for it
                raise
            self.ids.append(request_id)
            if len(self.ids) == self.count:
                self.gate.set()
            await self.gate.wait()
            yield first
            async for out in stream:
                yield out
        finally:
            self.closed += 1
            await stream.aclose()


def test_a_client_request_id_twice_at_once(embed_server, monkeypatch):
    """Two requests with the same X-Request-Id (or body request_id) run side by side, as in
    vLLM: the engine's ids carry a random suffix, the responses the client's id."""
    held = HeldStreams(embed_server, 4, monkeypatch)
    url = f"{embed_server.url}/v1/embeddings"

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            header = {"X-Request-Id": "same"}
            return await asyncio.gather(
                client.post(url, json={"input": "a"}, headers=header),
                client.post(url, json={"input": "b"}, headers=header),
                client.post(url, json={"input": "a", "request_id": "mine"}),
                client.post(url, json={"input": "b", "request_id": "mine"}),
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert [r.json()["id"] for r in responses] == ["embd-same"] * 2 + ["embd-mine"] * 2
    assert len(set(held.ids)) == 4


def test_a_failed_prompt_stops_its_siblings(embed_server, monkeypatch):
    """The last of three prompts fails: the request answers 500 and the other two's engine
    requests are closed (aborted) before it does, not left running with nobody to read
    them."""
    held = HeldStreams(embed_server, 3, monkeypatch, fail=2)
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": TEXTS}, timeout=60)
    assert r.status_code == 500 and "a prompt failed" in r.text
    assert held.closed == 3


def test_created_is_the_requests_time(embed_server, monkeypatch):
    from jllm.entrypoints.openai.pooling import serving

    later = 4102444800  # 2100-01-01: no server started then
    monkeypatch.setattr(serving, "time", type("Clock", (), {"time": staticmethod(lambda: later)}))
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": "a"})
    assert r.json()["created"] == later

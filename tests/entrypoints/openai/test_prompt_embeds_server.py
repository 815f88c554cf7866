"""`prompt_embeds` on /v1/completions (vLLM's `--enable-prompt-embeds`) through the `openai`
client, against transformers generating from the same rows: torch.save and safetensors
payloads, several of them beside text prompts (embeddings first, as vLLM orders them),
streamed or not; malformed and malicious payloads get a 400 that names them, run nothing
and harm nothing beside them; a server without the flag refuses them."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle

import httpx
import openai
import pytest
import safetensors.torch
import torch
import transformers
from embeds_oracle import embeds_of, hf_from_embeds, payload
from openai_server import MODEL_NAME, serving
from oracle import prompt_ids

GREEDY = {"max_tokens": 6, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def embeds_server(llama_dir):
    with serving(llama_dir, "--enable-prompt-embeds") as running:
        yield running


@pytest.fixture(scope="module")
def client(embeds_server):
    return openai.OpenAI(base_url=f"{embeds_server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def hf(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def test_openai_client_matches_transformers(client, hf):
    a = embeds_of(hf, prompt_ids(1, 7, seed=1)[0], seed=1)
    b = embeds_of(hf, prompt_ids(1, 20, seed=2)[0], seed=2)
    wire_b = base64.b64encode(safetensors.torch.save({"embeds": b})).decode()
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        **GREEDY,
        extra_body={"prompt_embeds": [payload(a), wire_b], **EXTRA},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, embeds in zip(out.choices[:2], (a, b), strict=True):
        assert choice.token_ids == hf_from_embeds(hf, embeds, 6)[0]
    text = client.completions.create(
        model=MODEL_NAME, prompt="Hello", **GREEDY, extra_body=EXTRA
    ).choices[0]
    assert out.choices[2].text == text.text  # the text prompt comes after the embeddings
    assert out.usage.prompt_tokens == 7 + 20 + len(text.prompt_token_ids)


def test_alone_and_streamed(client, hf):
    embeds = embeds_of(hf, prompt_ids(1, 11, seed=3)[0], seed=3)
    want = hf_from_embeds(hf, embeds, 6)[0]
    body = {"prompt_embeds": payload(embeds), **EXTRA}
    full = client.completions.create(model=MODEL_NAME, prompt="", **GREEDY, extra_body=body)
    assert len(full.choices) == 1 and full.choices[0].token_ids == want
    assert full.choices[0].prompt_token_ids == [0] * 11  # vLLM's placeholders
    stream = client.completions.create(
        model=MODEL_NAME, prompt="", stream=True, **GREEDY, extra_body=body
    )
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/jllm-embeds-server-pwned",))


def hostile() -> list[tuple[dict, str]]:
    zeros = torch.zeros(3, 64)
    return [
        ({"prompt_embeds": "not base64!"}, "must be base64"),
        ({"prompt_embeds": base64.b64encode(pickle.dumps(RunsCode())).decode()}, "deserialized"),
        ({"prompt_embeds": payload({"x": RunsCode()})}, "prompt_embeds"),
        ({"prompt_embeds": payload(torch.zeros(3, 63))}, "hidden_size 63 does not match"),
        ({"prompt_embeds": payload(torch.full((3, 64), float("nan")))}, "must be finite"),
        ({"prompt_embeds": payload(torch.zeros(3, 64, dtype=torch.int64))}, "deserialized"),
        ({"prompt_embeds": payload(torch.zeros(700, 64))}, "maximum model length"),
        ({"prompt_embeds": payload(zeros), "echo": True}, "Echo is unsupported"),
        ({"prompt_embeds": payload(zeros), "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt_embeds": 5}, None),
        ({"prompt_embeds": []}, "Either prompt or prompt_embeds"),
        ({}, "Either prompt or prompt_embeds"),
    ]


def test_hostile_payloads_get_400_and_harm_nothing(embeds_server, client):
    marker = "/tmp/jllm-embeds-server-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    url = f"{embeds_server.url}/v1/completions"
    cases = hostile()
    good = {"model": MODEL_NAME, "prompt": "Hello", **GREEDY, **EXTRA}

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            bodies = [{"model": MODEL_NAME, "max_tokens": 2, **body} for body, _ in cases]
            return await asyncio.gather(
                http.post(url, json=good), *(http.post(url, json=b) for b in bodies)
            )

    first, *bad = asyncio.run(run())
    for (body, message), r in zip(cases, bad, strict=True):
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "code"}
        if message:
            assert message in error["message"], (body, r.text)
    assert not os.path.exists(marker)
    again = httpx.post(url, json=good, timeout=60)
    assert again.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]


def test_the_openapi_document_takes_a_prompt_or_embeddings(embeds_server, server):
    def completion_rules(url):
        doc = httpx.get(f"{url}/openapi.json", timeout=60).json()
        return doc["components"]["schemas"]["CompletionRequest"]

    rules = completion_rules(embeds_server.url)["allOf"][-1]["anyOf"]
    assert [r["required"] for r in rules] == [["prompt"], ["prompt_embeds"]]
    off = completion_rules(server.url)
    assert off["properties"]["prompt_embeds"]["type"] == "null"
    assert off["allOf"][-1]["required"] == ["prompt"]


def test_a_server_without_the_flag_refuses_them(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt_embeds": payload(torch.zeros(3, 64))},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
    )
    assert r.json()["error"]["param"] == "prompt_embeds"

"""The server's LoRA surface through the `openai` client: `--lora-modules` (both forms),
adapters in `/v1/models` with the base as parent, a request's `model` picking the adapter,
an unknown model a 404, and vLLM's runtime load/unload endpoints."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from lora_oracle import ADAPTERS
from openai_server import MODEL_NAME, RunningServer, server_args
from oracle import SMALL, prompt_ids

from jllm import LLM, BeamSearchParams, SamplingParams
from jllm.entrypoints.openai.api_server import build_app, build_engine
from jllm.lora.request import LoRARequest


@pytest.fixture(scope="module")
def lora_server(llama_dir, adapters):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    attn4 = json.dumps({"name": "attn4", "path": adapters["attn4"][0], "base_model_name": "x"})
    args = server_args(
        llama_dir,
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"all8={adapters['all8'][0]}",
        attn4,
    )
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    yield running
    running.stop()
    engine.shutdown()
    mp.undo()


def test_models_routing_and_runtime_updates(lora_server, adapters, llama_dir):
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "other-name", "all8", "attn4"}
    assert cards["all8"].parent == MODEL_NAME and cards["all8"].root == adapters["all8"][0]
    assert cards["attn4"].parent == "x"

    prompt = prompt_ids(1, 9, seed=3)[0]
    offline = LLM(llama_dir, enable_lora=True, max_loras=2, **SMALL)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def offline_text(name):
        lora = (
            None
            if name is None
            else LoRARequest(name, list(ADAPTERS).index(name) + 1, adapters[name][0])
        )
        return (
            offline.generate({"prompt_token_ids": prompt}, params, False, lora)[0].outputs[0].text
        )

    def served(model):
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.model == model  # the adapter's name, as vLLM reports it
        return out.choices[0].text

    assert served("all8") == offline_text("all8") != served(MODEL_NAME)

    def served_beams(model):
        out = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=4,
            n=2,
            temperature=0,
            extra_body={"use_beam_search": True, "ignore_eos": True},
        )
        assert out.model == model
        return [c.text for c in out.choices]

    # Every beam runs with the adapter the request names, as LLM.beam_search does.
    beam_params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    lora = LoRARequest("all8", list(ADAPTERS).index("all8") + 1, adapters["all8"][0])
    (want,) = offline.beam_search([{"prompt_token_ids": prompt}], beam_params, lora_request=lora)
    tok = offline.get_tokenizer()
    want_texts = [
        tok.decode(s.tokens[len(prompt) :], skip_special_tokens=True) for s in want.sequences
    ]
    assert served_beams("all8") == want_texts != served_beams(MODEL_NAME)
    assert served("attn4") == offline_text("attn4")
    assert served(MODEL_NAME) == offline_text(None)
    with pytest.raises(openai.NotFoundError, match="The model `mlp16` does not exist"):
        served("mlp16")

    def post(path, body):
        return httpx.post(f"{lora_server.url}/v1/{path}", json=body, timeout=60)

    r = post("load_lora_adapter", {"lora_name": "mlp16", "lora_path": adapters["mlp16"][0]})
    assert r.status_code == 200 and "added successfully" in r.text
    assert served("mlp16") == offline_text("mlp16")
    r = post("load_lora_adapter", {"lora_name": "mlp16", "lora_path": adapters["mlp16"][0]})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    r = post("load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent"})
    assert r.status_code == 404 and "No adapter found" in r.json()["error"]["message"]
    r = post("load_lora_adapter", {"lora_name": "bad", "lora_path": "/etc/hostname"})
    assert r.status_code == 400 and "is not a directory" in r.json()["error"]["message"]
    r = post("load_lora_adapter", {"lora_name": "tiny-llama", "lora_path": adapters["mlp16"][0]})
    assert r.status_code == 400 and "conflicts with a served base model" in r.text
    r = post("load_lora_adapter", {"lora_name": "nopath"})
    assert r.status_code == 400
    r = post("unload_lora_adapter", {"lora_name": "mlp16"})
    assert r.status_code == 200 and "removed successfully" in r.text
    r = post("unload_lora_adapter", {"lora_name": "mlp16"})
    assert r.status_code == 404
    with pytest.raises(openai.NotFoundError):
        served("mlp16")
    chat = client.chat.completions.create(
        model="all8", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.content is not None and chat.model == "all8"


def test_the_agent_routes_pick_the_adapter(lora_server):
    """Responses and Anthropic Messages name an adapter as chat does: the same greedy answer
    as chat with that adapter, and another than the base model's."""
    import anthropic

    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=lora_server.url, api_key="x", max_retries=0)
    question = [{"role": "user", "content": "Tell me a story."}]

    def chat(model: str) -> str:
        r = client.chat.completions.create(
            model=model, messages=question, max_tokens=8, temperature=0
        )
        return r.choices[0].message.content

    for model in ("all8", MODEL_NAME):
        r = client.responses.create(
            model=model, input=question[0]["content"], max_output_tokens=8, temperature=0
        )
        assert r.output_text == chat(model) and r.model == model
        m = claude.messages.create(
            model=model, max_tokens=8, messages=question, extra_body={"temperature": 0}
        )
        assert m.content[0].text == chat(model)
    assert chat("all8") != chat(MODEL_NAME)

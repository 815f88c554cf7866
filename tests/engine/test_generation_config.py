"""`generation_config` (vLLM's `--generation-config`): a model's generation_config.json sets
the sampling defaults of requests that leave those fields out, offline and in the server."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args
from oracle import SMALL

from jllm import LLM, SamplingParams
from jllm.engine.generation_config import generation_defaults, model_generation_config
from jllm.entrypoints.openai.api_server import build_app, build_engine
from jllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jllm.model_loader import resolve_model

GENERATION = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
    "do_sample": True,
    "eos_token_id": [2, 7],  # the tokenizer's EOS is 2
}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("gencfg") / "llama"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **GENERATION}))
    return str(path)


def test_generation_defaults(model_dir, llama_dir, tmp_path):
    own = model_generation_config(resolve_model(model_dir))
    assert generation_defaults("auto", own) == {**DEFAULTS, "max_tokens": 5}
    assert generation_defaults("vllm", own) == {}
    # A folder of its own: the model's file is not read.
    plain = model_generation_config(resolve_model(llama_dir))
    assert generation_defaults(model_dir, plain)["max_tokens"] == 5
    # transformers' own save (token ids only) sets no sampling default.
    assert generation_defaults("auto", plain) == {}
    # GGUF files carry no generation config.
    assert model_generation_config(resolve_model(None)) is None
    assert generation_defaults("auto", None) == {}
    with pytest.raises(ValueError, match="generation_config"):
        generation_defaults(str(tmp_path), own)


def test_offline_defaults(model_dir):
    llm = LLM(model_dir, **SMALL)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 5)
    assert llm.llm_engine.extra_stop_ids == {7}  # from the same file
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    # Explicit parameters win; "vllm" ignores the file.
    explicit = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, explicit, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 9
    plain = LLM(model_dir, generation_config="vllm", **SMALL).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)


def test_request_fields_fall_back_to_defaults():
    defaults = {**DEFAULTS, "max_tokens": 5}
    req = CompletionRequest(prompt="hi")
    params = req.sampling_params(req.max_tokens, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 5)  # min(16, 5)
    req = CompletionRequest(prompt="hi", temperature=0, top_k=-1, max_tokens=3)
    params = req.sampling_params(req.max_tokens, None, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0, 0, 3)  # -1: top-k off
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling_params(None, None, defaults).max_tokens == 5
    assert chat.sampling_params(None, None, {}).temperature == 1.0


def test_server_applies_model_defaults(model_dir):
    args = server_args(model_dir)
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(
            model=MODEL_NAME, prompt="Hello", max_tokens=12, extra_body={"ignore_eos": True}
        )
        assert got.usage.completion_tokens == 5  # the generation config's max_new_tokens
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"ignore_eos": True},
        )
        assert chat.usage.completion_tokens == 5
    finally:
        running.stop()
        engine.shutdown()

"""vLLM's development routes for RL on the real server, with the `openai` client beside
them: 404 without VLLM_SERVER_DEV_MODE=1; with it, a weight update through the safetensors
transfer (a file in the transfer directory; a name outside it refused), pause (a request
waits for resume, as vLLM queues it), sleep (a request waits for wake_up), the caches and
aborts, each with vLLM's JSON reply and every refusal a 400."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
import transformers
from openai_server import MODEL_NAME, RunningServer, server_args
from oracle import TINY, oracle_tokens, prompt_ids
from safetensors.numpy import save_file

from jllm.entrypoints.openai.api_server import build_app, build_engine

PROMPT = prompt_ids(1, 12, seed=11)[0]


@pytest.fixture(scope="module")
def dev(llama_dir, tmp_path_factory):
    transfer = tmp_path_factory.mktemp("transfer")
    config = json.dumps({"backend": "safetensors", "dir": str(transfer)})
    args = server_args(llama_dir, "--enable-sleep-mode", "--weight-transfer-config", config)
    engine, metrics = build_engine(args)
    mp = pytest.MonkeyPatch()
    plain = build_app(args, engine, metrics)
    mp.setenv("VLLM_SERVER_DEV_MODE", "1")
    running = RunningServer(build_app(args, engine, metrics), engine)
    mp.undo()
    yield running, plain, transfer
    running.stop()
    engine.shutdown()


def _complete(url: str, **extra):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0, **extra
    )


def test_without_the_flag_the_routes_do_not_exist(dev):
    from starlette.testclient import TestClient

    _, plain, _ = dev
    with TestClient(plain) as client:
        assert client.post("/pause").status_code == 404
        assert client.get("/weight_info").status_code == 404
        assert client.get("/server_info").status_code == 404


def test_server_info(dev, monkeypatch):
    server, _, _ = dev
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    info = httpx.get(f"{server.url}/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["model"] == server.engine.engine.args.model
    assert info["vllm_config"]["enable_sleep_mode"] is True
    assert (
        info["vllm_env"]["VLLM_LOGGING_LEVEL"] == "INFO" and "VLLM_API_KEY" not in info["vllm_env"]
    )
    assert info["system_env"]["jax_version"]
    text = httpx.get(f"{server.url}/server_info").json()
    assert isinstance(text["vllm_config"], str)


def test_a_weight_update_through_the_safetensors_transfer(dev, llama_dir):
    server, _, transfer = dev
    url = server.url
    with httpx.Client(base_url=url) as http:
        assert http.get("/weight_info").json() == {"weight_version": "default"}
        bad = http.post("/update_weights", json={"update_info": {"file": "x.safetensors"}})
        assert bad.status_code == 400 and "init_weight_transfer_engine" in bad.text
        r = http.post("/init_weight_transfer_engine", json={"init_info": {}})
        assert r.json() == {"message": "Weight transfer initialized"}
        assert http.post("/start_weight_update").json() == {"message": "Weight update started"}
        torch.manual_seed(1)
        config = transformers.LlamaConfig(**{"tie_word_embeddings": True, **TINY})
        b = transformers.LlamaForCausalLM(config).eval()
        save_file({k: v.numpy() for k, v in b.state_dict().items()}, transfer / "b.safetensors")
        escape = http.post("/update_weights", json={"update_info": {"file": "../b.safetensors"}})
        assert escape.status_code == 400  # and the session ended with it
        http.post("/start_weight_update")
        r = http.post("/update_weights", json={"update_info": {"file": "b.safetensors"}})
        assert r.json() == {"message": "Weights updated"}
        r = http.post("/finish_weight_update", json={"weight_version": "b"})
        assert r.json() == {"message": "Weight update finished"}
        assert http.get("/weight_info").json() == {"weight_version": "b"}
        r = http.post("/update_weight_version", json={"new_version": "b2"})
        assert r.json() == {"success": True, "new_version": "b2"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    want = tokenizer.decode(oracle_tokens(b, [PROMPT], 6)[0])
    assert _complete(url).choices[0].text == want


def test_a_request_waits_while_generation_is_paused(dev):
    server, _, _ = dev
    with httpx.Client(base_url=server.url) as http:
        assert http.post("/pause", params={"mode": "bogus"}).status_code == 400
        assert http.post("/pause", params={"mode": "abort"}).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        result = {}
        waiting = threading.Thread(target=lambda: result.update(out=_complete(server.url)))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive()
        assert http.post("/resume").json() == {"status": "resumed"}
        assert http.get("/is_paused").json() == {"is_paused": False}
        waiting.join(60)
    assert result["out"].choices[0].finish_reason == "length"


def test_a_request_waits_while_the_engine_sleeps(dev):
    server, _, _ = dev
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/sleep", params={"level": 1})
        assert r.json() == {"status": "sleeping", "level": 1}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        result = {}
        waiting = threading.Thread(target=lambda: result.update(out=_complete(server.url)))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive()
        r = http.post("/wake_up", params=[("tags", "weights")])
        assert r.json() == {"status": "sleeping", "tags": ["weights"]}
        assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
        waiting.join(60)
        assert result["out"].choices[0].finish_reason == "length"
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_caches_and_aborts(dev):
    server, _, _ = dev
    with httpx.Client(base_url=server.url) as http:
        assert http.post("/reset_prefix_cache").json() == {"success": True}
        r = http.post(
            "/reset_prefix_cache",
            params={"reset_running_requests": "true", "reset_external": "true"},
        )
        assert r.json() == {"success": True}
        assert http.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}
        assert http.post("/abort_requests", json=[1]).status_code == 400
        assert http.post("/release_kv_cache_memory").status_code == 400  # not paused
        http.post("/sleep", params={"level": 0})
        r = http.post("/release_kv_cache_memory")
        assert r.json() == {"status": "kv_cache_released"}
        assert http.post("/resume").status_code == 400  # asleep: wake_up resumes
        r = http.post("/wake_up", params=[("tags", "kv_cache"), ("tags", "scheduling")])
        assert r.json()["status"] == "awake"
    assert _complete(server.url).choices[0].finish_reason == "length"

"""Stopping the server: on SIGTERM a running request is aborted (its stream ends with a 503
error and [DONE]) and the process exits, instead of generating to its end first; under
`--shutdown-timeout` a request that finishes in time is left to finish, and new ones are
refused meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from openai_server import MODEL_NAME, free_port, wait_healthy

from jllm.entrypoints.openai.shutdown import SHUTTING_DOWN

# Seconds: failure bounds only (a hung server fails the test instead of hanging the suite).
BOUND = 60


@pytest.fixture(scope="module")
def long_llama_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with room for 32768 positions: a request without max_tokens generates
    for far longer than the test takes."""
    out = tmp_path_factory.mktemp("long-llama")
    for name in os.listdir(llama_dir):
        shutil.copy(os.path.join(llama_dir, name), out / name)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def sse_events(response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def test_sigterm_aborts_a_running_stream_and_exits(long_llama_dir):
    port = free_port()
    cmd = [
        *(sys.executable, "-m", "jllm.entrypoints.cli", "serve", long_llama_dir),
        *("--port", str(port), "--host", "127.0.0.1", "--enforce-eager"),
        *("--kv-cache-memory-bytes", str(32 << 20), "--max-num-batched-tokens", "64"),
        *("--max-num-seqs", "4", "--disable-log-stats"),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], timeout=120)
        body = {"prompt": "Once upon a time", "stream": True, "ignore_eos": True}  # no max_tokens
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=BOUND) as r:
            for event in sse_events(r):
                events.append(event)
                if len(events) == 3:  # generating
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"] == {
            "message": SHUTTING_DOWN,
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert proc.wait(timeout=BOUND) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log = proc.communicate(timeout=BOUND)[0]
    assert "Aborting 1 running request(s)." in log, log


def test_shutdown_timeout_lets_a_request_finish(server):
    """`stop_requests(timeout)` (the signal handler's work): a request that finishes within
    the timeout ends normally; one that arrives meanwhile is refused (503)."""
    engine = server.engine
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 24, "stream": True}
    began = threading.Event()

    async def stop() -> None:
        stopping = asyncio.ensure_future(engine.stop_requests(BOUND))
        await asyncio.sleep(0)  # it runs to its first wait: new requests are refused
        began.set()
        await stopping

    stopper = threading.Thread(target=asyncio.run, args=(stop(),))
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=BOUND) as r:
            events = sse_events(r)
            next(events)  # running
            stopper.start()
            assert began.wait(timeout=BOUND)
            late = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False})
            rest = list(events)
        stopper.join(timeout=BOUND)
        assert not stopper.is_alive()
    finally:
        engine.stopping = False  # the shared server serves the other tests
    assert late.status_code == 503 and late.json()["error"]["message"] == SHUTTING_DOWN
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"

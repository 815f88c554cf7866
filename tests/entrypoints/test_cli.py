"""The command line: `jllm serve --help` documents the flags, bad flags fail before the model
loads, and `python -m jllm.entrypoints.openai.api_server` serves a request end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
from openai_server import free_port, wait_healthy

JLLM = [sys.executable, "-m", "jllm.entrypoints.cli"]


def test_serve_help_lists_vllm_flags():
    out = subprocess.run([*JLLM, "serve", "--help"], capture_output=True, text=True, check=True)
    for flag in (
        "--port",
        "--api-key",
        "--served-model-name",
        "--chat-template",
        "--max-model-len",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "--block-size",
        "--dtype",
        "--uvicorn-log-level",
        "--max-log-len",
    ):
        assert flag in out.stdout, flag


def test_unsupported_flag_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [*JLLM, "serve", str(tmp_path), "--cpu-offload-gb", "4"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "--cpu-offload-gb is not supported" in out.stderr
    out = subprocess.run(
        [*JLLM, "serve", str(tmp_path), "--quantization", "int3"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "quantization must be one of" in out.stderr


def test_api_server_module_serves(llama_dir):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jllm.entrypoints.openai.api_server",
        "--model",
        llama_dir,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(16 << 20),
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--disable-log-stats",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc], timeout=120)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["model"] == llama_dir
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    for line in (
        "jllm API server version",
        "Loading weights took",
        "blocks:",
        f"Starting jllm API server on http://127.0.0.1:{port}",
    ):
        assert line in log, line

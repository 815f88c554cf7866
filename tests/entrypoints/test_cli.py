"""The command line: `jllm serve --help` documents the flags, bad flags fail before the model
loads, and `python -m jllm.entrypoints.openai.api_server` serves a request end to end."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx
import pytest
from openai_server import free_port, wait_healthy

from jllm.entrypoints.cli import main as cli
from jllm.logger import setup_logging


def test_serve_help_lists_vllm_flags(capsys):
    with pytest.raises(SystemExit) as done:
        cli(["serve", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
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
        assert flag in out, flag


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--cpu-offload-gb", "4"], "--cpu-offload-gb is not supported"),
        (["--quantization", "int3"], "quantization must be one of"),
    ],
)
def test_unsupported_flag_is_a_clear_error(tmp_path, caplog, monkeypatch, flags, error):
    """The error is logged and the command exits nonzero before any model loads (tmp_path
    holds none). Run in this process: `python -m jllm.entrypoints.cli serve` as a process
    is the quickstart notebook's server (tests/test_notebook.py)."""
    setup_logging()  # the server's handler, as `jllm serve` sets it up
    monkeypatch.setattr(logging.getLogger("jllm"), "propagate", True)
    with caplog.at_level(logging.ERROR, logger="jllm"), pytest.raises(SystemExit) as done:
        cli(["serve", str(tmp_path), *flags])
    assert done.value.code not in (0, None)
    assert error in caplog.text


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

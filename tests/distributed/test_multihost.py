"""Two processes on 127.0.0.1, two fake CPU devices each (gloo collectives), serve one model
with TP = 4 across both: the same greedy tokens as TP = 1, and a process that dies is
reported by process 0 instead of hanging it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openai_server import free_port, wait_healthy
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
PROMPTS = prompt_ids(3, 6) + prompt_ids(1, 30, seed=4)


def start(rank: int, model: str, port: int, mode: str) -> subprocess.Popen:
    cmd = [sys.executable, WORKER, str(rank), model, str(port), mode, json.dumps(PROMPTS)]
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("mode", ["generate", "slurm"])
def test_two_processes_tp4_equal_tp1(tiny_models, mode):
    model = tiny_models["llama-h8kv2"]
    port = free_port()
    procs = [start(rank, model, port, mode) for rank in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    got = json.loads(next(line for line in logs[0].splitlines() if line.startswith("TOKENS "))[7:])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = LLM(model, **SMALL).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    assert got == [o.outputs[0].token_ids for o in want]
    assert "Process 1 of 2: 2 local devices, 4 in all." in logs[1]
    assert "Process 0 stopped; process 1 is done." in logs[1]


def test_lost_process_is_reported(tiny_models):
    port = free_port()
    leader = start(0, tiny_models["llama-h8kv2"], port, "crash")
    follower = start(1, tiny_models["llama-h8kv2"], port, "crash")
    try:
        for line in leader.stdout:
            if line.startswith("READY"):
                break
        follower.kill()
        follower.wait(timeout=60)
        out, _ = leader.communicate("go\n", timeout=300)
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
    assert leader.returncode == 3, out
    assert "LOST Process(es) [1] of the cluster exited" in out


def test_server_over_two_processes(tiny_models):
    """`jllm serve` as process 0 and a headless follower: the API answers with TP = 1's
    greedy text, and stopping process 0 stops the follower."""
    import os

    import httpx

    model = tiny_models["llama-h8kv2"]
    port, api_port = free_port(), free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    common = [
        sys.executable,
        "-m",
        "jllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--tensor-parallel-size",
        "4",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(8 << 20),
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "128",
        "--disable-log-stats",
    ]
    procs = [
        subprocess.Popen(
            [*common, "--node-rank", str(rank), "--host", "127.0.0.1", "--port", str(api_port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        wait_healthy(f"http://127.0.0.1:{api_port}", procs, timeout=300)
        body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"http://127.0.0.1:{api_port}/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, got.text
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = LLM(model, **SMALL).generate({"prompt_token_ids": PROMPTS[3]}, params)
        assert got.json()["choices"][0]["text"] == want[0].outputs[0].text
        procs[0].terminate()
        assert procs[0].wait(timeout=60) is not None
        assert procs[1].wait(timeout=60) == 0, procs[1].stdout.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

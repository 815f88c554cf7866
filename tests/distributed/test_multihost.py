"""Two processes on 127.0.0.1, two fake CPU devices each (gloo collectives), serve one model
with TP = 4 across both: the same greedy tokens as TP = 1, and a process that dies is
reported by process 0 instead of hanging it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openai_server import free_port
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

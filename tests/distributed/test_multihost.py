"""Two processes on 127.0.0.1, two fake CPU devices each (gloo collectives), serve one model
with TP = 4 across both, or as two pipeline stages (PP = 2 x TP = 2): the same greedy tokens
as one process, and a process that dies is reported by process 0 instead of hanging it (the
server then fails requests and answers 503 on /health)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lora_oracle import make_adapters
from openai_server import free_port, wait_healthy
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
# The last is one token past two blocks: under n = 2 its second child hits the first's blocks
# in the step that writes them.
PROMPTS = prompt_ids(3, 6) + prompt_ids(1, 30, seed=4) + prompt_ids(1, 33, seed=6)


def start(rank: int, model: str, port: int, mode: str, env=None, stdout=None) -> subprocess.Popen:
    cmd = [sys.executable, WORKER, str(rank), model, str(port), mode, json.dumps(PROMPTS)]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=stdout or subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def run_two(model: str, mode: str, env=None) -> tuple[list, list[str]]:
    """Both processes to the end: (process 0's TOKENS, the two logs)."""
    port = free_port(span=2)  # the coordinator and the step channel
    procs = [start(rank, model, port, mode, env) for rank in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    got = json.loads(next(line for line in logs[0].splitlines() if line.startswith("TOKENS "))[7:])
    return got, logs


@pytest.fixture(scope="module")
def one_process(tiny_models):
    """The model the two processes serve, in this one process: what they must equal."""
    return LLM(tiny_models["llama-h8kv2"], **SMALL)


def test_two_stages_equal_one_until_one_is_lost(tiny_models, one_process, tmp_path):
    """Two pipeline stages, one per process, with the cluster from Slurm: one process's
    tokens. Then process 1, which holds the second stage, dies: process 0 reports it (the
    same path as under TP: its step cannot be sent). (TP = 4 across both with explicit
    addresses, and a follower that stops with process 0: test_lora_across_processes.)"""
    model = tiny_models["llama-h8kv2"]
    port = free_port(span=2)  # the coordinator and the step channel
    follower_out = tmp_path / "follower.log"  # a file: nobody reads it while process 0 runs
    with open(follower_out, "w") as f:
        leader = start(0, model, port, "slurm+crash-pp")
        follower = start(1, model, port, "slurm+crash-pp", stdout=f)
    lines = []
    try:
        for line in leader.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        follower.kill()
        follower.wait(timeout=60)
        out, _ = leader.communicate("go\n", timeout=300)
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
    follower_log = follower_out.read_text()
    log = "".join(lines) + out
    assert leader.returncode == 3, log
    got = json.loads(next(line for line in lines if line.startswith("TOKENS "))[7:])
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    want = one_process.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert got == [[c.token_ids for c in o.outputs] for o in want]
    assert "STAGES [[0], [1]]" in log  # one stage per process
    assert "Process 1 of 2: 2 local devices, 4 in all." in follower_log
    assert "LOST Process(es) [1] of the cluster exited" in out


def test_lora_across_processes(tiny_models, tmp_path, one_process):
    """TP = 4 over two processes with explicit addresses and a LoRA adapter on half the
    prompts: process 1 writes the adapter's slot from the step message, so both give one
    process's tokens (process 0 used to write it alone: process 1 ran its shards of the
    layers without the adapter), and the prompts without it one process's without LoRA."""
    import os

    model = tiny_models["llama-h8kv2"]
    adapter = make_adapters(model, tmp_path, names=("all8",))["all8"][0]
    got, logs = run_two(model, "lora", {**os.environ, "JLLM_TEST_ADAPTER": adapter})
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    lora = LoRARequest("a", 1, adapter)
    llm = LLM(model, enable_lora=True, max_loras=1, max_lora_rank=8, **SMALL)
    want = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        params,
        use_tqdm=False,
        lora_request=[lora if i % 2 == 0 else None for i in range(len(PROMPTS))],
    )
    plain = one_process.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    plain = [[c.token_ids for c in o.outputs] for o in plain]
    assert got == [[c.token_ids for c in o.outputs] for o in want]
    assert got[1::2] == plain[1::2]
    assert got[0][0] != plain[0][0]  # the adapter changes the answer
    assert "STAGES [[0, 1]]" in logs[0]  # one stage over both processes
    assert "Process 1 of 2: 2 local devices, 4 in all." in logs[1]
    assert "Process 0 stopped; process 1 is done." in logs[1]


def serve_two(model: str, parallel: list[str], nodes=None) -> tuple[list[subprocess.Popen], str]:
    """`jllm serve` as process 0 and a headless follower, up and healthy: (the processes,
    the API's URL). `nodes(port, rank)`: each process's cluster flags (default: jllm's
    --nnodes, --node-rank and master address)."""
    import os

    port, api_port = free_port(span=2), free_port()  # the coordinator, the step channel
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

    def jllm_nodes(port, rank):
        return ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)] + [
            "--node-rank",
            str(rank),
        ]

    nodes = nodes or jllm_nodes
    common = [
        sys.executable,
        "-m",
        "jllm.entrypoints.openai.api_server",
        "--model",
        model,
        *parallel,
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
            [*common, *nodes(port, rank), "--host", "127.0.0.1", "--port", str(api_port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    url = f"http://127.0.0.1:{api_port}"
    try:
        wait_healthy(url, procs, timeout=300)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs, url


def complete(url: str, one_process):
    """One greedy completion of PROMPTS[3] and what one process gives for it."""
    import httpx

    body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = one_process.generate({"prompt_token_ids": PROMPTS[3]}, params, use_tqdm=False)
    return got, want[0].outputs[0].text


def test_server_loses_a_stage(tiny_models, one_process):
    """`jllm serve` as process 0 and a headless follower, two pipeline stages, one per
    process: the API answers with one process's greedy text; once the second stage's
    process dies, a request fails with a 503 that says so (it does not hang), /health
    answers 503, and process 0 still stops when asked. (That a follower stops with process
    0: test_lora_across_processes.)"""
    import httpx

    model = tiny_models["llama-h8kv2"]
    parallel = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    procs, url = serve_two(model, parallel)
    try:
        got, want = complete(url, one_process)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want
        procs[1].kill()
        procs[1].wait(timeout=60)
        body = {"prompt": PROMPTS[0], "max_tokens": 4}
        lost = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert lost.status_code == 503, lost.text
        assert "Process(es) [1] of the cluster exited" in lost.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        procs[0].terminate()
        assert procs[0].wait(timeout=60) is not None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_data_parallel_shards_on_two_processes(tiny_models, one_process):
    """DP = 2 x TP = 2, one data shard per process, launched with vLLM's multi-node
    data-parallel flags (the second node --headless): concurrent completions answer as one
    process, both shards served some (their metrics under engine 0 and 1), and process 0
    reads the other process's shard's results (gathered in the step)."""
    import concurrent.futures

    import httpx

    def vllm_nodes(port, rank):
        flags = ["--data-parallel-size-local", "1", "--data-parallel-start-rank", str(rank)]
        flags += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)]
        return flags + (["--headless"] if rank else [])

    model = tiny_models["llama-h8kv2"]
    parallel = ["--data-parallel-size", "2", "--tensor-parallel-size", "2"]
    procs, url = serve_two(model, parallel, vllm_nodes)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = PROMPTS[:4]
    want = one_process.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def complete(prompt):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, prompts))
        assert got == [o.outputs[0].text for o in want]
        text = httpx.get(f"{url}/metrics", timeout=30).text
        queries = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:prefix_cache_queries_total")
        ]
        assert len(queries) == 2 and all(q > 0 for q in queries), text
        procs[0].terminate()
        procs[0].wait(timeout=60)
        out = procs[1].communicate(timeout=120)[0]
        assert "Process 1 of 2: 2 local devices, 4 in all." in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

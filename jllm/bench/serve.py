"""`jllm bench serve`: a client against any OpenAI-compatible server (jllm's or vLLM's):
`--num-prompts` streamed completions sent at `--request-rate` (Poisson arrivals; `inf`: all
at once), at most `--max-concurrency` in flight, reporting vLLM's serving result block (time
to first token, time per output token after the first, inter-token latency, end-to-end
latency: mean, median and `--metric-percentiles`) and, with `--save-result`, its JSON.

As vLLM measures them: TTFT is the time to the first streamed chunk with choices, ITL the
gap before each later one, the latency the time to the last one, TPOT (latency - TTFT) /
(output tokens - 1), with the output tokens from the stream's `usage`
(`stream_options.include_usage`). Requests go out as token ids, from a
standard-library HTTP client on threads (no other dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from tqdm import tqdm

from jllm.bench.datasets import random_requests, sharegpt_requests


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm"])
    parser.add_argument("--base-url", default=None, help="Server URL (instead of host/port).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="Model name (default: the server's).")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer for datasets (a path).")
    parser.add_argument("--dataset-name", default="random", choices=["sharegpt", "random"])
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=None, help="--random-input-len")
    parser.add_argument("--output-len", type=int, default=None, help="--random-output-len")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", type=int, default=0)
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1: Poisson.")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--save-detailed", action="store_true", help="Also save per-request lists.")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    parser.add_argument("--metric-percentiles", default="99")


@dataclass
class Outcome:
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""


def _post_stream(url: str, body: dict, outcome: Outcome, timeout: float = 6 * 3600) -> None:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    start = last = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                usage = chunk.get("usage")
                if usage:
                    outcome.output_tokens = usage.get("completion_tokens", 0)
                choices = chunk.get("choices")
                if not choices:
                    continue
                now = time.perf_counter()
                if not outcome.success:
                    outcome.ttft, outcome.success = now - start, True
                else:
                    outcome.itl.append(now - last)
                last = now
                outcome.text += "".join(c.get("text", "") for c in choices)
        outcome.latency = last - start
        if not outcome.success:
            outcome.error = "no chunk with choices arrived"
    except (urllib.error.URLError, OSError, ValueError) as e:
        outcome.error = str(e)


def _server_model(base: str) -> str:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def run(args, requests) -> dict:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model or _server_model(base)
    url = base + args.endpoint
    rng = np.random.default_rng(args.seed)
    outcomes = [Outcome() for _ in requests]
    gate = threading.Semaphore(args.max_concurrency or len(requests))
    bar = None if args.disable_tqdm else tqdm(total=len(requests))

    def send(i: int) -> None:
        with gate:
            r = requests[i]
            body = {
                "model": model,
                "prompt": r.prompt_token_ids,
                "max_tokens": r.expected_output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": args.ignore_eos,
            }
            _post_stream(url, body, outcomes[i])
            if bar is not None:
                bar.update(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(min(len(requests), 256)) as pool:
        for i in range(len(requests)):
            pool.submit(send, i)
            if args.request_rate != float("inf"):
                theta = 1.0 / (args.request_rate * args.burstiness)
                time.sleep(rng.gamma(args.burstiness, theta))
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return summarize(args, model, requests, outcomes, duration)


def summarize(args, model, requests, outcomes, duration) -> dict:
    done = [(r, o) for r, o in zip(requests, outcomes, strict=True) if o.success]
    out_lens = [o.output_tokens or len(o.itl) + 1 for _, o in done]
    ttfts = [o.ttft for _, o in done]
    tpots = [
        (o.latency - o.ttft) / (n - 1) for (_, o), n in zip(done, out_lens, strict=True) if n > 1
    ]
    itls = [t for _, o in done for t in o.itl]
    e2els = [o.latency for _, o in done]
    total_in = sum(r.prompt_len for r, _ in done)
    total_out = sum(out_lens)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(done),
        "failed": len(requests) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "latencies": e2els,
        "input_lens": [r.prompt_len for r, _ in done],
        "output_lens": out_lens,
        "ttfts": ttfts,
        "itls": [o.itl for _, o in done],
        "generated_texts": [o.text for _, o in done],
        "errors": [o.error for o in outcomes if not o.success],
    }
    line = "{:<40} {:<10}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(line.format("Successful requests:", len(done)))
    print(line.format("Failed requests:", len(requests) - len(done)))
    number = "{:<40} {:<10.2f}"
    if args.max_concurrency is not None:
        print(line.format("Maximum request concurrency:", args.max_concurrency))
    if args.request_rate != float("inf"):
        print(number.format("Request rate configured (RPS):", args.request_rate))
    print(number.format("Benchmark duration (s):", duration))
    print(line.format("Total input tokens:", total_in))
    print(line.format("Total generated tokens:", total_out))
    print(number.format("Request throughput (req/s):", result["request_throughput"]))
    print(number.format("Output token throughput (tok/s):", result["output_throughput"]))
    print(number.format("Total token throughput (tok/s):", result["total_token_throughput"]))
    selected = args.percentile_metrics.split(",")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    metrics = {
        "ttft": ("TTFT", "Time to First Token", ttfts),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)", tpots),
        "itl": ("ITL", "Inter-token Latency", itls),
        "e2el": ("E2EL", "End-to-end Latency", e2els),
    }
    for key, (name, header, values) in metrics.items():
        if key not in selected:
            continue
        values = np.asarray(values or [0.0]) * 1000
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        result[f"mean_{key}_ms"] = float(values.mean())
        result[f"median_{key}_ms"] = float(np.median(values))
        result[f"std_{key}_ms"] = float(values.std())
        print(number.format(f"Mean {name} (ms):", result[f"mean_{key}_ms"]))
        print(number.format(f"Median {name} (ms):", result[f"median_{key}_ms"]))
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            result[f"p{word}_{key}_ms"] = float(np.percentile(values, p))
            print(number.format(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"]))
    print("=" * 50)
    return result


def main(args: argparse.Namespace) -> dict:
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.dataset_name == "random":
        requests = random_requests(
            args.num_prompts,
            args.input_len or args.random_input_len,
            args.output_len or args.random_output_len,
            tokenizer,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    else:
        output_len = args.sharegpt_output_len or args.output_len
        requests = sharegpt_requests(
            args.num_prompts, tokenizer, args.dataset_path, output_len, args.seed
        )
    result = run(args, requests)
    if args.save_result:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps{concurrency}-"
            f"{os.path.basename(result['model_id'].rstrip('/'))}-{result['date']}.json"
        )
        saved = dict(result)
        if not args.save_detailed:
            for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
                saved.pop(key)
        path = os.path.join(args.result_dir or ".", name)
        with open(path, "w") as f:
            json.dump(saved, f)
    return result

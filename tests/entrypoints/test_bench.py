"""`jllm bench latency|throughput|serve` on a tiny model: vLLM's printed lines and saved JSON
keys, the datasets' token counts, and the serving client against a real jllm server."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from openai_server import RunningServer, server_args

from jllm.bench.datasets import random_requests, sharegpt_requests
from jllm.entrypoints.cli import main as cli


def run(argv: list[str]) -> str:
    """`jllm` with `argv`; what it printed (stdout only: the engine logs to stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(argv)
    return out.getvalue()


SMALL_ENGINE = [
    "--enforce-eager",
    "--max-model-len",
    "128",
    "--num-gpu-blocks-override",
    "64",
    "--dtype",
    "float32",
]


def test_latency(llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    printed = run(
        [
            "bench",
            "latency",
            "--model",
            llama_dir,
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "3",
            "--output-json",
            str(out),
            *SMALL_ENGINE,
        ]
    )
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    result = json.loads(out.read_text())
    assert set(result) == {"model_id", "avg_latency", "latencies", "percentiles"}
    assert len(result["latencies"]) == 3 and result["avg_latency"] > 0


def test_throughput_random_and_sharegpt(llama_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "throughput.json"
    printed = run(
        [
            "bench",
            "throughput",
            "--model",
            llama_dir,
            "--dataset-name",
            "random",
            "--num-prompts",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--output-json",
            str(out),
            *SMALL_ENGINE,
        ]
    )
    assert "Throughput:" in printed and "Total num prompt tokens:  64" in printed
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4 and result["total_num_tokens"] == 4 * (16 + 4)
    assert set(result) == {
        "model_id",
        "elapsed_time",
        "num_requests",
        "total_num_tokens",
        "requests_per_second",
        "tokens_per_second",
    }
    data = tmp_path / "sharegpt.json"
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "hello there, how are you doing?"},
                {"from": "gpt", "value": "fine thanks, and you today?"},
            ]
        },
        {"conversations": [{"from": "human", "value": "too short"}]},  # one turn: dropped
    ]
    data.write_text(json.dumps(conversations))
    printed = run(
        [
            "bench",
            "throughput",
            "--model",
            llama_dir,
            "--dataset-path",
            str(data),
            "--num-prompts",
            "2",
            "--output-len",
            "3",
            *SMALL_ENGINE,
        ]
    )
    assert "Total num output tokens:  6" in printed


def test_datasets(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reqs = random_requests(8, 100, 10, tok, range_ratio=0.5, prefix_len=5, seed=1)
    assert all(55 <= r.prompt_len <= 155 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:5]) for r in reqs}) == 1  # the shared prefix
    special = set(tok.all_special_ids)
    assert not special & {t for r in reqs for t in r.prompt_token_ids}
    shaped = sharegpt_requests(50, tok, seed=2)
    assert all(
        4 <= r.prompt_len <= 1024 and r.prompt_len + r.expected_output_len <= 2048 for r in shaped
    )
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 10, 10, tok, range_ratio=1.5)


def test_serve_against_a_jllm_server(llama_dir, tmp_path):
    from jllm.entrypoints.openai.api_server import build_app, build_engine

    args = server_args(llama_dir)
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    try:
        printed = run(
            [
                "bench",
                "serve",
                "--base-url",
                running.url,
                "--num-prompts",
                "4",
                "--random-input-len",
                "12",
                "--random-output-len",
                "5",
                "--ignore-eos",
                "--max-concurrency",
                "2",
                "--save-result",
                "--save-detailed",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "r.json",
                "--metric-percentiles",
                "50,99",
                "--disable-tqdm",
            ]
        )
    finally:
        running.stop()
        engine.shutdown()
    assert "Serving Benchmark Result" in printed and "P99 TTFT (ms):" in printed
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["output_lens"] == [5] * 4 and result["total_input_tokens"] == 48
    assert all(len(itl) == 4 for itl in result["itls"])  # one gap per later token
    for key in ("mean_ttft_ms", "p50_tpot_ms", "p99_itl_ms", "request_throughput"):
        assert result[key] > 0

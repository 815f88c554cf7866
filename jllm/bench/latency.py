"""`jllm bench latency`: the time to run one batch of `--batch-size` prompts of `--input-len`
random tokens to `--output-len` tokens, over `--num-iters` iterations after warm-up; the
engine's flags as `jllm serve` takes them (prefix caching off by default, as vLLM's
command sets it: repeated batches would hit the cache)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from jllm.engine.arg_utils import add_engine_args, engine_args_from_namespace

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    parser.add_argument("--use-beam-search", action="store_true")
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--output-json", default=None, help="Save the latencies as JSON here.")
    parser.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Do not detokenize the outputs (leave detokenization out of the latency).",
    )
    add_engine_args(parser)
    parser.set_defaults(enable_prefix_caching=False)


def main(args: argparse.Namespace) -> dict:
    from jllm import LLM, SamplingParams
    from jllm.sampling_params import BeamSearchParams

    llm = LLM.from_engine_args(engine_args_from_namespace(args))
    if llm.llm_engine.max_model_len < args.input_len + args.output_len:
        raise ValueError("max_model_len must hold input_len + output_len.")
    params = SamplingParams(
        n=args.n,
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=args.output_len,
        detokenize=not args.disable_detokenize,
    )
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": ids}
        for ids in rng.integers(0, 10000, (args.batch_size, args.input_len)).tolist()
    ]

    def run_once() -> float:
        start = time.perf_counter()
        if args.use_beam_search:
            beam = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)
            llm.beam_search(prompts, beam)
        else:
            llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    print("Warming up...")
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        run_once()
    latencies = np.array([run_once() for _ in tqdm(range(args.num_iters), desc="Bench iterations")])
    percentiles = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for pct, value in zip(PERCENTAGES, percentiles, strict=True):
        print(f"{pct}% percentile latency: {value} seconds")
    results = {
        "model_id": args.model,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTAGES, percentiles, strict=True)},
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=4)
    return results

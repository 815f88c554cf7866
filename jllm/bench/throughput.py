"""`jllm bench throughput`: offline throughput of `--num-prompts` requests from a dataset
(`bench/datasets.py`: random, or ShareGPT from `--dataset-path` or its shape), all submitted
at once to `LLM.generate`; vLLM's flags, printout and `--output-json`."""

from __future__ import annotations

import argparse
import json
import time

from jllm.bench.datasets import random_requests, sharegpt_requests
from jllm.engine.arg_utils import add_engine_args, engine_args_from_namespace


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="vllm", choices=["vllm"], help="jllm's engine.")
    parser.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "random"])
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="A ShareGPT JSON file; without it, synthetic requests of ShareGPT's shape.",
    )
    parser.add_argument("--input-len", type=int, default=None, help="Prompt tokens (random).")
    parser.add_argument(
        "--output-len", type=int, default=None, help="Output tokens; overrides the dataset's."
    )
    parser.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--num-warmups", type=int, default=0, help="Warm-up prompts first.")
    parser.add_argument("--prefix-len", type=int, default=0, help="Shared prefix (random).")
    parser.add_argument("--random-input-len", type=int, default=None)
    parser.add_argument("--random-output-len", type=int, default=None)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--disable-detokenize", action="store_true")
    add_engine_args(parser)


def requests_of(args, tokenizer, vocab_size: int):
    if args.dataset_name == "random" or (args.dataset_path is None and args.input_len):
        return random_requests(
            args.num_prompts,
            args.random_input_len or args.input_len or 1024,
            args.random_output_len or args.output_len or 128,
            tokenizer,
            args.random_range_ratio,
            args.random_prefix_len or args.prefix_len,
            args.seed or 0,
            vocab_size,
        )
    return sharegpt_requests(
        args.num_prompts, tokenizer, args.dataset_path, args.output_len, args.seed or 0, vocab_size
    )


def run(llm, requests, n: int = 1, detokenize: bool = True, warmups=()) -> float:
    """Seconds to generate every request (after `warmups`, untimed)."""
    from jllm import SamplingParams

    def params(r):
        return SamplingParams(
            n=n,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=r.expected_output_len,
            detokenize=detokenize,
        )

    if warmups:
        llm.generate(
            [{"prompt_token_ids": r.prompt_token_ids} for r in warmups],
            [params(r) for r in warmups],
            use_tqdm=False,
        )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    llm.generate(prompts, [params(r) for r in requests], use_tqdm=True)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> dict:
    from jllm import LLM

    llm = LLM.from_engine_args(engine_args_from_namespace(args))
    vocab = llm.llm_engine.model_config.vocab_size
    requests = requests_of(args, llm.get_tokenizer(), vocab)
    warmups = requests[: args.num_warmups]
    elapsed = run(llm, requests, args.n, not args.disable_detokenize, warmups)
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.expected_output_len for r in requests) * args.n
    total = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(requests) / elapsed:.2f} requests/s, "
        f"{total / elapsed:.2f} total tokens/s, {output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    results = {
        "model_id": args.model,
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=4)
    return results

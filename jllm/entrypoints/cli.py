"""The `jllm` command: `jllm serve [MODEL] [flags]` starts the OpenAI-compatible server;
`jllm convert MODEL OUT` saves a model as jllm's orbax checkpoint (`entrypoints/convert.py`);
`jllm bench latency|throughput|serve` benchmarks as vLLM's `vllm bench` does (`jllm/bench/`)."""

from __future__ import annotations

import argparse
import logging

import jllm
from jllm.entrypoints.openai.cli_args import make_arg_parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jllm", description="jllm command line.")
    parser.add_argument("-v", "--version", action="version", version=jllm.__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "model_tag", nargs="?", default=None, help="The model (same as --model; optional)."
    )
    make_arg_parser(serve)
    from jllm.entrypoints import convert

    convert.add_parser(commands)
    _add_bench(commands)
    args = parser.parse_args(argv)
    if args.command == "convert":
        logging.basicConfig(level=logging.INFO)
        convert.main(args)
        return
    if args.command == "bench":
        args.run(args)
        return
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error("give the model either positionally or with --model, not both")
        args.model = args.model_tag
    from jllm.entrypoints.openai.api_server import main as serve_main

    serve_main(args=args)


def _add_bench(commands) -> None:
    """`jllm bench latency|throughput|serve` (jllm/bench/), vLLM's flags."""
    from jllm.bench import latency, serve, throughput

    bench = commands.add_parser("bench", help="Benchmark latency, throughput or a server.")
    subs = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text in (
        ("latency", latency, "The latency of one batch of requests."),
        ("throughput", throughput, "Offline throughput over a dataset."),
        ("serve", serve, "An OpenAI-compatible server under load (jllm's or vLLM's)."),
    ):
        sub = subs.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_cli_args(sub)
        sub.set_defaults(run=module.main)


if __name__ == "__main__":
    main()

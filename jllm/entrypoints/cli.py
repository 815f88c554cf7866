"""The `jllm` command: `jllm serve [MODEL] [flags]` starts the OpenAI-compatible server;
`jllm convert MODEL OUT` saves a model as jllm's orbax checkpoint (`entrypoints/convert.py`)."""

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
    args = parser.parse_args(argv)
    if args.command == "convert":
        logging.basicConfig(level=logging.INFO)
        convert.main(args)
        return
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error("give the model either positionally or with --model, not both")
        args.model = args.model_tag
    from jllm.entrypoints.openai.api_server import main as serve_main

    serve_main(args=args)


if __name__ == "__main__":
    main()

"""The server's command line: vLLM's server flags plus every engine argument under its vLLM
flag name (see `jllm.engine.arg_utils`)."""

from __future__ import annotations

import argparse
import json

from jllm.engine.arg_utils import add_engine_args
from jllm.entrypoints.openai.serving_models import parse_lora_module
from jllm.entrypoints.openai.tool_parsers import TOOL_PARSERS


def _json_list(value: str) -> list[str]:
    items = json.loads(value)
    if not isinstance(items, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return items


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        description="jllm OpenAI-compatible API server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = parser.add_argument_group("server arguments")
    server.add_argument("--host", default=None, help="Host name to bind (default: all).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument(
        "--headless",
        action="store_true",
        help="vLLM's secondary nodes: no API, only process 0's steps (every node but node 0 "
        "runs so; node 0 serves the API and cannot be headless).",
    )
    server.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="Require one of these keys in 'Authorization: Bearer <key>' on every route but "
        "/health, /ping, /version, /load, /metrics and the API docs. Default: the "
        "VLLM_API_KEY environment variable, else JLLM_API_KEY.",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) the API answers to; the first is the one reported. "
        "Default: the --model argument (or 'HuggingFaceTB/SmolLM2-135M-Instruct' for the "
        "embedded model).",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        help="LoRA adapters to serve (needs --enable-lora): name=path, or the JSON form "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'. A request\'s model picks one.',
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="Chat template: a file path or the Jinja template itself; default: the model's.",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Render a chat template sent in a request (chat_template, or "
        "chat_template_kwargs' chat_template); otherwise such a request is refused (400).",
    )
    server.add_argument(
        "--response-role",
        default="assistant",
        help="Role of generated messages when add_generation_prompt is true.",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model call tools on its own (tool_choice "auto", the default when a '
        "request has tools); needs --tool-call-parser.",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="How tool calls are read from the model's text: 'hermes' (Qwen2.5/Qwen3, Hermes), "
        "'llama3_json' (Llama 3.1+), 'mistral', 'pythonic', 'qwen3_coder'/'qwen3_xml' (Qwen3 "
        "Coder's XML calls), 'deepseek_v3' or 'openai' (gpt-oss's harmony commentary channel).",
    )
    server.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="Serve vLLM's token-in/token-out routes (/inference/v1/generate, "
        "/inference/v1/abort_requests); without it they answer 403.",
    )
    server.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="Count the model requests in flight, reported by GET /load.",
    )
    server.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info (the tokenizer's configuration and chat template).",
    )
    server.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins.")
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods.")
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers.")
    server.add_argument("--allow-credentials", action="store_true", help="CORS credentials.")
    server.add_argument("--ssl-keyfile", default=None, help="SSL key file (serve HTTPS).")
    server.add_argument("--ssl-certfile", default=None, help="SSL certificate file.")
    server.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="An ASGI middleware to install, as module.attribute: a class, or an async "
        "(request, call_next) function (repeatable; vLLM's flag).",
    )
    server.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates that client certificates must chain to.",
    )
    server.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="Whether a client certificate is required (Python's ssl: 0 none, 1 optional, "
        "2 required), as vLLM's flag.",
    )
    server.add_argument("--root-path", default=None, help="ASGI root path behind a proxy.")
    server.add_argument(
        "--uds", default=None, help="Listen on this Unix domain socket (--host and --port ignored)."
    )
    server.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        help="vLLM's API server processes; jllm serves from one process (the front end's "
        "templates and tokenization run on a worker pool), so a larger count is accepted with "
        "a warning.",
    )
    server.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Add usage.prompt_tokens_details.cached_tokens (prompt tokens read from the "
        "prefix cache) to completions and chat.",
    )
    server.add_argument(
        "--show-hidden-metrics-for-version",
        default=None,
        help="vLLM's re-enabling of metrics hidden after a deprecation; jllm has hidden none, "
        "so it changes nothing (as in vLLM 0.32).",
    )
    server.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="Accepted: jllm's front end always runs in the engine's process (vLLM removed "
        "the flag).",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level.",
    )
    server.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Log each request: its id, parameters and prompt (vLLM's flag; off by default, "
        "so prompts stay out of the log).",
    )
    server.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Deprecated (vLLM removed it): requests are not logged by default.",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=_non_negative_int,
        default=0,
        help="On SIGTERM/SIGINT, seconds the running requests may take to finish before they "
        "are aborted (0: abort them at once), as vLLM's flag.",
    )
    server.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Most prompt characters / token ids printed per logged request (default: all).",
    )
    add_engine_args(parser)
    return parser


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` is a path when such a file exists, else the template itself."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError:
        if any(c in value for c in "{}"):
            return value.encode().decode("unicode_escape")
        raise ValueError(
            f"--chat-template {value!r} is neither a readable file nor a Jinja template."
        ) from None

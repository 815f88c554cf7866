"""jllm's OpenAI-compatible HTTP server (FastAPI + uvicorn), vLLM's endpoints and flags.

    jllm serve [MODEL] [flags]
    python -m jllm.entrypoints.openai.api_server --model MODEL [flags]

The engine is built (weights loaded, every step shape compiled) before the server listens.
Handlers validate a request completely before it reaches the engine, so a bad request gets
an OpenAI-style error body and never disturbs the requests running beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import logging
import os
import signal
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jllm.engine.arg_utils import engine_args_from_namespace
from jllm.engine.async_llm import EngineDeadError
from jllm.entrypoints.anthropic.api_router import attach_anthropic_routes
from jllm.entrypoints.anthropic.protocol import route_error_response
from jllm.entrypoints.openai.auth import AuthenticationMiddleware, api_keys
from jllm.entrypoints.openai.chat_templates import check_request_template, renderer_parameters
from jllm.entrypoints.openai.cli_args import load_chat_template, make_arg_parser
from jllm.entrypoints.openai.dev_routes import attach_dev_routes, dev_mode
from jllm.entrypoints.openai.openapi import build_openapi
from jllm.entrypoints.openai.pooling.serving import ServingPooling, attach_pooling_routes
from jllm.entrypoints.openai.probes import attach_probe_routes
from jllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jllm.entrypoints.openai.responses.api_router import (
    attach_responses_routes,
    store_enabled,
)
from jllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jllm.entrypoints.openai.serving_engine import OpenAIError, json_object
from jllm.entrypoints.openai.serving_models import ServingModels
from jllm.entrypoints.openai.serving_tokens import ServingTokens, attach_token_routes
from jllm.entrypoints.openai.shutdown import GracefulServer, StoppableLLM
from jllm.logger import setup_logging
from jllm.metrics.prometheus import PrometheusStatLogger
from jllm.model_loader.locate import DEFAULT_MODEL_NAME
from jllm.version import __version__ as JLLM_VERSION

logger = logging.getLogger("jllm.entrypoints.openai")


async def with_cancellation(request: Request, work):
    """Run a non-streaming handler, cancelling it (which aborts its engine requests) if the
    client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # A cancelled task is done only once it has run its clean-up (the aborts).
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


def served_model_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name, else the --model argument, else the embedded model's hub id."""
    return args.served_model_name or [args.model or DEFAULT_MODEL_NAME]


def log_requests(args: argparse.Namespace) -> bool:
    """vLLM's `--enable-log-requests` (default off: prompts stay out of the log); the
    deprecated `--disable-log-requests` turns it off again."""
    if args.disable_log_requests:
        logger.warning(
            "--disable-log-requests is deprecated (vLLM removed it): requests are not logged "
            "unless --enable-log-requests is given."
        )
        return False
    return bool(args.enable_log_requests)


def check_priority(body, engine: StoppableLLM) -> None:
    """vLLM's refusal of a `priority` the scheduler would ignore (--scheduling-policy fcfs)."""
    if body.priority != 0 and engine.engine.args.scheduling_policy != "priority":
        raise OpenAIError(
            f"Got priority {body.priority} but Priority scheduling is not enabled.",
            400,
            "priority",
        )


def build_app(args: argparse.Namespace, engine: StoppableLLM, metrics: PrometheusStatLogger):
    names = served_model_names(args)
    root = args.model or DEFAULT_MODEL_NAME
    models = ServingModels(engine, names, root, args.lora_modules or ())
    common = dict(
        models=models,
        log_requests=log_requests(args),
        max_log_len=args.max_log_len,
        prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    completions = OpenAIServingCompletion(engine, **common)
    chat = OpenAIServingChat(
        engine,
        chat_template=load_chat_template(args.chat_template),
        response_role=args.response_role,
        tool_parser=check_tool_args(args),
        trust_request_chat_template=args.trust_request_chat_template,
        reasoning_parser=engine.engine.args.reasoning_parser,
        **common,
    )
    tokenizer = engine.get_tokenizer()
    app = FastAPI(root_path=args.root_path or "", title="jllm", version=JLLM_VERSION)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    for name in getattr(args, "middleware", None) or ():
        install_middleware(app, name)
    keys = api_keys(args)
    if keys:
        app.add_middleware(AuthenticationMiddleware, keys=keys)

    def error(raw: Request, message: str, status: int, param: str | None = None):
        return route_error_response(raw.scope, message, status, param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(raw: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error(raw, "The request body is not valid JSON.", 400)

        def where(e) -> str:
            return ".".join(str(p) for p in e.get("loc", ())[1:])

        message = "; ".join(f"{where(e) or 'body'}: {e.get('msg')}" for e in errors)
        field = errors[0].get("loc", ())[1:2] if errors else ()
        return error(raw, message or "Invalid request.", 400, str(field[0]) if field else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(raw: Request, exc: StarletteHTTPException):
        # Starlette's own errors (a body that is not UTF-8, a wrong method, ...) in the
        # route's error body, like every other error.
        response = error(raw, str(exc.detail), exc.status_code)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(OpenAIError)
    async def openai_error(raw: Request, exc: OpenAIError):
        return error(raw, exc.message, exc.status, exc.param)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(raw: Request, exc: EngineDeadError):
        return error(raw, str(exc), 503)

    @app.exception_handler(ValueError)
    async def value_error(raw: Request, exc: ValueError):
        return error(raw, str(exc), 400)

    @app.exception_handler(Exception)
    async def internal_error(raw: Request, exc: Exception):
        logger.exception("Unhandled error in a request handler.")
        return error(raw, f"Internal server error: {exc!r}", 500)

    @app.get("/health")
    async def health():
        engine.check_health()
        return Response(status_code=200, media_type="text/plain")

    for method in ("GET", "POST"):  # SageMaker's health probe; a route per method, so
        app.add_api_route("/ping", health, methods=[method])  # OpenAPI ids stay unique

    @app.get("/version")
    async def version():
        return {"version": JLLM_VERSION}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {
            "object": "list",
            "data": models.cards(completions.created(), engine.max_model_len),
        }

    if dev_mode():
        logger.warning(
            "Development routes are on (VLLM_SERVER_DEV_MODE=1): pause, sleep and weight "
            "updates; do not expose this server to untrusted clients."
        )
        attach_dev_routes(app, engine)

    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):
        logger.warning(
            "LoRA adapters can be loaded and unloaded at run time "
            "(VLLM_ALLOW_RUNTIME_LORA_UPDATING): do not expose this server to untrusted clients."
        )

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request):
            return PlainTextResponse(
                await engine.run_processor(models.load, await json_object(raw))
            )

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request):
            return PlainTextResponse(models.unload(await json_object(raw)))

    handlers = {}
    if engine.engine.pooling is None:  # a generative model: the generation routes

        @app.post("/v1/completions")
        async def create_completion(body: CompletionRequest, raw: Request):
            check_priority(body, engine)
            if body.stream:
                return await completions.create_completion(body, raw)
            return await with_cancellation(raw, completions.create_completion(body, raw))

        @app.post("/v1/chat/completions")
        async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
            check_priority(body, engine)
            if body.stream:
                return await chat.create_chat_completion(body, raw)
            return await with_cancellation(raw, chat.create_chat_completion(body, raw))

        attach_anthropic_routes(app, chat, with_cancellation)
        priority = functools.partial(check_priority, engine=engine)
        attach_responses_routes(app, chat, with_cancellation, priority)
        tokens = ServingTokens(engine, **common)
        attach_token_routes(app, tokens, args.enable_scale_out, with_cancellation, priority)
        handlers = {"chat": create_chat_completion, "completions": create_completion}
    else:  # a pooling model: vLLM mounts its routes in their place
        pooling = ServingPooling(engine, chat, **common)
        priority = functools.partial(check_priority, engine=engine)
        attach_pooling_routes(app, pooling, with_cancellation, priority)

    attach_probe_routes(
        app,
        engine=engine,
        args=args,
        models=models,
        created=completions.created,
        handlers=handlers,
    )

    def check_tokenizer_request(body) -> None:
        if tokenizer is None:
            raise OpenAIError("The server runs without a tokenizer.", 400)
        if body.model is not None and body.model not in names:
            raise OpenAIError(f"The model `{body.model}` does not exist.", 404, "model")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_tokenizer_request(body)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("Give exactly one of prompt and messages.", 400, "prompt")
        if body.messages is not None:
            ids = await chat.prompt_ids(body)
        else:
            # The chat fields mean nothing here, but an untrusted template is refused on every
            # route, as the schema says (a prompt does not make it harmless to accept).
            check_request_template(body, tokenizer, chat.trust_request_chat_template)
            encode = functools.partial(tokenizer.encode, add_special_tokens=body.add_special_tokens)
            ids = await engine.run_processor(encode, body.prompt)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_tokenizer_request(body)
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(f"Token ids must be in [0, {vocab}).", 400, "tokens")
        return {"prompt": await engine.run_processor(tokenizer.decode, body.tokens)}

    limits = {
        "model_names": names,
        "vocab_size": engine.engine.model_config.vocab_size,
        "max_model_len": engine.max_model_len,
        "max_logprobs": engine.engine.args.max_logprobs,
        "priority": engine.engine.args.scheduling_policy == "priority",
        "grammar_backend": engine.engine.args.structured_outputs_config.backend,
        "images": engine.engine.max_images_per_prompt > 0,
        "prompt_embeds": engine.engine.args.enable_prompt_embeds,
        "responses_store": store_enabled(),
        "trust_request_chat_template": args.trust_request_chat_template,
        "renderer_parameters": renderer_parameters(type(tokenizer)),
        "tokenizer_size": engine.engine.model_config.vocab_size
        if tokenizer is None
        else len(tokenizer),
    }
    doc = None

    def openapi() -> dict:
        nonlocal doc
        if doc is None:
            doc = build_openapi(app, api_key=bool(keys), limits=limits)
        return doc

    app.openapi = openapi
    return app


def build_engine(args: argparse.Namespace) -> tuple[StoppableLLM, PrometheusStatLogger]:
    from jllm.engine.llm_engine import LLMEngine

    engine_args = engine_args_from_namespace(args)
    if getattr(args, "headless", False) and engine_args.node_rank == 0:
        raise ValueError(
            "--headless is for the secondary nodes: node 0 (node_rank 0, or "
            "data_parallel_start_rank 0) runs the scheduler and serves the API."
        )
    llm_engine = LLMEngine.from_engine_args(engine_args)
    if llm_engine.is_follower:
        llm_engine.follow()  # headless: no API on processes other than 0
        raise SystemExit(0)
    metrics = PrometheusStatLogger(served_model_names(args)[0], llm_engine.max_model_len)
    metrics.log_cache_config(cache_config_info(llm_engine))
    return StoppableLLM(llm_engine, [metrics]), metrics


def cache_config_info(llm_engine) -> dict:
    """The cache settings `vllm:cache_config_info` labels (vLLM's CacheConfig names)."""
    args, kv = llm_engine.args, llm_engine.scheduler.kv_cache
    return {
        "block_size": args.block_size,
        "cache_dtype": args.kv_cache_dtype,
        "enable_prefix_caching": args.enable_prefix_caching,
        "prefix_caching_hash_algo": "sha256",
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "num_gpu_blocks": kv.num_blocks,
        "num_cpu_blocks": kv.host.num_blocks if kv.host is not None else 0,
        "kv_offloading_size": args.kv_offloading_size,
    }


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def check_tool_args(args: argparse.Namespace) -> str | None:
    """vLLM's start-up check of the tool flags (run_server runs it before the engine
    loads); the parser of tool_choice "auto", or None when it is not enabled."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def run_server(args: argparse.Namespace) -> None:
    setup_logging()
    logger.info("jllm API server version %s", JLLM_VERSION)
    shown = {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()}
    logger.info("args: %s", shown)
    # A bad --chat-template fails before the engine loads (build_engine checks the engine
    # flags first thing).
    load_chat_template(args.chat_template)
    check_tool_args(args)
    engine, metrics = build_engine(args)
    app = build_app(args, engine, metrics)
    host = args.host or "0.0.0.0"
    scheme = "https" if args.ssl_certfile else "http"
    if args.api_server_count > 1:
        logger.warning(
            "--api-server-count %d: jllm serves from one API process (its front end's work runs "
            "on a worker pool).",
            args.api_server_count,
        )
    if args.uds:
        logger.info("Starting jllm API server on unix:%s", args.uds)
    else:
        logger.info("Starting jllm API server on %s://%s:%d", scheme, host, args.port)
    logger.info(
        "Available routes: %s",
        ", ".join(sorted(r.path for r in app.routes if hasattr(r, "methods"))),
    )
    # While uvicorn serves, its server takes SIGTERM/SIGINT (GracefulServer: the running
    # requests are stopped first); outside it, SIGTERM becomes an exception so that the engine
    # (and, with several processes, the others) still stop in order.
    signal.signal(signal.SIGTERM, _terminate)
    config = uvicorn.Config(
        app,
        host=host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=5,
        uds=args.uds,
        **ssl_options(args),
    )
    server = GracefulServer(config, engine, args.shutdown_timeout)
    try:
        server.run()
        if not server.started:
            raise SystemExit(3)  # uvicorn's STARTUP_FAILURE (e.g. the port is taken)
    except KeyboardInterrupt:
        pass
    finally:
        logger.info("Shutting down.")
        engine.shutdown()


def install_middleware(app, name: str) -> None:
    """vLLM's --middleware: `module.attribute`, an ASGI middleware class (added with
    `add_middleware`) or an async `(request, call_next)` function (an HTTP middleware)."""
    module_name, _, attribute = name.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--middleware {name!r} could not be imported: {e}") from e
    if inspect.isclass(target):
        app.add_middleware(target)
    elif inspect.iscoroutinefunction(target):
        app.middleware("http")(target)
    else:
        raise ValueError(
            f"--middleware {name!r} is neither an ASGI middleware class nor an async function."
        )


def ssl_options(args: argparse.Namespace) -> dict:
    """uvicorn's TLS settings from the flags: key and certificate, and the CA certificates a
    client certificate must chain to, with whether one is required (--ssl-cert-reqs)."""
    return dict(
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> None:
    if args is None:
        args = make_arg_parser().parse_args(argv)
    try:
        run_server(args)
    except ValueError as e:
        logger.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()

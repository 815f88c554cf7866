"""--middleware installs ASGI middleware classes and async HTTP middleware functions, as
vLLM's flag does; a name that does not import, or is neither, is refused at start-up."""

from __future__ import annotations

import httpx
import pytest
from openai_server import RunningServer, server_args

from jllm.entrypoints.openai.api_server import build_app, build_engine, install_middleware

HERE = "entrypoints.openai.middleware_example"


def test_middleware_class_and_function(llama_dir):
    args = server_args(
        llama_dir,
        "--middleware",
        f"{HERE}.TagMiddleware",
        "--middleware",
        f"{HERE}.tag_function",
    )
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    try:
        r = httpx.get(f"{running.url}/health")
        assert r.headers["x-tag"] == "class" and r.headers["x-fn"] == "function"
    finally:
        running.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    "name, error",
    [(f"{HERE}.missing", "could not be imported"), (f"{HERE}.NOT_A_MIDDLEWARE", "neither")],
)
def test_bad_middleware_is_refused(name, error):
    from fastapi import FastAPI

    with pytest.raises(ValueError, match=error):
        install_middleware(FastAPI(), name)

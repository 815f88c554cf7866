"""A real jllm server on 127.0.0.1 (uvicorn in a thread) over a tiny Llama model, and
`openai` clients pointed at it."""

from __future__ import annotations

import openai
import pytest
from openai_server import RunningServer, server_args

from jllm.entrypoints.openai.api_server import build_app, build_engine


@pytest.fixture(scope="session")
def served(llama_dir):
    args = server_args(llama_dir)
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    yield running, args, metrics
    running.stop()
    engine.shutdown()


@pytest.fixture(scope="session")
def server(served) -> RunningServer:
    return served[0]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def agent_server(thinker_dir):
    """A server over the scripted reasoning model (conftest.THINKER_SCRIPT) with vLLM's
    DeepSeek-R1 reasoning parser: the routes agents call (chat with reasoning, Responses,
    Anthropic Messages) and the token-in/token-out route (--enable-scale-out). Off its
    script the model has no preference worth the name, so grammars allow no free whitespace:
    a schema's object then has one way to begin ('{"a"')."""
    args = server_args(
        thinker_dir,
        "--reasoning-parser",
        "deepseek_r1",
        "--enable-scale-out",
        "--structured-outputs-config",
        '{"disable_any_whitespace": true}',
    )
    engine, metrics = build_engine(args)
    with pytest.MonkeyPatch.context() as env:  # the Responses store, read at start-up
        env.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        app = build_app(args, engine, metrics)
    running = RunningServer(app, engine)
    yield running
    running.stop()
    engine.shutdown()


@pytest.fixture(scope="session")
def agent_client(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key="unused", max_retries=0)

"""Request-level rules of the server that other requests depend on: a `priority` the
scheduler would ignore is refused (vLLM's message), and prompts stay out of the log unless
the operator asks (`--enable-log-requests`, vLLM's default off)."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args

from jllm.entrypoints.openai.api_server import build_app, build_engine

SECRET = "my password is hunter2"
ROUTES = {
    "/v1/completions": {"prompt": SECRET},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": SECRET}]},
}


def post(server, path: str, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 2, **ROUTES[path], **fields}
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path", ROUTES)
def test_priority_under_fcfs_is_refused(server, path):
    r = post(server, path, priority=5)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == "Got priority 5 but Priority scheduling is not enabled."
    assert error["param"] == "priority"
    assert post(server, path, priority=0).status_code == 200


def test_priority_under_the_priority_policy_is_accepted(llama_dir):
    args = server_args(llama_dir, "--scheduling-policy", "priority")
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    try:
        for path in ROUTES:
            assert post(running, path, priority=-3).status_code == 200
    finally:
        running.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    "flags, logged",
    [((), False), (("--enable-log-requests",), True), (("--disable-log-requests",), False)],
)
def test_prompts_are_logged_only_when_asked(served, caplog, flags, logged):
    running, args, metrics = served
    app = build_app(server_args(args.model, *flags), running.engine, metrics)
    server = RunningServer(app, running.engine)
    try:
        with caplog.at_level(logging.DEBUG):
            for path in ROUTES:
                assert post(server, path).status_code == 200
    finally:
        server.stop()
    assert (SECRET in caplog.text) == logged
    if "--disable-log-requests" in flags:
        assert "--disable-log-requests is deprecated" in caplog.text

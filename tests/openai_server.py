"""Real jllm servers on 127.0.0.1 for the tests: uvicorn in a thread, or a subprocess to wait on."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

import httpx
import uvicorn
from oracle import SMALL

from jllm.engine.arg_utils import flag
from jllm.entrypoints.openai.cli_args import make_arg_parser

MODEL_NAME = "tiny-llama"


def server_args(model: str, *extra: str):
    argv = ["--model", model, "--served-model-name", MODEL_NAME, "other-name"]
    for key, value in SMALL.items():
        argv += [flag(key)] if value is True else [flag(key), str(value)]
    return make_arg_parser().parse_args([*argv, *extra])


@contextlib.contextmanager
def serving(model: str, *extra: str):
    """A server over `model` (the tests' SMALL engine) with `extra` flags, for a fixture's
    lifetime."""
    from jllm.entrypoints.openai.api_server import build_app, build_engine

    args = server_args(model, *extra)
    engine, metrics = build_engine(args)
    try:
        app = build_app(args, engine, metrics)
    except BaseException:
        engine.shutdown()
        raise
    running = RunningServer(app, engine)
    try:
        yield running
    finally:
        running.stop()
        engine.shutdown()


_HANDED_OUT: set[int] = set()  # this process's picks: two picks never overlap


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        try:
            s.bind(("0.0.0.0", port))  # as the servers bind: taken on any address is taken
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """The first of `span` free ports in a row (a multi-process engine's step channel is on
    master_port + 1), outside the kernel's ephemeral range. A port the kernel hands out for
    port 0 and takes back can go to any outgoing connection (JAX's coordination clients, the
    step channel) before a server started with it binds: CI saw `address already in use`."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    # Below the range (not the well-known ports), else above it: wherever 1024 ports fit.
    ranges = [
        (a, b)
        for a, b in ((max(1024, low - 16384), low - span + 1), (high + 1, 65536 - span + 1))
        if b - a >= 1024
    ]
    rng = random.SystemRandom()
    for _ in range(200 if ranges else 0):
        first = rng.randrange(*rng.choice(ranges))
        ports = range(first, first + span)
        if not _HANDED_OUT.intersection(ports) and all(_bindable(p) for p in ports):
            _HANDED_OUT.update(ports)
            return first
    with socket.socket() as s:  # no room outside the range: the kernel's pick, as before
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, app, engine, **uvicorn_options) -> None:
        self.engine = engine
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", **uvicorn_options
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_healthy(url: str, procs, timeout: float) -> None:
    """Poll `url`/health until it answers 200, failing with the log of the first process if
    any of the server processes `procs` exits or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert all(p.poll() is None for p in procs), procs[0].stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def wait_idle(server, timeout: float = 60.0) -> None:
    """Wait until the engine holds no request and no KV block."""
    scheduler = server.engine.engine.scheduler
    kv = scheduler.kv_cache
    deadline = time.monotonic() + timeout
    while scheduler.running or scheduler.waiting or kv.num_free_blocks != kv.num_blocks - 1:
        assert time.monotonic() < deadline, "requests or blocks still held"
        time.sleep(0.05)


class HeldEngine:
    """Holds the engine thread once a running request has `after` output tokens, until the
    server aborts a request, so a disconnect always meets an unfinished request whatever the
    machine's speed. (Outputs of the holding step are delivered after the hold.)"""

    def __init__(self, server, after: int):
        self.llm_engine = server.engine.engine
        self.scheduler = self.llm_engine.scheduler
        self.after = after
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()
        self.timed_out = False
        self._step = self.llm_engine.step
        self._abort = server.engine.abort

    @classmethod
    def install(cls, server, after: int, monkeypatch) -> HeldEngine:
        """A hold on `server`'s engine for the test's duration (`monkeypatch` undoes it)."""
        hold = cls(server, after)
        monkeypatch.setattr(hold.llm_engine, "step", hold.step)
        monkeypatch.setattr(server.engine, "abort", hold.abort)
        return hold

    def step(self):
        outputs = self._step()
        if any(r.num_output_tokens >= self.after for r in self.scheduler.running):
            # The abort command is queued before this returns; the engine loop takes queued
            # commands before its next step, so the request is aborted mid-generation.
            self.timed_out = not self.abort_seen.wait(timeout=60)
        return outputs

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort(request_id)
        self.abort_seen.set()

"""The server's front end against a live server: outputs are processed on the output thread,
never the engine thread; a stop string found there ends the request in the core through the
command queue; utility calls run on the engine thread; request preparation runs on a pool, so
a slow one holds up nobody; and a request with 1,000 stop strings and n=8 leaves the time to
first token of short requests beside it within a bound measured in the same run."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from openai_server import MODEL_NAME, wait_idle

from jllm.config import limits
from jllm.engine.detokenizer import IncrementalDetokenizer
from jllm.engine.output_processor import OutputProcessor
from jllm.engine.request import RequestStatus
from jllm.entrypoints.openai.serving_chat import OpenAIServingChat

GREEDY = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}


def test_text_is_made_on_the_output_thread(server, monkeypatch):
    threads = set()

    def on(fn):
        def wrapped(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(IncrementalDetokenizer, "update", on(IncrementalDetokenizer.update))
    monkeypatch.setattr(OutputProcessor, "make_output", on(OutputProcessor.make_output))
    body = {**GREEDY, "prompt": "Hello, my name is", "max_tokens": 6, "logprobs": 2}
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 200
    assert threads == {"jllm-outputs"}


def test_a_stop_string_ends_the_request_in_the_core(server, monkeypatch):
    """The output thread finds the stop string; the engine thread ends the sequence in the
    core with finish status "stop" (the command queue), which frees its blocks."""
    client = server.engine.engine.engine_core
    ended, seen = [], threading.Event()
    inner = client.abort_requests

    def record(ids, status=RequestStatus.FINISHED_ABORTED):
        ended.append((list(ids), status, threading.current_thread().name))
        if status == RequestStatus.FINISHED_STOPPED:
            seen.set()
        return inner(ids, status)

    monkeypatch.setattr(client, "abort_requests", record)
    body = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 40}
    text = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    got = httpx.post(f"{server.url}/v1/completions", json={**body, "stop": [stop]}).json()
    choice = got["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == text[: text.index(stop)]
    assert seen.wait(60)
    ((ids, _, thread),) = [e for e in ended if e[1] == RequestStatus.FINISHED_STOPPED]
    assert ids == [f"{got['id']}-0"] and thread == "jllm-engine"
    wait_idle(server)
    assert server.engine.engine.core.parents == {}


def test_utility_calls_run_on_the_engine_thread(server, monkeypatch):
    core = server.engine.engine.core
    threads = []
    inner = core.reset_prefix_cache

    def reset():
        threads.append(threading.current_thread().name)
        return inner()

    monkeypatch.setattr(core, "reset_prefix_cache", reset)
    wait_idle(server)
    assert asyncio.run(server.engine.call_utility("reset_prefix_cache")) is True
    assert threads == ["jllm-engine"]
    with pytest.raises(ValueError, match="no utility 'step'|no utility 'nope'"):
        asyncio.run(server.engine.call_utility("nope"))


def test_a_slow_preparation_holds_up_no_other_request(server, monkeypatch):
    """A chat request whose rendering hangs (a slow image host, say) holds one worker of the
    processor pool; other requests are prepared and answered meanwhile."""
    assert server.engine.processor_pool._max_workers == 8
    entered, release = threading.Event(), threading.Event()
    inner = OpenAIServingChat.render

    def render(self, request):
        if request.messages[-1].get("content") == "slow":
            entered.set()
            assert release.wait(120)
        return inner(self, request)

    monkeypatch.setattr(OpenAIServingChat, "render", render)
    replies = []

    def chat(content: str) -> None:
        body = {**GREEDY, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        replies.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120))

    slow = threading.Thread(target=chat, args=("slow",))
    slow.start()
    try:
        assert entered.wait(60)
        chat("fast")
        body = {**GREEDY, "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert [r.status_code for r in replies] == [200] and slow.is_alive()
    finally:
        release.set()
        slow.join(120)
    assert [r.status_code for r in replies] == [200, 200]


def first_token_time(server, prompt: str) -> float:
    """Seconds from sending a short streamed completion to its first token."""
    body = {**GREEDY, "prompt": prompt, "max_tokens": 3, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise AssertionError("no token came")


SHORT = [f"Short request number {i}:" for i in range(8)]
# How much slower a short request's first token may come beside the heavy request than
# alone. Its steps carry 8 more sequences and every thread of the process shares one GIL
# with a busy engine thread: on a loaded 2-core machine the ratio measured 1.8 to 2.8 (with
# or without the stop strings; the engine thread never scans them, see the first test). An
# output thread falling behind, or a stall per step, shows past this generous bound.
FACTOR = 6.0


def heavy_running(server) -> bool:
    """Whether the heavy request's sequences are generating."""
    running = list(server.engine.engine.scheduler.running)
    return any(r.sampling_params.n == 8 and r.num_output_tokens > 0 for r in running)


def beside_heavy(server, heavy: dict) -> list[float]:
    """The short requests' first-token times while `heavy` runs. It is not streamed (its
    text is still made and scanned token by token): a stream's own chunks would share the
    event loop with the short requests. Closing its connection aborts it."""
    payload = json.dumps(heavy).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        deadline = time.monotonic() + 120
        while not heavy_running(server):
            assert time.monotonic() < deadline, "the heavy request did not start"
            time.sleep(0.01)
        times = [first_token_time(server, p) for p in SHORT]
        assert heavy_running(server), "the heavy request ended before the short ones ran"
    finally:
        sock.close()
    wait_idle(server)
    return times


def test_a_request_with_1000_stop_strings_and_n_8_slows_nobody(server, monkeypatch):
    monkeypatch.setattr(limits, "MAX_STOP_STRINGS", 1000)
    stops = [f"zq{i:04d} never appears {i * 7919 % 1000:03d}" for i in range(1000)]
    heavy = {
        **GREEDY,
        "prompt": "Write a very long story about stop words.",
        "n": 8,
        "temperature": 0.8,
        "max_tokens": 1500,
        "stop": stops,
    }
    wait_idle(server)
    # Twice: the first round meets the step shapes no earlier request compiled.
    for _ in range(2):
        alone = [first_token_time(server, p) for p in SHORT]
        beside = beside_heavy(server, heavy)
    ratio = statistics.median(beside) / statistics.median(alone)
    assert ratio < FACTOR, (alone, beside)


def test_logprobs_json_can_carry():
    """-inf and NaN (a grammar the vocabulary cannot follow masks every token) are reported
    as vLLM's -9999.0: JSON has neither, and a response must not fail on them."""
    from jllm.entrypoints.openai.serving_engine import MIN_LOGPROB, clamp

    assert [clamp(x) for x in (float("-inf"), float("nan"), -1e6, -0.5)] == [
        MIN_LOGPROB,
        MIN_LOGPROB,
        MIN_LOGPROB,
        -0.5,
    ]

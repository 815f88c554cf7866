"""Structured outputs and tool calls through the server, with the `openai` client: every
constrained output parses and validates (`jsonschema`, `re.fullmatch`, membership, the
client's own Pydantic parsing), streamed equals non-streamed, and bad constraints are 400s
that leave the server serving. The tiny model's raw text is noise, so only the grammar makes
it valid. The server runs with `--enable-auto-tool-choice --tool-call-parser hermes` and
`disable_any_whitespace` (a random model otherwise emits whitespace between JSON tokens
until max_tokens)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai_server import MODEL_NAME, serving
from pydantic import BaseModel, Field

from jllm.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser

CHAT = [{"role": "user", "content": "Fill in the form."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


class Form(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    ok: bool


@pytest.fixture(scope="module")
def tool_server(llama_dir):
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    grammar = ("--structured-outputs-config", '{"disable_any_whitespace": true}')
    with serving(llama_dir, *flags, *grammar) as running:
        yield running


@pytest.fixture(scope="module")
def tclient(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="x", max_retries=0)


def chat(client, seed, **kw):
    kw = {"model": MODEL_NAME, "messages": CHAT, "temperature": 1.0, "max_tokens": 60, **kw}
    return client.chat.completions.create(seed=seed, **kw)


def streamed(client, seed, **kw):
    """(content, {index: [name, arguments]}, finish reason) accumulated from a stream."""
    content, calls, reason = "", {}, None
    for chunk in chat(client, seed, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.function.name:
                    entry[0] = call.function.name
                entry[1] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


def test_parse_with_a_pydantic_model(tclient):
    for seed in range(6):
        done = tclient.chat.completions.parse(
            model=MODEL_NAME,
            messages=CHAT,
            response_format=Form,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        message = done.choices[0].message
        assert isinstance(message.parsed, Form), message.content
        assert done.choices[0].finish_reason == "stop"


def test_completions_constraints(tclient):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["n"],
        "additionalProperties": False,
    }
    cases = [
        ({"guided_regex": r"[a-c]{2,4}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{2}", t)),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"structured_outputs": {"choice": ["x y", "z"]}}, lambda t: t in ("x y", "z")),
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": schema},
                }
            },
            lambda t: jsonschema.validate(json.loads(t), schema) is None,
        ),
        ({"guided_grammar": 'root ::= "[" [0-9] "]"'}, lambda t: re.fullmatch(r"\[\d\]", t)),
    ]
    for extra, valid in cases:
        for seed in range(4):
            out = tclient.completions.create(
                model=MODEL_NAME,
                prompt="Go:",
                temperature=1.0,
                seed=seed,
                max_tokens=40,
                extra_body=extra,
            )
            text = out.choices[0].text
            assert out.choices[0].finish_reason == "stop" and valid(text), (extra, text)


def test_json_object_streamed_equals_non_streamed(tclient):
    fmt = {"type": "json_object"}
    for seed in range(3):
        full = chat(tclient, seed, response_format=fmt, max_tokens=120)
        content, calls, reason = streamed(tclient, seed, response_format=fmt, max_tokens=120)
        assert content == full.choices[0].message.content and not calls
        assert reason == full.choices[0].finish_reason
        if reason == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert content.startswith("{")


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(tclient, parallel):
    """Several calls when parallel (the noise model closes the array within 400 tokens for
    these seeds), exactly one with parallel_tool_calls=false (enforced by the grammar)."""
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 400}
    kw["parallel_tool_calls"] = parallel
    counts = set()
    for seed in range(5):
        full = chat(tclient, seed, **kw)
        choice = full.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and all(c.id.startswith("chatcmpl-tool-") for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        counts.add(len(calls))
        content, streamed_calls, reason = streamed(tclient, seed, **kw)
        assert reason == "tool_calls" and not content
        got = [tuple(streamed_calls[i]) for i in sorted(streamed_calls)]
        assert got == [(c.function.name, c.function.arguments) for c in calls]
    assert max(counts) > 1 if parallel else counts == {1}


def test_required_cut_by_a_stop_string_is_content(tclient):
    """An array the grammar did not get to close (a stop string cut it) is no tool call:
    the text comes back as content with the engine's finish reason."""
    kw = {"tools": [WEATHER], "tool_choice": "required", "stop": ["name"]}
    choice = chat(tclient, 0, **kw).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("[")
    content, calls, reason = streamed(tclient, 0, **kw)
    assert (content, calls, reason) == (choice.message.content, {}, "stop")


def test_named_tool_choice(tclient):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(5):
        full = chat(tclient, seed, tools=[WEATHER, TIME], tool_choice=named)
        (call,) = full.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        content, calls, _ = streamed(tclient, seed, tools=[WEATHER, TIME], tool_choice=named)
        assert calls == {0: ["get_weather", call.function.arguments]} and not content


def test_auto_tool_choice_reads_hermes_calls(tclient):
    """tool_choice "auto" with the hermes parser: a regex makes the noise model write a
    Hermes tool call after some free text, and the server reads it as one."""
    regex = (
        r"[a-z]{1,6} <tool_call>\n\{\"name\": \"get_weather\", \"arguments\": "
        r"\{\"city\": \"(Paris|Rome)\", \"days\": [1-7]\}\}\n</tool_call>"
    )
    extra = {"guided_regex": regex}
    for seed in range(3):
        full = chat(tclient, seed, tools=[WEATHER], extra_body=extra, max_tokens=80)
        choice = full.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert re.fullmatch(r"[a-z]{1,6} ", choice.message.content)
        content, calls, reason = streamed(
            tclient, seed, tools=[WEATHER], extra_body=extra, max_tokens=80
        )
        assert reason == "tool_calls" and content == choice.message.content
        assert calls == {0: ["get_weather", call.function.arguments]}
    # Without tools the same text is plain content.
    plain = chat(tclient, 0, extra_body=extra, max_tokens=80).choices[0]
    assert "<tool_call>" in plain.message.content and not plain.message.tool_calls


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "nonsense"}}, None),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}, None),
        ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= nope"}, None),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, None),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "yaml"}},
            "response_format",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"regex": "a", "json": {}}},
            "structured_outputs",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"regex": 5}},
            "structured_outputs",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "guided_regex": "a", "use_beam_search": True, "n": 2},
            "use_beam_search",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "", "tool_calls": ["f"]}]},
            "messages",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
        ),
    ],
)
def test_bad_constraints_are_400(tool_server, path, body, param):
    r = httpx.post(f"{tool_server.url}{path}", json={"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param


def test_bad_constraints_leave_other_requests_alone(tclient, tool_server):
    good = dict(
        prompt="Go:", temperature=1.0, seed=3, max_tokens=12, extra_body={"ignore_eos": True}
    )
    before = tclient.completions.create(model=MODEL_NAME, **good).choices[0].text
    r = httpx.post(f"{tool_server.url}/v1/completions", json={"prompt": "x", "guided_regex": "(("})
    assert r.status_code == 400
    after = tclient.completions.create(model=MODEL_NAME, **good).choices[0].text
    assert before == after


def test_auto_needs_the_server_flags(server):
    """The default server has no tool parser: tools (tool_choice "auto" by default) are a
    400 with vLLM's message; "none" is plain chat."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": CHAT, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


def test_hermes_parser():
    p = HermesToolParser()
    text = (
        'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}'
    )
    content, calls = p.parse(text)
    assert content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert p.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert p.parse("no calls") == ("no calls", [])
    assert p.stream_start("abc <tool") == 4 and p.stream_start("abc <x") is None
    assert p.stream_start("x<tool_call>{") == 1


def test_llama3_json_parser():
    p = Llama3JsonToolParser()
    text = (
        '<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": 2}]}}; '
        '{"name": "g", "arguments": {}}'
    )
    content, calls = p.parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": [1, {"b": 2}]}),
        ("g", {}),
    ]
    assert p.parse('{"x": 1}') == ('{"x": 1}', [])
    # Calls only at the start, as vLLM's parser: otherwise it is all content.
    later = 'Sure: {"name": "f", "parameters": {}}'
    assert p.parse(later) == (later, [])
    assert p.parse("Hello") == ("Hello", [])
    assert p.stream_start("  {") == 0 and p.stream_start("Hello") is None

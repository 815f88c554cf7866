"""The tool-call formats of `tool_formats.py` (mistral, pythonic, qwen3_coder/qwen3_xml,
deepseek_v3) on outputs as the models write them, what stays content, the schema types of
Qwen3's XML values, where a streamed call begins; and the pythonic format end to end through
a server whose scripted model answers with a call."""

from __future__ import annotations

import json

import openai
import pytest
from openai_server import RunningServer, server_args

from jllm.entrypoints.openai.api_server import build_app, build_engine
from jllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "scale": {"type": ["number", "null"]},
                },
            },
        },
    }
]


def parse(name: str, text: str):
    content, calls = TOOL_PARSERS[name]().parse(text, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "name, text, content, calls",
    [
        (
            "mistral",
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "Sure. ",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather{"days": 2}',
            None,
            [("get_weather", {"city": "Oslo"}), ("get_weather", {"days": 2})],
        ),
        ("mistral", "no calls here", "no calls here", []),
        ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
        (
            "pythonic",
            '[get_weather(city="Paris", days=3, metric=true), '
            "get_weather(city='Rome', hours=[1, 2])]",
            None,
            [
                ("get_weather", {"city": "Paris", "days": 3, "metric": True}),
                ("get_weather", {"city": "Rome", "hours": [1, 2]}),
            ],
        ),
        (
            "pythonic",
            "[get_weather(city=__import__('os'))]",
            "[get_weather(city=__import__('os'))]",
            [],
        ),
        ("pythonic", "[get_weather('Paris')]", "[get_weather('Paris')]", []),
        ("pythonic", "I think [f(a=1)]", "I think [f(a=1)]", []),
        (
            "qwen3_xml",
            "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
            "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=scale>\nnull\n"
            "</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
            "Let me check.",
            [
                (
                    "get_weather",
                    {
                        "city": "Paris",
                        "days": 3,
                        "metric": True,
                        "hours": [1, 2],
                        "scale": None,
                        "extra": "7",
                    },
                )
            ],
        ),
        (
            "qwen3_coder",
            "<tool_call><function=get_weather><parameter=days>two</parameter></function>"
            "</tool_call><tool_call><function=other><parameter=x>1</parameter></function></tool_call>",
            None,
            [("get_weather", {"days": "two"}), ("other", {"x": "1"})],
        ),
        (
            "deepseek_v3",
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris",\n "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "Checking.",
            [("get_weather", {"city": "Paris", "days": 2})],
        ),
        ("deepseek_v3", "plain", "plain", []),
    ],
)
def test_formats(name, text, content, calls):
    assert parse(name, text) == (content, calls)


def test_mistral_ids_are_nine_characters():
    _, calls = TOOL_PARSERS["mistral"]().parse('[TOOL_CALLS]f{"a": 1}')
    (call,) = calls
    assert len(call.json()["id"]) == 9 and call.json()["id"].isalnum()


@pytest.mark.parametrize(
    "name, text, start",
    [
        ("mistral", "Sure [TOOL", 5),
        ("mistral", "Sure.", None),
        ("pythonic", "  [get", 2),
        ("pythonic", "Hello", None),
        ("qwen3_xml", "ok <func", 3),
        ("qwen3_coder", "ok <tool_call>", 3),
        ("deepseek_v3", "hm <｜tool", 3),
    ],
)
def test_stream_start(name, text, start):
    assert TOOL_PARSERS[name]().stream_start(text) == start


@pytest.fixture(scope="module")
def pythonic_server(llama_dir, tmp_path_factory):
    from scripted_model import save_scripted

    path = tmp_path_factory.mktemp("pythonic")
    model = save_scripted(llama_dir, path, "[add(a=1)]")
    args = server_args(model, "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
    running.stop()
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_pythonic_calls_through_the_server(pythonic_server, stream):
    tool = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
    kwargs = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Add."}],
        tools=[tool],
        max_tokens=20,
    )
    if not stream:
        r = pythonic_server.chat.completions.create(**kwargs)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1})
        return
    calls, content, reason = [], "", None
    for chunk in pythonic_server.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    assert content == "" and reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1})
    ]

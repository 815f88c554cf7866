"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the real
`anthropic` SDK against the scripted reasoning model (conftest.THINKER_SCRIPT): text and
thinking blocks, streaming events as the SDK assembles them, stop reasons, tools, token
counts against the chat template, and errors in Anthropic's body."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
import transformers

from jllm.entrypoints.anthropic.protocol import MessagesRequest
from jllm.entrypoints.anthropic.serving import (
    AnthropicServingMessages,
    chat_messages,
    chat_request,
)
from jllm.entrypoints.openai.serving_engine import OpenAIError

REASONING, ANSWER = "Let me see.", "The answer is four"
USER = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def claude(agent_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.url, api_key="unused", max_retries=0)


def test_a_message(claude, agent_client):
    m = claude.messages.create(model="tiny-llama", max_tokens=40, messages=USER)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == REASONING and m.content[1].text == ANSWER
    assert m.role == "assistant" and m.stop_reason == "end_turn" and m.stop_sequence is None
    chat = agent_client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=40)
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens


def test_the_stream_as_the_sdk_assembles_it(claude):
    with claude.messages.stream(model="tiny-llama", max_tokens=40, messages=USER) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == ANSWER
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reasons(claude, stream):
    def create(**kwargs):
        if not stream:
            return claude.messages.create(model="tiny-llama", messages=USER, **kwargs)
        with claude.messages.stream(model="tiny-llama", messages=USER, **kwargs) as s:
            return s.get_final_message()

    short = create(max_tokens=3)
    assert short.stop_reason == "max_tokens"
    stopped = create(max_tokens=40, stop_sequences=["is four"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "is four"
    assert stopped.content[-1].text == "The answer "


def test_system_tools_and_history_reach_the_template(agent_server):
    """The conversion a template sees: system first, tool results as tool messages before
    the rest of their user message, an assistant's tool_use as its tool calls."""
    request = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Add 1 and 2."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "use the tool"},
                        {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Here it is."},
                        {"type": "tool_result", "tool_use_id": "t1", "content": "3"},
                    ],
                },
            ],
        }
    )
    assert chat_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
            "reasoning": "use the tool",
            "content": "",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "3"},
        {"role": "user", "content": "Here it is."},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool(claude, stream):
    tool = {
        "name": "add",
        "description": "Add numbers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
        },
    }
    kwargs = dict(
        model="tiny-llama",
        max_tokens=12,
        messages=USER,
        tools=[tool],
        tool_choice={"type": "tool", "name": "add"},
    )
    if stream:
        with claude.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**kwargs)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "add"
    assert m.content[0].type == "thinking" and m.content[0].thinking == REASONING


def test_count_tokens(claude, thinker_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(thinker_dir)
    system = "Be brief."
    got = claude.messages.count_tokens(model="tiny-llama", system=system, messages=USER)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *USER], tokenize=False, add_generation_prompt=True
    )
    assert got.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": "tiny-llama", "messages": USER}, 400),  # no max_tokens
        ({"model": "tiny-llama", "max_tokens": 0, "messages": USER}, 400),
        ({"model": "tiny-llama", "max_tokens": 5, "messages": []}, 400),
        (
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "document"}]}],
            },
            400,
        ),
        (
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AAAA",
                                },
                            }
                        ],
                    }
                ],
            },
            400,
        ),
        (
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": USER,
                "tool_choice": {"type": "tool", "name": "x"},
            },
            400,
        ),
        ({"model": "nope", "max_tokens": 5, "messages": USER}, 404),
        ({"model": "tiny-llama", "max_tokens": 5, "messages": USER, "temperature": -1}, 400),
        # vLLM's rule: the thinking budget is part of max_tokens.
        (
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": USER,
                "thinking": {"type": "enabled", "budget_tokens": 5},
            },
            400,
        ),
        (
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": USER,
                "output_config": {"format": {"type": "json_schema"}},  # no schema
            },
            400,
        ),
        (
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": USER,
                "output_config": {"effort": "huge"},
            },
            400,
        ),
        ({"model": "tiny-llama", "max_tokens": 5, "messages": USER, "cache_salt": ""}, 400),
        (  # the renderer's own parameter
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "messages": USER,
                "chat_template_kwargs": {"add_generation_prompt": False},
            },
            400,
        ),
    ],
)
def test_errors_in_anthropics_body(agent_server, body, status):
    r = httpx.post(f"{agent_server.url}/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["message"]
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


def test_the_sdk_raises_its_own_errors(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=5, messages=USER)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny-llama", max_tokens=5, messages=[])


def test_inline_system_messages(claude, thinker_dir):
    """A message with role "system" (Claude Code's reminders) is a system message where it
    stands, or joins the system prompt where the template wants the system message first;
    Claude Code's billing header is dropped from either."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=0f;"},
                {"type": "text", "text": "Use tools."},
            ],
        },
        *USER,
    ]
    request = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "system": "Sys. ", "messages": messages}
    )
    inline = [
        {"role": "system", "content": "Sys. "},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "system", "content": "Use tools."},
        *USER,
    ]
    merged = [{"role": "system", "content": "Sys. Be brief.Use tools."}, messages[1], *USER]
    assert chat_messages(request) == inline
    assert chat_messages(request, merge_inline_system=True) == merged
    tokenizer = transformers.AutoTokenizer.from_pretrained(thinker_dir)
    try:
        text = tokenizer.apply_chat_template(inline, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template wanting the system message first
        text = tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    got = claude.messages.count_tokens(model="tiny-llama", system="Sys. ", messages=messages)
    assert got.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    r = claude.messages.create(model="tiny-llama", max_tokens=40, messages=messages)
    assert r.content[-1].text == ANSWER


def test_a_template_wanting_the_system_message_first():
    """Qwen's template raises on a system message after the first turn: the probe sees it
    once, and inline system messages join the system prompt from then on."""

    class SystemFirst:
        renders = 0

        def render(self, request):
            self.renders += 1
            if any(m["role"] == "system" for m in request.messages[1:]):
                raise OpenAIError("System message must be at the beginning.", 400)

    chat = SystemFirst()
    serving = AnthropicServingMessages(chat)
    body = {"model": "m", "max_tokens": 5, "messages": [*USER, {"role": "system", "content": "B"}]}
    for _ in range(2):
        request = serving._chat_request(MessagesRequest.model_validate(body))
        assert request.messages == [{"role": "system", "content": "B"}, *USER]
    assert chat.renders == 1


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": ["yes", "no"]},
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    ],
)
def test_output_config_format_constrains_the_answer(claude, schema):
    """output_config.format is chat's json_schema response_format (vLLM's mapping): the
    answer after the thinking is JSON that the schema takes."""
    m = claude.messages.create(
        model="tiny-llama",
        max_tokens=60,
        messages=USER,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking == REASONING
    assert m.content[-1].type == "text" and m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[-1].text), schema)


def test_template_kwargs_effort_and_salt_reach_chat(claude, thinker_dir):
    """chat_template_kwargs and output_config.effort reach the template as on chat (the
    request's kwargs over thinking's enable_thinking, vLLM's order), cache_salt the prefix
    cache; disabled thinking overrides an effort."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": USER,
        "thinking": {"type": "enabled", "budget_tokens": 2},
        "output_config": {"effort": "low"},
        "chat_template_kwargs": {"enable_thinking": False, "x": 1},
        "cache_salt": "salt",
    }
    chat = chat_request(MessagesRequest.model_validate(body))
    assert chat.reasoning_effort == "low" and chat.cache_salt == "salt"
    assert chat.template_kwargs() == {"reasoning_effort": "low", "enable_thinking": False, "x": 1}
    body["thinking"] = {"type": "disabled"}
    del body["chat_template_kwargs"]
    chat = chat_request(MessagesRequest.model_validate(body))
    assert chat.reasoning_effort is None and chat.template_kwargs() == {"enable_thinking": False}
    # Through the server: without thinking in the template, no thinking block (the scripted
    # answer's tags are then text); the count renders the same kwargs.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    m = claude.messages.create(
        model="tiny-llama", max_tokens=40, messages=USER, extra_body={**off, "cache_salt": "s"}
    )
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == f"<think>{REASONING}</think>{ANSWER}"
    tokenizer = transformers.AutoTokenizer.from_pretrained(thinker_dir)
    cases = [
        ({"chat_template_kwargs": {}}, {}),
        (off, {"enable_thinking": False}),
        (
            {"output_config": {"effort": "high"}},
            {"reasoning_effort": "high", "enable_thinking": True},
        ),
    ]
    for extra, kwargs in cases:
        got = claude.messages.count_tokens(model="tiny-llama", messages=USER, extra_body=extra)
        text = tokenizer.apply_chat_template(
            USER, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert got.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))

"""--reasoning-parser on a live server: a scripted reasoning model (conftest.THINKER_SCRIPT)
through the openai client, whole and streamed; the reasoning token count; include_reasoning;
and a grammar that applies only once the reasoning has ended (vLLM's behaviour)."""

from __future__ import annotations

import pytest
import transformers
from conftest import THINKER_SCRIPT

REASONING, ANSWER = "Let me see.", "The answer is four"
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


def reasoning_tokens(thinker_dir) -> int:
    tokenizer = transformers.AutoTokenizer.from_pretrained(thinker_dir)
    return len(tokenizer.encode(REASONING, add_special_tokens=False))


def test_the_script(thinker_dir):
    assert THINKER_SCRIPT == f"<think>{REASONING}</think>{ANSWER}"


def test_reasoning_apart_from_the_content(agent_client, thinker_dir):
    r = agent_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=40)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == REASONING
    assert message.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(thinker_dir)
    hidden = agent_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=40,
        extra_body={"include_reasoning": False},
    )
    assert hidden.choices[0].message.model_extra["reasoning"] is None
    assert hidden.choices[0].message.content == ANSWER


def test_streamed_reasoning_deltas(agent_client, thinker_dir):
    stream = agent_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning, content, order, usage = "", "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if (delta.model_extra or {}).get("reasoning"):
                reasoning += delta.model_extra["reasoning"]
                order.append("r")
            if delta.content:
                content += delta.content
                order.append("c")
    assert (reasoning, content) == (REASONING, ANSWER)
    assert order == sorted(order, reverse=True)  # all the reasoning before any content
    assert usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(thinker_dir)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_applies_after_the_reasoning(agent_client, stream):
    """A choice grammar leaves the reasoning free (else it would force the first token) and
    constrains what follows `</think>`."""
    kwargs = dict(model="tiny-llama", messages=MESSAGES, max_tokens=40)
    body = {"structured_outputs": {"choice": ["yes", "no"]}}
    if not stream:
        r = agent_client.chat.completions.create(**kwargs, extra_body=body)
        message = r.choices[0].message
        assert message.model_extra["reasoning"] == REASONING
        assert message.content in ("yes", "no")
        return
    reasoning, content = "", ""
    for chunk in agent_client.chat.completions.create(**kwargs, stream=True, extra_body=body):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert reasoning == REASONING and content in ("yes", "no")


def test_a_named_tool_after_the_reasoning(agent_client):
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }
    r = agent_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=60,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == REASONING
    (call,) = message.tool_calls
    # The grammar's arguments (no free whitespace on this server; the digits may run on).
    assert call.function.name == "add" and call.function.arguments.startswith('{"a"')

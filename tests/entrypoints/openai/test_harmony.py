"""gpt-oss's harmony format on a live server (`--reasoning-parser openai_gptoss
--tool-call-parser openai`), through the openai client: a tiny gpt-oss with o200k's
vocabulary (tests/harmony_model.py) whose outputs follow a script of harmony tokens
(ForceScript), so the channels come out of the real sampling path. The oracle is
openai-harmony itself: its rendering of the same conversation, its encoding of the script.
"""

from __future__ import annotations

import hashlib
import json
import lzma

import openai
import pytest
import transformers
from harmony_model import DATA, EOS, VOCAB, save_harmony_gpt_oss
from openai_server import serving

from jllm.entrypoints.openai import harmony
from jllm.sampling_params import StructuredOutputsParams

REASONING, ANSWER = "The user greets me.", "Hello there!"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ANSWERED = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
CALLED = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory) -> str:
    return save_harmony_gpt_oss(tmp_path_factory.mktemp("harmony"))


@pytest.fixture(scope="module")
def server(harmony_dir):
    flags = ("--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice")
    flags += ("--tool-call-parser", "openai", "--logits-processors", "harmony_model:ForceScript")
    with serving(harmony_dir, *flags, "--max-model-len", "1024") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def script(text: str) -> list[int]:
    return list(harmony.encoding().encode(text, allowed_special="all"))


def chat(client, text: str, **kwargs):
    body = {"vllm_xargs": {"script": script(text)}, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model="tiny-llama",
        messages=kwargs.pop("messages", MESSAGES),
        max_tokens=60,
        extra_body=body,
        **kwargs,
    )


def test_the_vocabulary_comes_from_the_tokenizer(harmony_dir):
    """The file harmony checks by sha256, written back from the model's tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(harmony_dir)
    data = harmony.o200k_from_tokenizer(tokenizer)
    assert data == lzma.decompress(DATA.read_bytes())
    assert hashlib.sha256(data).hexdigest() == harmony.O200K_SHA256
    small = transformers.AutoTokenizer.from_pretrained(harmony_dir)
    small.add_tokens(["<|not_o200k|>"])  # added tokens sit past the ranks: still o200k
    assert harmony.o200k_from_tokenizer(small) == data


def test_the_prompt_is_harmony_s_rendering(client):
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    r = chat(
        client,
        ANSWERED,
        tools=TOOLS,
        reasoning_effort="high",
        extra_body={"return_token_ids": True},
    )
    system = (
        SystemContent.new()
        .with_conversation_start_date(__import__("datetime").date.today().isoformat())
        .with_reasoning_effort(ReasoningEffort.HIGH)
    )
    fn = TOOLS[0]["function"]
    developer = (
        DeveloperContent.new()
        .with_instructions("Answer briefly.")
        .with_function_tools([ToolDescription.new(fn["name"], fn["description"], fn["parameters"])])
    )
    conversation = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "Hi"),
        ]
    )
    expected = harmony.encoding().render_conversation_for_completion(conversation, Role.ASSISTANT)
    assert r.model_extra["prompt_token_ids"] == list(expected)


def test_channels_split(client):
    r = chat(client, ANSWERED)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == REASONING
    assert message.content == ANSWER
    assert not message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    reasoning_tokens = len(script(REASONING))
    assert r.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert r.usage.completion_tokens == len(script(ANSWERED))
    hidden = chat(client, ANSWERED, extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.model_extra["reasoning"] is None
    assert hidden.choices[0].message.content == ANSWER


def test_channels_streamed(client):
    stream = chat(client, ANSWERED, stream=True, stream_options={"include_usage": True})
    reasoning, content, order, finish, usage = "", "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if (delta.model_extra or {}).get("reasoning"):
                reasoning += delta.model_extra["reasoning"]
                order.append("r")
            if delta.content:
                content += delta.content
                order.append("c")
            finish = choice.finish_reason or finish
    assert (reasoning, content, finish) == (REASONING, ANSWER, "stop")
    assert order == sorted(order, reverse=True) and len(order) > 2  # token by token
    assert usage.completion_tokens_details.reasoning_tokens == len(script(REASONING))


def test_a_tool_call(client):
    r = chat(client, CALLED, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning"] == "Need the weather."
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("chatcmpl-tool-")


def test_a_tool_call_streamed(client):
    name, arguments, ids, finish = None, "", set(), None
    for chunk in chat(client, CALLED, tools=TOOLS, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                assert call.index == 0
                ids.add(call.id) if call.id else None
                name = call.function.name or name
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, json.loads(arguments), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    assert len(ids) == 1


def test_a_multi_turn_conversation_renders(client):
    """The call and its result go back in harmony's form; the answer follows."""
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "reasoning": "Need the weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    r = chat(
        client, ANSWERED, messages=messages, tools=TOOLS, extra_body={"return_token_ids": True}
    )
    prompt = harmony.encoding().decode_utf8(r.model_extra["prompt_token_ids"])
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary json" in prompt
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny" in prompt
    )
    assert r.choices[0].message.content == ANSWER


def test_bad_requests(client):
    for effort in ("none", "max"):
        with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
            chat(client, ANSWERED, reasoning_effort=effort)
    grammar = {"structured_outputs": {"grammar": "start: /[a-z]+/"}}
    with pytest.raises(openai.BadRequestError, match="harmony"):
        chat(client, ANSWERED, extra_body=grammar)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="harmony"):
        chat(client, ANSWERED, messages=[{"role": "user", "content": [image]}])
    assert chat(client, ANSWERED).choices[0].message.content == ANSWER  # still serving


def test_the_parsers_need_gpt_oss(llama_dir):
    with pytest.raises(ValueError, match="gpt-oss"):
        with serving(llama_dir, "--enable-auto-tool-choice", "--tool-call-parser", "openai"):
            pass


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_has_its_own_parser(client, stream):
    """n=2: each choice's channels are read apart (the script forces both alike)."""
    if not stream:
        r = chat(client, ANSWERED, n=2)
        for choice in r.choices:
            assert choice.message.model_extra["reasoning"] == REASONING
            assert choice.message.content == ANSWER
        return
    got = {0: ["", ""], 1: ["", ""]}
    for chunk in chat(client, ANSWERED, n=2, stream=True):
        for choice in chunk.choices:
            got[choice.index][0] += (choice.delta.model_extra or {}).get("reasoning") or ""
            got[choice.index][1] += choice.delta.content or ""
    assert got == {0: [REASONING, ANSWER], 1: [REASONING, ANSWER]}


@pytest.fixture(scope="module")
def guidance(harmony_dir):
    """The engine's llguidance backend over the harmony tokenizer."""
    from jllm.structured_output.backends import GuidanceBackend

    return GuidanceBackend(transformers.AutoTokenizer.from_pretrained(harmony_dir), VOCAB, EOS)


def accepts(backend, params, text: str) -> bool:
    matcher = backend.matcher(backend.compile(params))
    return all(matcher.accept(t) for t in script(text))


def test_constraints_sit_in_their_channel(guidance):
    """vLLM's harmony structural tag as a grammar: free analysis messages, then a forced
    call with schema-valid arguments, or a final message under the request's constraint."""
    for choice in ("get_weather", "required"):
        forced = harmony.grammar(None, TOOLS, choice)
        assert accepts(guidance, forced, CALLED)
        assert accepts(guidance, forced, CALLED[CALLED.index("<|start|>") + 18 :])  # no analysis
        assert not accepts(guidance, forced, ANSWERED)
        assert not accepts(guidance, forced, CALLED.replace('"Paris"', "7"))
    choice = StructuredOutputsParams(choice=[ANSWER, "Bye"])
    assert accepts(guidance, harmony.grammar(choice, TOOLS, "auto"), ANSWERED)
    assert not accepts(guidance, harmony.grammar(choice, TOOLS, "auto"), CALLED)
    assert not accepts(guidance, harmony.grammar(choice, None, "none"), ANSWERED.replace("!", "?"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_json = harmony.grammar(StructuredOutputsParams(json=schema), None, "none")
    assert accepts(guidance, as_json, '<|channel|>final<|message|>{"a": 1}<|return|>')
    assert not accepts(guidance, as_json, '<|channel|>final<|message|>{"a": "x"}<|return|>')
    regex = harmony.grammar(StructuredOutputsParams(regex="a/b+"), None, "none")
    assert accepts(guidance, regex, "<|channel|>final<|message|>a/bbb<|return|>")
    assert harmony.grammar(None, TOOLS, "auto") is None


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_call(client, choice):
    """tool_choice "required" or named: the grammar and the parser together (the script is
    one the grammar accepts); a named call keeps the engine's finish reason, as without
    harmony."""
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    )
    r = chat(client, CALLED, tools=TOOLS, tool_choice=tool_choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert r.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert r.choices[0].message.model_extra["reasoning"] == "Need the weather."


def test_a_response_format_in_the_final_channel(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
        '<|channel|>final<|message|>{"a": 1}<|return|>'
    )
    r = chat(
        client,
        text,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert json.loads(r.choices[0].message.content) == {"a": 1}
    assert r.choices[0].message.model_extra["reasoning"] == "Think."

"""The Responses API (`/v1/responses`) through openai's `responses` client against the
scripted reasoning model (conftest.THINKER_SCRIPT): output items and usage, the event stream
as the SDK assembles it, input items against chat's rendering of the same conversation, the
store with `previous_response_id`, retrieval, background runs and cancel, and refusals."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai_server import HeldEngine

from jllm.entrypoints.openai.responses.convert import chat_request, input_messages
from jllm.entrypoints.openai.responses.protocol import ResponsesRequest

REASONING, ANSWER = "Let me see.", "The answer is four"
QUESTION = "What is two plus two?"


def prompt_tokens(client, messages) -> int:
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=1)
    return r.usage.prompt_tokens


def test_output_items_and_usage(agent_client):
    r = agent_client.responses.create(model="tiny-llama", input=QUESTION, max_output_tokens=40)
    assert r.status == "completed" and r.output_text == ANSWER
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING
    assert r.id.startswith("resp_") and r.output[1].id.startswith("msg_")
    chat = agent_client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": QUESTION}], max_tokens=40
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == (
        chat.usage.completion_tokens_details.reasoning_tokens
    )


def test_incomplete_at_max_output_tokens(agent_client):
    r = agent_client.responses.create(model="tiny-llama", input=QUESTION, max_output_tokens=8)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_the_stream(agent_client):
    with agent_client.responses.stream(
        model="tiny-llama", input=QUESTION, max_output_tokens=40
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (REASONING, ANSWER)
    assert final.output_text == ANSWER and final.status == "completed"
    assert [i.type for i in final.output] == ["reasoning", "message"]


def test_input_items_render_as_chat_messages(agent_client):
    """Instructions, developer messages, a function call and its output, and reasoning,
    as the chat template sees them: the same prompt tokens as chat with those messages."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Add 1 and 2."}]},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "tool"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
    ]
    request = ResponsesRequest.model_validate({"input": items, "instructions": "Be brief."})
    messages = chat_request(request, input_messages(request)).messages
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "tool",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    r = agent_client.responses.create(
        model="tiny-llama", input=items, instructions="Be brief.", max_output_tokens=2
    )
    assert r.usage.input_tokens == prompt_tokens(agent_client, messages)


def test_previous_response_id_continues_without_the_instructions(agent_client, agent_server):
    first = agent_client.responses.create(
        model="tiny-llama", input=QUESTION, instructions="Be brief.", max_output_tokens=40
    )
    second = agent_client.responses.create(
        model="tiny-llama", input="And three?", previous_response_id=first.id, max_output_tokens=40
    )
    assert second.previous_response_id == first.id and second.output_text == ANSWER
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And three?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(agent_client, messages)
    assert agent_client.responses.retrieve(second.id).output_text == ANSWER
    r = httpx.post(f"{agent_server.url}/v1/responses/{second.id}/cancel")
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        agent_client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        agent_client.responses.create(model="tiny-llama", input="x", previous_response_id="resp_x")


def test_a_function_tool_and_a_schema(agent_client):
    tool = {
        "type": "function",
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
        },
    }
    r = agent_client.responses.create(
        model="tiny-llama",
        input=QUESTION,
        tools=[tool],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=12,
    )
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "add" and call.arguments.startswith('{"a"') and call.call_id
    assert r.output[0].type == "reasoning"
    fmt = {"type": "json_schema", "name": "yn", "schema": {"enum": ["yes", "no"]}}
    r = agent_client.responses.create(
        model="tiny-llama", input=QUESTION, text={"format": fmt}, max_output_tokens=40
    )
    assert r.output_text in ('"yes"', '"no"')


def test_background_runs_and_cancel(agent_client, agent_server, monkeypatch):
    queued = agent_client.responses.create(
        model="tiny-llama", input=QUESTION, background=True, max_output_tokens=40
    )
    assert queued.status == "queued"
    while (r := agent_client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        pass
    assert r.status == "completed" and r.output_text == ANSWER
    hold = HeldEngine.install(agent_server, 4, monkeypatch)  # until the cancel aborts
    running = agent_client.responses.create(
        model="tiny-llama",
        input=QUESTION,
        background=True,
        max_output_tokens=200,
        extra_body={"ignore_eos": True},
    )
    cancelled = agent_client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and not hold.timed_out
    assert agent_client.responses.retrieve(running.id).status == "cancelled"


def test_a_background_stream_and_its_replay(agent_client, agent_server, monkeypatch):
    """background with stream: the creating request streams the events, a GET with
    stream=true&starting_after=N streams them again from N + 1; a cancel ends the stream
    without response.completed and leaves the response cancelled."""
    stream = agent_client.responses.create(
        model="tiny-llama", input=QUESTION, background=True, stream=True, max_output_tokens=40
    )
    events = list(stream)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == ANSWER
    rid = events[0].response.id
    again = agent_client.responses.retrieve(rid, stream=True, starting_after=3)
    replayed = list(again)
    assert [e.sequence_number for e in replayed] == [e.sequence_number for e in events[4:]]
    assert replayed[-1].response.output_text == ANSWER
    hold = HeldEngine.install(agent_server, 4, monkeypatch)
    running = agent_client.responses.create(
        model="tiny-llama",
        input=QUESTION,
        background=True,
        stream=True,
        max_output_tokens=200,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(running))
    assert first.type == "response.created"
    assert agent_client.responses.cancel(first.response.id).status == "cancelled"
    rest = [e.type for e in running]
    assert "response.completed" not in rest and not hold.timed_out
    assert agent_client.responses.retrieve(first.response.id).status == "cancelled"
    r = httpx.get(f"{agent_server.url}/v1/responses/{rid}x", params={"stream": "true"})
    assert r.status_code == 404
    # A sequence number, not a Python index: -5 would replay the tail, then all, twice.
    r = httpx.get(
        f"{agent_server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": -5}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"


def test_a_generated_call_is_stored_as_generated(agent_client, monkeypatch):
    """The store keeps a turn's output as the model made it: a call named "" (or null, or a
    number; the input schema refuses these from clients) still completes, and a failure while
    finishing a stream is its response.failed event, not a cut stream."""
    from jllm.entrypoints.openai.responses import serving
    from jllm.entrypoints.openai.responses.convert import call_item, history_of

    for name in ("", None, 3):
        call = call_item({"id": "c1", "function": {"name": name, "arguments": "{}"}})
        turn = history_of([{"role": "user", "content": "hi"}], [call])
        assert turn[1]["tool_calls"][0]["function"]["name"] == name
    original = serving.output_items

    def unnamed_call(chat_response):
        items, finish = original(chat_response)
        return [
            *items,
            call_item({"id": "c1", "function": {"name": "", "arguments": "{}"}}),
        ], finish

    monkeypatch.setattr(serving, "output_items", unnamed_call)
    r = agent_client.responses.create(model="tiny-llama", input=QUESTION, max_output_tokens=40)
    assert r.status == "completed" and r.output[-1].name == ""
    assert agent_client.responses.retrieve(r.id).output[-1].name == ""

    def broken(messages, output):
        raise RuntimeError("the history broke")

    monkeypatch.setattr(serving, "history_of", broken)
    stream = agent_client.responses.create(
        model="tiny-llama", input=QUESTION, stream=True, max_output_tokens=40
    )
    last = list(stream)[-1]
    assert last.type == "response.failed" and "the history broke" in last.response.error.message


def test_a_failed_background_stream_is_stored_failed(agent_client, monkeypatch):
    """background with stream: a run failing mid-stream ends the stream with response.failed
    and leaves the stored response failed (not in_progress, and no longer cancellable)."""
    from jllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from jllm.entrypoints.openai.serving_engine import OpenAIError

    original = OpenAIServingChat.chunks

    async def failing(self, run):
        async for n, chunk in aenumerate(original(self, run)):
            if n == 3:
                raise OpenAIError("the engine failed", 500)
            yield chunk

    monkeypatch.setattr(OpenAIServingChat, "chunks", failing)
    stream = agent_client.responses.create(
        model="tiny-llama", input=QUESTION, background=True, stream=True, max_output_tokens=40
    )
    events = list(stream)
    assert events[-1].type == "response.failed"
    stored = agent_client.responses.retrieve(events[0].response.id)
    assert stored.status == "failed" and stored.error.message == "the engine failed"
    with pytest.raises(openai.BadRequestError):
        agent_client.responses.cancel(stored.id)


async def aenumerate(iterable):
    n = 0
    async for item in iterable:
        yield n, item
        n += 1


def test_vllms_request_fields(agent_client):
    """vLLM's fields that reach its sampling params reach chat's: the same answer as chat
    gives with them."""
    for extra in (
        {"structured_outputs": {"regex": "a+"}},
        {"include_stop_str_in_output": True, "stop": ["answer"]},
    ):
        chat = agent_client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=30,
            extra_body=extra,
        )
        r = agent_client.responses.create(
            model="tiny-llama", input=QUESTION, max_output_tokens=30, extra_body=extra
        )
        assert r.output_text == chat.choices[0].message.content
    assert r.output_text == "The answer"
    body = {
        "input": "x",
        "skip_special_tokens": False,
        "logit_bias": {"5": 1.5},
        "vllm_xargs": {"k": 1},
    }
    request = ResponsesRequest.model_validate(body)
    chat = chat_request(request, input_messages(request))
    assert not chat.skip_special_tokens and chat.logit_bias == {"5": 1.5}
    assert chat.vllm_xargs == {"k": 1}


def test_a_partial_assistant_message_is_continued(agent_client):
    """vLLM's rule: an input ending in an assistant message still in progress (or
    incomplete) is continued, as chat's continue_final_message continues it."""
    start = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The"},
    ]
    chat = agent_client.chat.completions.create(
        model="tiny-llama",
        messages=start,
        max_tokens=10,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    items = [
        {"type": "message", "role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": "The", "status": "incomplete"},
    ]
    r = agent_client.responses.create(model="tiny-llama", input=items, max_output_tokens=10)
    assert r.output_text == chat.choices[0].message.content
    done = [items[0], {**items[1], "status": "completed"}]
    again = agent_client.responses.create(model="tiny-llama", input=done, max_output_tokens=10)
    fresh = agent_client.chat.completions.create(model="tiny-llama", messages=start, max_tokens=10)
    assert again.output_text == fresh.choices[0].message.content
    assert r.output_text != again.output_text  # the continued turn differs from a new one


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "file_search_call"}]}, 400, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "x", "background": True, "store": False}, 400, None),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, 400, "input"),
        ({"input": "x", "model": "nope"}, 404, "model"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        (
            {
                "input": "x",
                "structured_outputs": {"regex": "a+"},
                "text": {"format": {"type": "json_object"}},
            },
            400,
            "structured_outputs",
        ),
    ],
)
def test_refusals(agent_server, body, status, param):
    r = httpx.post(f"{agent_server.url}/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_without_the_store(server):
    """A server started without VLLM_ENABLE_RESPONSES_API_STORE: responses are served and
    not kept; what needs the store is refused naming the variable."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    r = client.responses.create(model="tiny-llama", input="hi", max_output_tokens=2)
    assert r.status == "incomplete"
    with pytest.raises(openai.NotFoundError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
        client.responses.create(model="tiny-llama", input="x", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
        client.responses.create(model="tiny-llama", input="x", background=True)

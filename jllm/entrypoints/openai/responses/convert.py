"""The Responses API's translations to and from the chat pipeline: a request's instructions,
stored history (`previous_response_id`) and input items as chat messages and a chat request;
a chat response as output items (reasoning, message, function calls), status and usage; a
finished turn as the history the next one continues from.
"""

from __future__ import annotations

import time
import uuid

from jllm.entrypoints.openai.protocol import ChatCompletionRequest
from jllm.entrypoints.openai.responses.protocol import (
    AssistantItem,
    ReasoningItem,
    ResponsesRequest,
)
from jllm.entrypoints.openai.serving_engine import OpenAIError
from jllm.entrypoints.openai.tool_parsers import chat_tool


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _parts(content) -> str | list[dict]:
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part["type"] == "input_image":
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            out.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out)
    return out


def continues_final_message(request: ResponsesRequest) -> bool:
    """vLLM's rule: an input that ends in an assistant message or reasoning item still
    `in_progress` or `incomplete` is continued (the chat template's
    continue_final_message), not answered after a new generation prompt."""
    if isinstance(request.input, str) or not request.input:
        return False
    last = request.input[-1]
    return isinstance(last, AssistantItem | ReasoningItem) and last.status in (
        "in_progress",
        "incomplete",
    )


def input_messages(request: ResponsesRequest) -> list[dict]:
    """The request's input (text, or items: `item_messages`) as chat messages."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    return item_messages([item.model_dump() for item in request.input])


def item_messages(items: list[dict]) -> list[dict]:
    """Items as chat messages: function calls join the assistant message before them (or
    open one), their outputs are `tool` messages, reasoning rides on the assistant message
    as `reasoning`. Items are dicts, so a turn's own output reads back as it was generated
    (the input schema's checks are for what clients send)."""
    messages: list[dict] = []

    def assistant() -> dict:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "assistant":
                assistant()["content"] += _parts(item["content"])
            else:
                messages.append({"role": role, "content": _parts(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:  # reasoning
            texts = item.get("content") or item.get("summary") or ()
            target = assistant()
            target["reasoning"] = target.get("reasoning", "") + "".join(t["text"] for t in texts)
    return messages


def chat_request(request: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that serves a Responses one: its instructions, then the
    `conversation` (the stored history and the input as chat messages)."""
    messages = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages += conversation
    body: dict = {"model": request.model, "messages": messages}
    if request.tools:
        body["tools"] = [
            chat_tool(t.name, t.description, t.parameters or {"type": "object", "properties": {}})
            for t in request.tools
        ]
        choice = request.tool_choice
        body["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
        body["parallel_tool_calls"] = request.parallel_tool_calls
    elif request.tool_choice not in ("auto", "none"):
        raise OpenAIError(
            "tool_choice other than 'auto' or 'none' needs tools.", 400, "tool_choice"
        )
    # OpenAI's stored prompt templates live on OpenAI's side: nothing here can expand one.
    if getattr(request, "prompt", None) is not None:
        raise OpenAIError("prompt template is not supported", 400, "prompt")
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and request.structured_outputs is not None:
        raise OpenAIError(
            "Cannot specify both structured_outputs and text.format", 400, "structured_outputs"
        )
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema_}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if continues_final_message(request):
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning.effort)
        body["reasoning_effort"] = request.reasoning.effort  # harmony's system message
        kwargs.setdefault("enable_thinking", request.reasoning.effort != "none")
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if "message.output_text.logprobs" in (request.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs or 0
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "cache_salt",
        "logit_bias",
        "vllm_xargs",
        "structured_outputs",
    ):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    body.update(
        ignore_eos=request.ignore_eos,
        priority=request.priority,
        include_reasoning=request.include_reasoning,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )
    if request.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    try:
        return ChatCompletionRequest.model_validate(body, strict=False)
    except ValueError as e:
        raise OpenAIError(f"Invalid request: {e}", 400) from e


def response_object(request: ResponsesRequest, response_id: str, model: str, **fields) -> dict:
    """A Response with the request's settings echoed; `fields` fill in the rest."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
    choice = request.tool_choice
    out = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": request.background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata,
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": request.reasoning.model_dump() if request.reasoning else None,
        "service_tier": request.service_tier,
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": {"type": "text"}}
        if request.text is None or request.text.format is None
        else {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": tools,
        "top_p": request.top_p,
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
    }
    if not tools and out["tool_choice"] == "auto":
        out["tool_choice"] = "none"
    out.update(fields)
    return out


def usage(chat_usage: dict, cached: int) -> dict:
    details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": chat_usage["total_tokens"],
    }


def status_of(finish_reason) -> tuple[str, dict | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def reasoning_item(text: str, item_id: str | None = None, status="completed") -> dict:
    return {
        "id": item_id or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def message_item(text: str, logprobs, item_id: str | None = None, status="completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def call_item(call: dict, item_id: str | None = None, status="completed") -> dict:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def output_items(chat_response: dict) -> tuple[list[dict], str | None]:
    """A chat response's choice as output items (reasoning, message, function calls)."""
    choice = chat_response["choices"][0]
    message = choice["message"]
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(message["content"], logprobs))
    items += [call_item(c) for c in message["tool_calls"]]
    return items, choice["finish_reason"]


def history_of(messages: list[dict], output: list[dict]) -> list[dict]:
    """What a later `previous_response_id` continues from: the conversation without the
    instructions (they are not carried over), then the output as the assistant's turn, as
    input items are read (so it renders as if the client had sent them back). The output is
    kept as generated, not checked against the input schema: a call the model named "" is
    still a finished turn (vLLM stores its messages as they are)."""
    turn = item_messages(output)
    return [*messages, *(turn or [{"role": "assistant", "content": ""}])]

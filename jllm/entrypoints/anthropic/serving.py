"""Anthropic's Messages API over the chat pipeline, as vLLM serves it: a request becomes a
chat completion request (system prompt, content blocks, tools and tool choice, stop
sequences, thinking), runs through `OpenAIServingChat` (template, tools, reasoning,
grammars), and its result or stream is told back in Anthropic's shapes:

- a message: thinking, text and tool_use blocks, `stop_reason` (`end_turn`, `max_tokens`,
  `stop_sequence` with the matched `stop_sequence`, `tool_use`) and usage;
- a stream: `message_start`, per block `content_block_start` / `content_block_delta`
  (`text_delta`, `thinking_delta`, `input_json_delta`) / `content_block_stop`, then
  `message_delta` (stop reason, output tokens) and `message_stop`; an error after the stream
  started is an `error` event.
"""

from __future__ import annotations

import contextlib
import json
import logging

from jllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
)
from jllm.entrypoints.openai.protocol import ChatCompletionRequest, StreamOptions
from jllm.entrypoints.openai.serving_engine import OpenAIError, sse_event
from jllm.entrypoints.openai.tool_parsers import chat_tool

logger = logging.getLogger(__name__)


def _image_url(source) -> str:
    if source.type == "url":
        return source.url
    return f"data:{source.media_type};base64,{source.data}"


def _parts(blocks) -> list[dict]:
    """Text and image blocks as OpenAI content parts."""
    out = []
    for b in blocks:
        if b.type == "text":
            out.append({"type": "text", "text": b.text})
        else:
            out.append({"type": "image_url", "image_url": {"url": _image_url(b.source)}})
    return out


def _content(parts: list[dict]):
    """One text part as a string (what templates expect most), else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request hash


def _system_text(content) -> str:
    """A system prompt's text without Claude Code's attribution header, whose per-request
    hash would defeat prefix caching (vLLM strips it too)."""
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    return "".join(b.text for b in content if not b.text.startswith(BILLING_HEADER))


def chat_messages(request: CountTokensRequest, merge_inline_system: bool = False) -> list[dict]:
    """The conversation as chat messages: the system prompt first; inline system messages
    where they stand, or appended to that first one when `merge_inline_system` (a template
    that refuses a system message after the first turn); a user message's tool_result blocks
    as `tool` messages (before the rest of that message, as vLLM orders them); an
    assistant's tool_use blocks as its tool calls and its thinking as `reasoning`."""
    messages = []
    system = request.system or ""
    if not isinstance(system, str):  # vLLM strips the header from blocks only
        system = _system_text(system)
    inline = [m for m in request.messages if m.role == "system"]
    if merge_inline_system:
        system += "".join(_system_text(m.content) for m in inline)
    if system or (merge_inline_system and inline):  # a message given, if empty, is kept
        messages.append({"role": "system", "content": system})
    for m in request.messages:
        if m.role == "system":
            if not merge_inline_system:
                messages.append({"role": "system", "content": _system_text(m.content)})
            continue
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        parts, calls, thinking = [], [], []
        for b in m.content:
            if b.type in ("text", "image"):
                parts.append(b)
            elif b.type == "tool_use":
                arguments = json.dumps(b.input, ensure_ascii=False)
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": arguments},
                    }
                )
            elif b.type == "tool_result":
                content = b.content
                if isinstance(content, list):
                    content = _content(_parts(content)) if content else ""
                messages.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": content or ""}
                )
            elif b.type == "thinking":
                thinking.append(b.thinking)
        message = {"role": m.role}
        if parts:
            message["content"] = _content(_parts(parts))
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning"] = "".join(thinking)
        if len(message) > 1:
            if "content" not in message:
                message["content"] = ""
            messages.append(message)
    return messages


def _thinking_and_output(request: CountTokensRequest) -> dict:
    """The chat fields of `thinking`, `output_config` and `chat_template_kwargs`: thinking as
    the template's enable_thinking (the request's own keyword arguments win, as vLLM's do),
    the effort as reasoning_effort, the format as a json_schema response_format."""
    fields: dict = {}
    thinking, config = request.thinking, request.output_config
    template_kwargs = {}
    if thinking is not None and thinking.type != "adaptive":
        template_kwargs["enable_thinking"] = thinking.type == "enabled"
    template_kwargs.update(request.chat_template_kwargs or {})
    if template_kwargs:
        fields["chat_template_kwargs"] = template_kwargs
    if config is None:
        return fields
    if config.format is not None:
        spec = {"name": config.format.type, "schema": config.format.json_schema}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    # Disabled thinking overrides an effort (vLLM sends "none" instead): enable_thinking says
    # so already, and a harmony model would refuse "none".
    if config.effort is not None and (thinking is None or thinking.type != "disabled"):
        fields["reasoning_effort"] = config.effort
    return fields


def chat_request(
    request: CountTokensRequest, merge_inline_system: bool = False
) -> ChatCompletionRequest:
    """The chat completion request that serves an Anthropic one."""
    messages = chat_messages(request, merge_inline_system)
    body: dict = {"model": request.model, "messages": messages}
    if request.tools:
        body["tools"] = [
            chat_tool(t.name, t.description, {"type": "object", **t.input_schema})
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise OpenAIError('tool_choice of type "tool" needs a name.', 400, "tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    body.update(_thinking_and_output(request))
    if isinstance(request, MessagesRequest):
        body["max_tokens"] = request.max_tokens
        for name in ("temperature", "top_p", "top_k", "cache_salt"):
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
        if request.stream:
            body["stream"] = True
            body["stream_options"] = StreamOptions(include_usage=True)
    try:
        return ChatCompletionRequest.model_validate(body, strict=False)
    except ValueError as e:
        raise OpenAIError(f"Invalid request: {e}", 400) from e


def stop_reason(finish_reason, matched, used_tools: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason and the chat `stop_reason`."""
    if finish_reason == "length":
        return "max_tokens", None
    if used_tools or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason == "stop":
        return "end_turn", None
    return None, None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicServingMessages:
    def __init__(self, chat) -> None:
        self.chat = chat  # OpenAIServingChat
        self._merge_inline_system: bool | None = None

    def _chat_request(self, request: CountTokensRequest) -> ChatCompletionRequest:
        if self._merge_inline_system is None and any(m.role == "system" for m in request.messages):
            self._merge_inline_system = self._template_refuses_inline_system()
        return chat_request(request, bool(self._merge_inline_system))

    def _template_refuses_inline_system(self) -> bool:
        """Whether the server's template refuses a system message after the first turn
        (Qwen's raise on it): then inline ones join the system prompt, as vLLM decides, at
        the price of the prefix cache past it."""
        turns = [{"role": role, "content": "t"} for role in ("system", "user") * 2]
        probe = ChatCompletionRequest.model_validate({"messages": turns})
        try:
            self.chat.render(probe)
        except Exception:  # noqa: BLE001 - any refusal of the probe means "merge"
            logger.warning(
                "The chat template requires the system message first: inline system "
                "messages in /v1/messages requests are merged into the system prompt, and "
                "each new one misses the prefix cache past it."
            )
            return True
        return False

    async def create(self, request: MessagesRequest, raw_request=None):
        run = await self.chat.start(self._chat_request(request), raw_request, prefix="msg")
        if request.stream:
            return self.events(run)
        return self.message(await self.chat.full(run))

    async def count_tokens(self, request: CountTokensRequest) -> dict:
        chat = self._chat_request(request)
        self.chat.check_request(chat)
        self.chat.tool_mode(chat)
        ids = await self.chat.prompt_ids(chat)
        return {"input_tokens": len(ids)}

    def message(self, response: dict) -> dict:
        choice = response["choices"][0]
        msg = choice["message"]
        content = []
        if msg.get("reasoning"):
            content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg["tool_calls"]:
            fn = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": fn["name"],
                    "input": _tool_input(fn["arguments"]),
                }
            )
        if not content:
            content.append({"type": "text", "text": ""})
        reason, sequence = stop_reason(
            choice["finish_reason"], choice.get("stop_reason"), bool(msg["tool_calls"])
        )
        return {
            "id": response["id"],
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": response["model"],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": response["usage"]["prompt_tokens"],
                "output_tokens": response["usage"]["completion_tokens"],
            },
        }

    async def events(self, run):
        """Anthropic's stream events (`event:` and `data:` lines) of a started chat run."""
        chunks = self.chat.chunks(run)
        async with contextlib.aclosing(chunks):
            try:
                async for event in self._events(run, chunks):
                    yield event
            except OpenAIError as e:
                yield sse_event("error", anthropic_error_body(e.message, e.status))
            except Exception as e:  # noqa: BLE001 - reported to the client, in-band
                yield sse_event("error", anthropic_error_body(f"Internal server error: {e!r}", 500))

    async def _events(self, run, chunks):
        num_prompt = len(run.prepared[0][0].prompt_token_ids)
        start = {
            "id": run.request_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.chat.served_name(run.request),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": 0},
        }
        yield sse_event("message_start", {"type": "message_start", "message": start})
        blocks = BlockStream()
        finish, matched, used_tools, output_tokens = None, None, False, 0
        async for chunk in chunks:
            if chunk.get("usage") and not chunk["choices"]:
                output_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("reasoning"):
                    for e in blocks.delta("thinking", delta["reasoning"]):
                        yield e
                if delta.get("content"):
                    for e in blocks.delta("text", delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or ():
                    used_tools = True
                    for e in blocks.tool(call):
                        yield e
                if choice.get("finish_reason") is not None:
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
        for e in blocks.close():
            yield e
        reason, sequence = stop_reason(finish, matched, used_tools)
        yield sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": output_tokens},
            },
        )
        yield sse_event("message_stop", {"type": "message_stop"})


class BlockStream:
    """The content blocks of a stream: one open at a time, numbered from 0."""

    def __init__(self) -> None:
        self.index, self.kind, self.call = -1, None, None

    def _open(self, kind: str, block: dict):
        yield from self.close()
        self.index, self.kind = self.index + 1, kind
        yield sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def close(self):
        if self.kind is not None:
            if self.kind == "thinking":
                yield self._delta({"type": "signature_delta", "signature": ""})
            yield sse_event(
                "content_block_stop", {"type": "content_block_stop", "index": self.index}
            )
        self.kind, self.call = None, None

    def _delta(self, delta: dict) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", body)

    def delta(self, kind: str, text: str):
        if self.kind != kind:
            empty = {"type": kind, kind: ""}
            if kind == "thinking":
                empty["signature"] = ""
            yield from self._open(kind, empty)
        yield self._delta({"type": f"{kind}_delta", kind: text})

    def tool(self, call: dict):
        fn = call.get("function") or {}
        if self.kind != "tool_use" or self.call != call.get("index"):
            block = {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": {}}
            yield from self._open("tool_use", block)
            self.call = call.get("index")
        if fn.get("arguments"):
            yield self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})

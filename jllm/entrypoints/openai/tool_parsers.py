"""Tool calls in chat completions: vLLM's `--tool-call-parser` formats and the grammars that
enforce `tool_choice="required"` and a named function.

A parser reads the model's text after generation: `hermes` (Hermes 2 Pro and Qwen2.5/Qwen3
templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, content before
the first block), `llama3_json` (Llama 3.1+: an optional `<|python_tag|>` and then JSON
objects `{"name": ..., "parameters"|"arguments": {...}}`), and `tool_formats.py`'s
`mistral`, `pythonic`, `qwen3_coder`/`qwen3_xml` and `deepseek_v3`; `openai` is gpt-oss's
harmony format (jllm/entrypoints/openai/harmony.py). Text that does not parse is
returned as content, as vLLM does. `stream_start` says where a tool call can begin in a
stream, so the server holds back from the content whatever might be one.
"""

from __future__ import annotations

import json
import re

from jllm.entrypoints.openai.serving_engine import OpenAIError
from jllm.entrypoints.openai.tool_calls import (  # noqa: F401 (re-exported)
    ToolCall,
    chat_tool,
    held_back,
    json_arguments,
    make_tool_call_id,
)
from jllm.entrypoints.openai.tool_formats import MORE_TOOL_PARSERS


class HermesToolParser:
    name = "hermes"
    start = "<tool_call>"
    # `<tool_call>` is a special token in Qwen's vocabulary: keep it in the text.
    skip_special_tokens = False
    _calls = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        try:
            calls = []
            for closed, open_ in self._calls.findall(text):
                obj = json.loads(closed or open_)
                calls.append(ToolCall(obj["name"], json_arguments(obj["arguments"])))
        except (ValueError, KeyError, TypeError):
            return text, []
        content = text[: text.index(self.start)]
        return (content if content.strip() else None), calls

    def stream_start(self, text: str) -> int | None:
        """Where a tool call begins or might begin (a prefix of the tag at the end)."""
        return held_back(text, (self.start,))


class Llama3JsonToolParser:
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    skip_special_tokens = True

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        """Calls only when the text starts with them (`<|python_tag|>` or `{`), as vLLM's
        parser; anything else is content."""
        stripped = text.lstrip()
        if not stripped.startswith((self.python_tag, "{")):
            return text, []
        body = stripped.replace(self.python_tag, "")
        decoder = json.JSONDecoder()
        calls, i = [], body.find("{")
        if i < 0:
            return text, []
        while i >= 0:
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or "name" not in obj:
                return text, []
            args = obj.get("arguments", obj.get("parameters"))
            if args is None:
                return text, []
            calls.append(ToolCall(obj["name"], json_arguments(args)))
            i = body.find("{", end)
        return None, calls

    def stream_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or self.python_tag.startswith(stripped[:14]):
            return 0
        return None


class OpenAIToolParser:
    """gpt-oss (`openai`): calls are harmony `commentary` messages to `functions.NAME`, read
    token by token by the server's harmony parser (jllm/entrypoints/openai/harmony.py); a
    gpt-oss model only (refused at start otherwise)."""

    name = "openai"
    harmony = True
    skip_special_tokens = True

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        return text, []

    def stream_start(self, text: str) -> int | None:
        return None


TOOL_PARSERS = {
    p.name: p
    for p in (HermesToolParser, Llama3JsonToolParser, OpenAIToolParser, *MORE_TOOL_PARSERS)
}


def check_tools(tools, tool_choice):
    """The request's tools and tool_choice checked as vLLM does; returns the tool_choice in
    effect ("none", "auto", "required" or a function name)."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise OpenAIError(f"tools[{i}] must be a function tool.", 400, "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(f"tools[{i}].function needs a name.", 400, "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be an object.", 400, "tools")
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice == "none":
        return "none"
    if not tools:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
    if tool_choice in ("auto", "required"):
        return tool_choice
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    if not isinstance(tool_choice, dict):
        raise OpenAIError(
            f"Invalid value for `tool_choice`: {tool_choice!r}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            400,
            "tool_choice",
        )
    fn = tool_choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(
            f"Expected field `name` in `function` in `tool_choice`! {usage}", 400, "tool_choice"
        )
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise OpenAIError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            400,
            "tool_choice",
        )
    return fn["name"]


def _parameters(tool) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools, single: bool = False) -> dict:
    """vLLM's schema for tool_choice="required": a non-empty array of
    {"name": one of the tools, "parameters": that tool's parameters}; of exactly one call
    when `single` (parallel_tool_calls=false, which vLLM applies by dropping the rest)."""
    defs = {}
    for tool in tools:
        for key, schema in _parameters(tool).get("$defs", {}).items():
            if key in defs and defs[key] != schema:
                raise OpenAIError(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.",
                    400,
                    "tools",
                )
            defs[key] = schema
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": {k: v for k, v in _parameters(tool).items() if k != "$defs"},
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools, name: str) -> dict:
    return next(_parameters(t) for t in tools if t["function"]["name"] == name)


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a tool_choice="required" output (an array its grammar enforced); none
    when the text is not one (cut by a stop string, say)."""
    try:
        items = json.loads(text)
        return [ToolCall(item["name"], json_arguments(item["parameters"])) for item in items]
    except (ValueError, KeyError, TypeError):
        return []

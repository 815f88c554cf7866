"""A parsed tool call and the helpers every tool-call format shares (a leaf module: the
formats in `tool_parsers.py` and `tool_formats.py` both build on it)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from jllm.utils import partial_marker


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string
    id: str | None = None  # a format's own id (Mistral's); else one is made

    def json(self) -> dict:
        return {
            "id": self.id or make_tool_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def chat_tool(name: str, description: str | None, parameters: dict) -> dict:
    """A function tool in chat's shape (what the Responses and Anthropic routes pass on)."""
    return {
        "type": "function",
        "function": {"name": name, "description": description or "", "parameters": parameters},
    }


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def json_arguments(value) -> str:
    """Arguments as the JSON string OpenAI sends (a string stays as it is)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def held_back(text: str, markers: tuple[str, ...]) -> int | None:
    """Where a tool call begins or might begin in a stream: the first marker in `text`, else
    a marker's beginning at its end (held back until the next text says which)."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    tail = partial_marker(text, markers)
    return len(text) - tail if tail else None

"""A Responses stream's events from the chat pipeline's chunks: one output item open at a
time (reasoning, then the message, then each function call), OpenAI's event types in order
(`response.output_item.added`, `response.content_part.added`, `...delta`, `...done`,
`response.output_item.done`), every event with the stream's `sequence_number`."""

from __future__ import annotations

from jllm.entrypoints.openai.responses.convert import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
)
from jllm.entrypoints.openai.serving_engine import sse_event


class EventStream:
    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []  # the finished output items
        self.kind = None  # the open item: "reasoning", "message" or "call"
        self.item_id, self.text, self.logprobs, self.call = None, "", None, None

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse_event(kind, body)

    @property
    def index(self) -> int:
        return len(self.items)

    def _open(self, kind: str, item: dict):
        yield from self.close()
        self.kind, self.item_id, self.text = kind, item["id"], ""
        yield self.event("response.output_item.added", output_index=self.index, item=item)
        if kind != "call":
            part = item["content"][0]
            yield self.event(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=self.index,
                content_index=0,
                part=part,
            )

    def reasoning(self, text: str):
        if self.kind != "reasoning":
            item = reasoning_item("", new_id("rs"), status="in_progress")
            yield from self._open("reasoning", item)
        self.text += text
        yield self.event(
            "response.reasoning_text.delta",
            item_id=self.item_id,
            output_index=self.index,
            content_index=0,
            delta=text,
        )

    def content(self, text: str, logprobs: list | None):
        if self.kind != "message":
            item = message_item("", None, new_id("msg"), status="in_progress")
            yield from self._open("message", item)
            self.logprobs = None if logprobs is None else []
        self.text += text
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        yield self.event(
            "response.output_text.delta",
            item_id=self.item_id,
            output_index=self.index,
            content_index=0,
            delta=text,
            logprobs=logprobs or [],
        )

    def tool_call(self, call: dict):
        fn = call.get("function") or {}
        if self.kind != "call" or call.get("index") != self.call["index"]:
            self.call = {"index": call.get("index"), "id": call.get("id"), "name": fn.get("name")}
            start = {
                "id": self.call["id"],
                "function": {"name": self.call["name"], "arguments": ""},
            }
            yield from self._open("call", call_item(start, new_id("fc"), status="in_progress"))
        if fn.get("arguments"):
            self.text += fn["arguments"]
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=self.item_id,
                output_index=self.index,
                delta=fn["arguments"],
            )

    def close(self):
        """Finish the open item: its `done` events, and keep it."""
        kind, i, text = self.kind, self.item_id, self.text
        if kind is None:
            return
        where = {"item_id": i, "output_index": self.index}
        if kind == "reasoning":
            item = reasoning_item(text, i)
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=text)
        elif kind == "message":
            item = message_item(text, self.logprobs, i)
            yield self.event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=text,
                logprobs=self.logprobs or [],
            )
        else:
            start = {
                "id": self.call["id"],
                "function": {"name": self.call["name"], "arguments": text},
            }
            item = call_item(start, i)
            yield self.event(
                "response.function_call_arguments.done",
                **where,
                name=self.call["name"],
                arguments=text,
            )
        if kind != "call":
            yield self.event(
                "response.content_part.done", **where, content_index=0, part=item["content"][0]
            )
        yield self.event("response.output_item.done", output_index=self.index, item=item)
        self.items.append(item)
        self.kind = None

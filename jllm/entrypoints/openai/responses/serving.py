"""`POST /v1/responses`, `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` over the
chat pipeline (`convert.py` translates, `events.py` streams).

The store is vLLM's: in memory, on when the server starts with
`VLLM_ENABLE_RESPONSES_API_STORE=1`; it keeps each response a request asked to `store` (the
default) with the conversation a `previous_response_id` continues, up to
`MAX_STORED_RESPONSES` (the oldest finished ones go first). Without it `store` has no effect
and `previous_response_id`, retrieval and `background` are refused. `background: true` returns
the response `queued` at once and runs it on the server; `GET` polls it, `cancel` stops it.
With `stream` too, its events are kept: the creating request streams them, and
`GET ...?stream=true&starting_after=N` streams them again from sequence number N + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from jllm.entrypoints.openai.responses.convert import (
    chat_request,
    history_of,
    input_messages,
    new_id,
    output_items,
    response_object,
    status_of,
    usage,
)
from jllm.entrypoints.openai.responses.events import EventStream
from jllm.entrypoints.openai.responses.protocol import ResponsesRequest
from jllm.entrypoints.openai.serving_engine import OpenAIError

MAX_STORED_RESPONSES = 4096
RUNNING = ("queued", "in_progress")
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


def not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param)


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, dict] = OrderedDict()

    def get(self, response_id: str, param: str = "response_id") -> dict:
        entry = self.entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        return entry

    def put(self, response_id: str, response: dict, history=None, task=None) -> None:
        entry = self.entries.setdefault(response_id, {"task": None})
        if entry.get("response", {}).get("status") == "cancelled":
            return  # a cancelled response stays cancelled
        entry.update(response=response, history=history)
        if task is not None:
            entry["task"] = task
        while len(self.entries) > self.capacity:
            oldest = next(
                (k for k, e in self.entries.items() if e["response"]["status"] not in RUNNING),
                None,
            )
            if oldest is None:
                break
            del self.entries[oldest]


class OpenAIServingResponses:
    def __init__(self, chat, store: bool) -> None:
        self.chat = chat  # OpenAIServingChat
        self.store = ResponseStore() if store else None
        self.tasks: set[asyncio.Task] = set()

    def _store(self, param: str) -> ResponseStore:
        if self.store is None:
            raise OpenAIError(
                f"{param} needs the response store, which this server runs without; start it "
                f"with {STORE_ENV}=1.",
                400 if param in ("background", "previous_response_id") else 404,
                param,
            )
        return self.store

    def _history(self, request: ResponsesRequest) -> list[dict]:
        if request.previous_response_id is None:
            return []
        param = "previous_response_id"
        entry = self._store(param).get(request.previous_response_id, param)
        if entry["history"] is None:
            raise OpenAIError(
                f"Response {request.previous_response_id} has not completed.", 400, param
            )
        return entry["history"]

    async def create(self, request: ResponsesRequest, raw_request=None):
        if request.background:
            self._store("background")
            if not request.store:
                raise OpenAIError("background can only be used when `store` is true.", 400)
        conversation = self._history(request) + input_messages(request)
        chat = chat_request(request, conversation)
        run = await self.chat.start(chat, raw_request, prefix="resp")
        rid = new_id("resp")
        model = self.chat.served_name(chat)
        keep = request.store and self.store is not None
        turn = (request, run, rid, model, conversation, keep)
        if request.background:
            queued = response_object(request, rid, model, status="queued")
            self.store.put(rid, queued)
            entry = self.store.entries[rid]
            if request.stream:  # the events are kept for this stream and later readers
                entry.update(events=[], done=False, changed=asyncio.Condition())
            work = self._background_stream if request.stream else self._background
            task = asyncio.create_task(work(turn, entry))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            entry["task"] = task
            return self.replay(entry, -1) if request.stream else queued
        if request.stream:
            return self.events(turn)
        return await self._full(turn)

    async def _full(self, turn) -> dict:
        chat_response = await self.chat.full(turn[1])
        items, finish = output_items(chat_response)
        return self._finish(turn, items, finish, chat_response["usage"])

    def _finish(self, turn, items: list[dict], finish, chat_usage: dict) -> dict:
        """The finished response of a turn (kept in the store when it asked to be)."""
        request, run, rid, model, conversation, keep = turn
        status, incomplete = status_of(finish)
        response = response_object(
            request,
            rid,
            model,
            status=status,
            incomplete_details=incomplete,
            output=items,
            usage=usage(chat_usage, run.cached_tokens),
        )
        if keep:
            self.store.put(rid, response, history_of(conversation, items))
        return response

    @staticmethod
    def _failed(turn, e: Exception) -> dict:
        request, _, rid, model, _, _ = turn
        message = e.message if isinstance(e, OpenAIError) else f"Internal server error: {e!r}"
        error = {"code": "server_error", "message": message}
        return response_object(request, rid, model, status="failed", error=error)

    async def _background_stream(self, turn, entry) -> None:
        """A background stream: its events into the store as they come, for `replay`."""
        request, _, rid, model, _, _ = turn
        self.store.put(rid, response_object(request, rid, model, status="in_progress"))
        events = self.events(turn)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    async with entry["changed"]:
                        entry["events"].append(event)
                        entry["changed"].notify_all()
        finally:
            entry["done"] = True
            async with entry["changed"]:
                entry["changed"].notify_all()

    async def replay(self, entry, after: int):
        """A background stream's events after sequence number `after`, following it until
        it ends (completed, failed or cancelled); leaving early leaves the run going."""
        index = after + 1
        while True:
            async with entry["changed"]:
                await entry["changed"].wait_for(
                    lambda i=index: len(entry["events"]) > i or entry["done"]
                )
            while index < len(entry["events"]):
                yield entry["events"][index]
                index += 1
            if entry["done"] and index >= len(entry["events"]):
                return

    def stream_stored(self, response_id: str, after: int | None):
        if after is not None and after < -1:  # a sequence number, not a Python index
            raise OpenAIError(
                f"starting_after must be at least -1, got {after}.", 400, "starting_after"
            )
        entry = self._store("response_id").get(response_id)
        if "events" not in entry:
            raise OpenAIError(
                "Only a response created with background and stream can be streamed again.",
                400,
                "stream",
            )
        return self.replay(entry, -1 if after is None else after)

    async def _background(self, turn, entry=None) -> None:
        request, _, rid, model, _, _ = turn
        self.store.put(rid, response_object(request, rid, model, status="in_progress"))
        try:
            await self._full(turn)
        except Exception as e:  # noqa: BLE001 - kept as the response's error (a cancel is not one)
            self.store.put(rid, self._failed(turn, e))

    def retrieve(self, response_id: str) -> dict:
        return self._store("response_id").get(response_id)["response"]

    async def cancel(self, response_id: str) -> dict:
        entry = self._store("response_id").get(response_id)
        if entry["response"]["status"] not in RUNNING or entry["task"] is None:
            raise OpenAIError("Cannot cancel a synchronous response.", 400, "response_id")
        entry["response"] = {**entry["response"], "status": "cancelled"}
        entry["task"].cancel()
        await asyncio.gather(entry["task"], return_exceptions=True)
        return entry["response"]

    async def events(self, turn):
        """The stream's events; an error after it started is a `response.failed` event."""
        request, run, rid, model, _, _ = turn
        es = EventStream()
        started = response_object(request, rid, model)
        yield es.event("response.created", response=started)
        yield es.event("response.in_progress", response=started)
        chunks = self.chat.chunks(run)
        finish, chat_usage = None, None
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    if chunk.get("usage") and not chunk["choices"]:
                        chat_usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning"):
                            for e in es.reasoning(delta["reasoning"]):
                                yield e
                        if delta.get("content"):
                            logprobs = (choice.get("logprobs") or {}).get("content")
                            for e in es.content(delta["content"], logprobs):
                                yield e
                        for call in delta.get("tool_calls") or ():
                            for e in es.tool_call(call):
                                yield e
                        finish = choice.get("finish_reason") or finish
                for e in es.close():
                    yield e
                final = self._finish(turn, es.items, finish, chat_usage)
            except Exception as e:  # noqa: BLE001 - reported in-band: the stream has started
                failed = self._failed(turn, e)
                if request.background:  # a later GET reads it as failed, not in_progress
                    self.store.put(rid, failed)
                yield es.event("response.failed", response=failed)
                return
        yield es.event("response.completed", response=final)

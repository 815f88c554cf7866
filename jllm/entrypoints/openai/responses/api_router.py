"""The Responses API routes: create, retrieve and cancel (`serving.py`)."""

from __future__ import annotations

import os

from fastapi import FastAPI, Request

from jllm.entrypoints.openai.responses.protocol import ResponsesRequest
from jllm.entrypoints.openai.responses.serving import STORE_ENV, OpenAIServingResponses
from jllm.entrypoints.openai.serving_engine import SSEResponse


def store_enabled() -> bool:
    return os.environ.get(STORE_ENV, "").lower() in ("1", "true")


def attach_responses_routes(app: FastAPI, chat, with_cancellation, check_priority) -> None:
    responses = OpenAIServingResponses(chat, store_enabled())

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request):
        check_priority(body)
        if body.stream:  # in the background too: its stream reads the stored events
            return SSEResponse(await responses.create(body, raw), framed=True)
        if body.background:  # the run outlives the connection
            return await responses.create(body, raw)
        return await with_cancellation(raw, responses.create(body, raw))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(
        response_id: str, stream: bool = False, starting_after: int | None = None
    ):
        if stream:
            return SSEResponse(responses.stream_stored(response_id, starting_after), framed=True)
        return responses.retrieve(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await responses.cancel(response_id)

"""The Messages API routes (`POST /v1/messages`, `POST /v1/messages/count_tokens`). Their
errors, validation included, are in Anthropic's body (`api_server` picks the shape by path
with `protocol.is_anthropic_path`)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from jllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from jllm.entrypoints.anthropic.serving import AnthropicServingMessages
from jllm.entrypoints.openai.serving_engine import SSEResponse


def attach_anthropic_routes(app: FastAPI, chat, with_cancellation) -> None:
    messages = AnthropicServingMessages(chat)

    @app.post("/v1/messages")
    async def create_messages(body: MessagesRequest, raw: Request):
        if body.stream:
            return SSEResponse(await messages.create(body, raw), framed=True)
        return await with_cancellation(raw, messages.create(body, raw))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return await messages.count_tokens(body)

"""The rest of vLLM's server surface around generation (`/ping` is `/health`'s route too):
`/load` (requests in flight, counted under `--enable-server-load-tracking`),
`/tokenizer_info` (`--enable-tokenizer-info-endpoint`), `GET /v1/models/{model}` (OpenAI's
retrieve), and SageMaker's `/invocations`, which serves a body the way the route whose
request it is would (chat with `messages`, completions with `prompt`)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from jllm.entrypoints.openai.auth import OPEN_PATHS
from jllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jllm.entrypoints.openai.serving_engine import OpenAIError, json_object

# Paths whose requests `/load` counts: the ones that run the model.
LOADED_PREFIXES = ("/v1/", "/inference/", "/invocations")


class LoadTracker:
    """Pure ASGI middleware: the number of model requests in flight (vLLM's server load)."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or not path.startswith(LOADED_PREFIXES):
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


def tokenizer_info(tokenizer) -> dict:
    """The tokenizer's configuration (vLLM's /tokenizer_info): its init arguments without file
    paths, its class and chat template, as JSON."""
    config = {
        k: v for k, v in tokenizer.init_kwargs.items() if k not in ("vocab_file", "merges_file")
    }
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return json.loads(json.dumps(config, default=str))


def attach_probe_routes(app: FastAPI, *, engine, args, models, created, handlers) -> None:
    """`handlers`: {"chat": create_chat_completion, "completions": create_completion}, the
    route functions `/invocations` dispatches to (none: no `/invocations`)."""
    app.state.server_load = 0
    if args.enable_server_load_tracking:
        app.add_middleware(LoadTracker, state=app.state)

    @app.get("/load")
    async def load():
        return {"server_load": app.state.server_load}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        for card in models.cards(created(), engine.max_model_len):
            if card["id"] == model:
                return card
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    if args.enable_tokenizer_info_endpoint:
        tokenizer = engine.get_tokenizer()

        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            if tokenizer is None:
                raise OpenAIError("The server runs without a tokenizer.", 404)
            return JSONResponse(tokenizer_info(tokenizer))

    if not handlers:  # a pooling model: no generation routes to dispatch to
        return
    either = {
        "anyOf": [
            {"$ref": "#/components/schemas/ChatCompletionRequest"},
            {"$ref": "#/components/schemas/CompletionRequest"},
        ]
    }
    body_doc = {"required": True, "content": {"application/json": {"schema": either}}}

    @app.post("/invocations", openapi_extra={"requestBody": body_doc})
    async def invocations(raw: Request):
        body = await json_object(raw)
        kinds = (("chat", ChatCompletionRequest), ("completions", CompletionRequest))
        for name, model in kinds:
            if name == "completions" and not {"prompt", "prompt_embeds"} & body.keys():
                continue
            try:
                request = model.model_validate(body)
            except ValidationError:
                continue
            return await handlers[name](request, raw)
        raise OpenAIError(
            "Cannot find suitable handler for request. Expected one of: "
            "ChatCompletionRequest (messages), CompletionRequest (prompt).",
            400,
        )

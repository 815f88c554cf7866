"""Anthropic's Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`) as
pydantic models, and Anthropic's error body.

Content blocks are a union on `type`, per role (a user's text, image with a base64 or URL
source, tool_result; an assistant's text, tool_use, thinking, redacted_thinking), so a
malformed or misplaced block is a 400 naming it before anything runs. Unknown top-level
fields are accepted (as the OpenAI routes do: vLLM's behaviour); `metadata` is accepted and
has no effect. vLLM's own fields beside Anthropic's (`chat_template_kwargs`, `cache_salt`) mean
what they mean on chat completions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from jllm.entrypoints.openai.protocol import Int, NonEmpty, OpenAIBaseModel, StopList
from jllm.entrypoints.openai.serving_engine import error_response

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error_body(message: str, status: int) -> dict:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def anthropic_error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, status), status_code=status)


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/") in ANTHROPIC_PATHS


def route_path(scope) -> str:
    """A request's path as the routes name it (behind --root-path too)."""
    return scope["path"].removeprefix(scope.get("root_path", "")) or "/"


def route_error_response(scope, message: str, status: int, param: str | None = None):
    """An error in the body its route's API uses: Anthropic's on /v1/messages, else
    OpenAI's."""
    if is_anthropic_path(route_path(scope)):
        return anthropic_error_response(message, status)
    return error_response(message, status, param)


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class Base64Source(OpenAIBaseModel):
    type: Literal["base64"]
    media_type: NonEmpty
    data: NonEmpty


class URLSource(OpenAIBaseModel):
    type: Literal["url"]
    url: NonEmpty


class ImageBlock(OpenAIBaseModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]


class ToolResultBlock(OpenAIBaseModel):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool | None = None


class ThinkingBlock(OpenAIBaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIBaseModel):
    type: Literal["redacted_thinking"]
    data: str


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class UserMessage(OpenAIBaseModel):
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


class SystemMessage(OpenAIBaseModel):
    """An inline system message (Claude Code sends per-turn reminders so): text only."""

    role: Literal["system"]
    content: str | list[TextBlock]


Message = Annotated[UserMessage | AssistantMessage | SystemMessage, Field(discriminator="role")]


class Tool(OpenAIBaseModel):
    name: NonEmpty
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: NonEmpty | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(OpenAIBaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int(1) | None = None


class JsonOutputFormat(OpenAIBaseModel):
    """Output constrained to a JSON schema (chat's `response_format` of type json_schema)."""

    type: Literal["json_schema"] = "json_schema"
    # `schema` on the wire; the attribute's name would shadow pydantic's `BaseModel.schema`.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    # Chat's `reasoning_effort` (the template's, and harmony's system message).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(OpenAIBaseModel):
    model: NonEmpty
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # vLLM's: keyword arguments for the chat template, over what `thinking` and `effort` set.
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int(1)
    stop_sequences: StopList | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Int(0) | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        # Anthropic's rule and vLLM's: the thinking budget is part of max_tokens, so a budget
        # that fills it leaves no room for the answer.
        thinking = self.thinking
        if (
            thinking is not None
            and thinking.type == "enabled"
            and thinking.budget_tokens is not None
            and thinking.budget_tokens >= self.max_tokens
        ):
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

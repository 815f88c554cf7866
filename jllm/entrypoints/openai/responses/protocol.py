"""The Responses API's request body (`POST /v1/responses`) as pydantic models: input as text or
a list of items (messages with text and image parts, function calls and their outputs,
reasoning), function tools, `text.format`, `reasoning`, the store's fields, and vLLM's extra
sampling fields. Tool kinds other than functions (web search, file search, MCP, ...) and
encrypted reasoning are refused by the schema, naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from jllm.entrypoints.openai.protocol import (
    Count,
    Int,
    NonEmpty,
    OpenAIBaseModel,
    StopList,
    TokenId,
)


class InputText(OpenAIBaseModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(OpenAIBaseModel):
    type: Literal["input_image"]
    image_url: NonEmpty
    detail: Literal["low", "high", "auto"] | None = None


Part = Annotated[InputText | OutputText | InputImage, Field(discriminator="type")]


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class AssistantItem(OpenAIBaseModel):
    """An assistant's earlier answer: text only."""

    type: Literal["message"] = "message"
    role: Literal["assistant"]
    content: str | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # refused: nothing here can decrypt it
    status: str | None = None


Item = MessageItem | AssistantItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: NonEmpty


class PlainFormat(OpenAIBaseModel):
    type: Literal["text", "json_object"]


class SchemaFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: PlainFormat | SchemaFormat | None = None


class ReasoningConfig(OpenAIBaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: NonEmpty | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = (
        None
    )
    top_logprobs: Int(0, 20) | None = None
    store: bool = True
    background: bool = False
    previous_response_id: NonEmpty | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extra sampling fields.
    top_k: Int(-1) | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: Int(0) | None = None
    stop: NonEmpty | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    cache_salt: NonEmpty | None = None
    priority: Int(-(2**63)) = 0
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token id (as a string, JSON's keys) -> a bias in [-100, 100], as chat's.
    logit_bias: dict[str, float] | None = None
    # Arguments for custom logits processors (SamplingParams.extra_args).
    vllm_xargs: dict[str, Any] | None = None
    # vLLM's constraint object, as chat's; not with `text.format`.
    structured_outputs: dict[str, Any] | None = None

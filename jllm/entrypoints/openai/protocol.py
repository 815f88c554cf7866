"""Request bodies of the OpenAI API (with vLLM's extra sampling fields) as pydantic models,
and their translation to `SamplingParams`.

Unknown fields are accepted and logged, as vLLM does. Fields that OpenAI or vLLM define but
jllm cannot honour yet (`lora_request`, `best_of`) are rejected with a 400 that names the
field when they are set, never silently ignored.

Structured outputs come from `response_format` (OpenAI's `json_object` and `json_schema`,
and vLLM's `structural_tag`), vLLM's `structured_outputs` object, or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields; giving two
constraints is a 400.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from jllm.config import limits
from jllm.config.limits import INT64_MAX, MAX_N_SEQUENCES
from jllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

NonEmpty = Annotated[str, Field(min_length=1)]
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # a token id as a JSON object key
# Every integer field is bounded (64 bits, as vLLM's), so no value reaches an engine row
# unchecked; the engine narrows what it stores further (top_k to the vocabulary).


def _integral(value):
    """JSON Schema's integers include 1.0: take an integral float as its int (strict mode
    refuses it otherwise); a string or a fraction stays refused."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= INT64_MAX:
        return int(value)
    return value


def Int(ge: int, le: int = INT64_MAX):  # noqa: N802 - a type
    """An integer in [ge, le] (the constraints before the validator: after it, or on a
    union's Field, pydantic's schema loses them)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


TokenId = Int(0)  # /openapi.json adds the vocabulary's top


def _at_most_stop_strings(stops: list[str]) -> list[str]:
    """VLLM_MAX_STOP_STRINGS, read when a request is checked (and when the schema is
    written), so a test may raise it."""
    if len(stops) > limits.MAX_STOP_STRINGS:
        raise ValueError(
            f"List should have at most {limits.MAX_STOP_STRINGS} items after validation, "
            f"not {len(stops)} (VLLM_MAX_STOP_STRINGS)."
        )
    return stops


def _stop_list_schema(schema: dict) -> None:
    """The published bound, in the place `Field(max_length=...)` gives it (the document, and
    so the contract test's derandomized examples, stay as they were)."""
    rest = {k: schema.pop(k) for k in list(schema) if k != "items"}
    schema.update(maxItems=limits.MAX_STOP_STRINGS, **rest)


StopList = Annotated[
    list[NonEmpty],
    AfterValidator(_at_most_stop_strings),
    Field(json_schema_extra=_stop_list_schema),
]
Count = Int(1)

# Defined by OpenAI or vLLM, not honoured by jllm yet: a 400 naming the field when set.
UNSUPPORTED_FIELDS = ("lora_request",)  # and best_of, even 0 or 1
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class FieldError(ValueError):
    """A request field's value is invalid: a 400 whose `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class OpenAIBaseModel(BaseModel):
    # Strict: a value of the wrong JSON type is a 400, as the published schema says (no
    # "5" for 5, no "true" for true). Python's JSON reader takes NaN and Infinity: refused.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    # vLLM's current defaults: no usage unless asked, even with `stream_options: {}`.
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int(1, MAX_N_SEQUENCES) = 1
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    stop: NonEmpty | StopList | None = None
    seed: Int(-(2**63)) | None = None  # the full 64-bit range; -1 is a random seed (vLLM's)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: Int(-1) | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: Int(0) = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Count | None = None
    # Requests share prefix-cache blocks only with requests of the same salt.
    cache_salt: NonEmpty | None = None
    # Token id (as a string, JSON's keys) -> a bias in [-100, 100], OpenAI's range.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[NonEmpty] | None = None
    # Arguments for custom logits processors (SamplingParams.extra_args), as vLLM's field.
    vllm_xargs: dict[str, Any] | None = None
    # vLLM's beam search (not with stream): the best `n` beams.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Lower first under --scheduling-policy priority (a nonzero one under fcfs is a 400).
    priority: Int(-INT64_MAX - 1) = 0
    # vLLM's: the prompt's logprobs in the response (not with stream, as vLLM).
    prompt_logprobs: Int(-1) | None = None
    # vLLM's: the prompt's and each choice's token ids in the response.
    return_token_ids: bool | None = None
    # Structured outputs (see the module's docstring).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # Defined by OpenAI or vLLM, not supported by jllm yet (a 400 when set).
    best_of: Int(1) | None = None
    lora_request: Any = None

    def check_stream_options(self) -> None:
        """vLLM's rule: stream options only with a stream (an empty object passes)."""
        opts = self.stream_options
        if opts is not None and not self.stream and (opts.model_fields_set or opts.model_extra):
            raise FieldError(
                "stream_options", "Stream options can only be defined when `stream=True`."
            )

    def unsupported_field(self) -> str | None:
        """The first field set that jllm cannot honour, if any."""
        for name in UNSUPPORTED_FIELDS:
            if getattr(self, name):
                return name
        if self.best_of is not None:
            return "best_of"
        return None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's grammar constraint, if any (FieldError naming the field)."""
        given = {}
        if self.structured_outputs is not None:
            given["structured_outputs"] = dict(self.structured_outputs)
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given[name] = {kind: getattr(self, name)}
        fmt = self.response_format
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in (
                "text",
                "json_object",
                "json_schema",
                "structural_tag",
            ):
                raise FieldError(
                    "response_format",
                    "type must be one of 'text', 'json_object', 'json_schema' or "
                    f"'structural_tag', got {fmt!r}.",
                )
            kind = fmt["type"]
            if kind == "json_object":
                given["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise FieldError(
                        "response_format",
                        'json_schema needs {"name": ..., "schema": {...}} with the schema '
                        "as an object.",
                    )
                given["response_format"] = {"json": spec["schema"]}
            elif kind == "structural_tag":
                given["response_format"] = {"structural_tag": json.dumps(fmt)}
        if len(given) > 1:
            names = sorted(given)
            raise FieldError(
                names[0], f"Give one structured outputs constraint, not several: {names}."
            )
        if not given:
            if self.guided_whitespace_pattern is not None:
                raise FieldError(
                    "guided_whitespace_pattern", "applies only with a JSON constraint."
                )
            return None
        ((param, fields),) = given.items()
        if self.guided_whitespace_pattern is not None:
            fields["whitespace_pattern"] = self.guided_whitespace_pattern
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise FieldError(param, str(e)) from None

    def checked_logit_bias(self) -> dict[int, float] | None:
        """OpenAI's rules: keys are token ids, values within [-100, 100]."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not TOKEN_ID_KEY.fullmatch(key):  # int() would take "+5", " 5" and "05"
                raise FieldError("logit_bias", f"key {key!r} is not a token id.")
            token = int(key)
            if not -100.0 <= bias <= 100.0:
                raise FieldError(
                    "logit_bias", f"the bias of token {token} must be in [-100, 100], got {bias}."
                )
            out[token] = bias
        return out

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict | None = None,
    ) -> SamplingParams:
        """vLLM's defaults where the request leaves a field out: the model's generation config
        (`defaults`, see `generation_config`), else temperature 1, top_p 1, top_k off, min_p 0,
        repetition_penalty 1. A generation config's max_tokens caps the request's, as in
        vLLM. Raises ValueError for invalid values."""
        defaults = defaults or {}

        def pick(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        if "max_tokens" in defaults:
            cap = defaults["max_tokens"]
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=self.checked_logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            extra_args=self.vllm_xargs,
            bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class ContentPart(OpenAIBaseModel):
    """One part of a message's content: its `type` ("text", "image_url", ...) and, for
    text, the text; the other kinds' fields ride along (the chat handler checks them)."""

    type: NonEmpty
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """A chat message: a role (vLLM takes any role string, as its custom message type),
    text or content parts, and an assistant's tool calls. Other fields reach the chat
    template unchanged."""

    role: NonEmpty
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def _message_dicts(messages: list[ChatMessage] | None) -> list[dict] | None:
    """Validated messages back as the dicts the chat templates take (only what was sent)."""
    if messages is None:
        return None
    return [m.model_dump(exclude_unset=True) for m in messages]


Messages = Annotated[list[ChatMessage], Field(min_length=1), AfterValidator(_message_dicts)]


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
        | None
    ) = None
    # vLLM's: prompts as embeddings (--enable-prompt-embeds), each the base64 of a torch.save
    # or safetensors file of one [tokens, hidden_size] tensor; they come before `prompt`'s
    prompt_embeds: NonEmpty | list[NonEmpty] | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_prompt_beside_embeds(cls, data):
        """vLLM counts an empty `prompt` as none: beside embeddings it adds no prompt (the
        `openai` client needs some `prompt`)."""
        if isinstance(data, dict) and data.get("prompt") == "" and data.get("prompt_embeds"):
            data = {**data, "prompt": None}
        return data

    max_tokens: Count | None = 16
    logprobs: Int(-1) | None = None  # -1: the whole vocabulary (within max_logprobs)
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Messages
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Int(-1) | None = None  # -1: the whole vocabulary (within max_logprobs)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # merged over the engine's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # With --reasoning-parser: false leaves the reasoning out of the response.
    include_reasoning: bool = True
    # vLLM's values; given to the chat template (with enable_thinking: effort != "none"),
    # and to harmony's system message for gpt-oss (low, medium or high there).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )

    def template_kwargs(self) -> dict:
        """`chat_template_kwargs` with what reasoning_effort adds (the request's own win)."""
        extra = {}
        if self.reasoning_effort is not None:
            extra = {
                "reasoning_effort": self.reasoning_effort,
                "enable_thinking": self.reasoning_effort != "none",
            }
        kwargs = self.chat_template_kwargs
        return {**extra, **kwargs} if isinstance(kwargs, dict) else kwargs


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # passed to the chat template, as in chat
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]

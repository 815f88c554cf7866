"""The pooling routes' request bodies, with vLLM's field names and defaults. Unknown fields
are ignored, as vLLM's are; a field of the wrong type or out of range is a 400."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from jllm.entrypoints.openai.protocol import Int, Messages, NonEmpty, OpenAIBaseModel, TokenId

TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# One text, texts, one prompt of token ids, or prompts of token ids.
Input = str | list[str] | TokenIds | list[TokenIds]
EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


class PoolingBase(OpenAIBaseModel):
    """What every pooling route takes (vLLM's PoolingBasicRequestMixin and its
    tokenization fields)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Int(-1) | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: Int(-(2**63)) = 0
    cache_salt: NonEmpty | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data):
        if isinstance(data, dict) and "normalize" in data:
            raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
        return data


class EncodingFields(OpenAIBaseModel):
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal[EMBED_DTYPES] = "float32"  # type: ignore[valid-type]
    endianness: Literal["native", "big", "little"] = "native"


class ChatFields(OpenAIBaseModel):
    """An input given as chat messages (rendered by the chat template, then pooled)."""

    messages: Messages | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


class EmbeddingRequest(PoolingBase, EncodingFields, ChatFields):
    input: Input | None = None
    dimensions: Int(1) | None = None


class ClassificationRequest(PoolingBase, ChatFields):
    input: Input | None = None


class PoolingRequest(PoolingBase, EncodingFields, ChatFields):
    input: Input | None = None
    task: Literal["embed", "classify"] | None = None
    dimensions: Int(1) | None = None


Texts = NonEmpty | Annotated[list[str], Field(min_length=1)]


class ScoreRequest(PoolingBase):
    """vLLM's score body: `queries`/`documents` (also `items`), or the older `data_1`/`data_2`
    and `text_1`/`text_2`."""

    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    max_tokens_per_query: Int(0) = 0
    max_tokens_per_doc: Int(0) = 0

    def sides(self):
        for first, second in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            a, b = getattr(self, first), getattr(self, second)
            if a is not None and b is not None:
                return a, b
        raise ValueError("Give queries and documents (or data_1 and data_2) to score.")


class RerankRequest(PoolingBase):
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Int(0) = 0
    max_tokens_per_query: Int(0) = 0
    max_tokens_per_doc: Int(0) = 0

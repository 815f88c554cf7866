"""Output objects with vLLM's field names: `RequestOutput`, `CompletionOutput`, `Logprob`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token: None for the first, then the prompt token plus the top-k.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class WeightVersionSpan:
    """Output tokens [start, end) were sampled with the weights labelled `version`."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The weight versions its tokens were sampled under (RL), on the final output only.
    weight_versions: list[WeightVersionSpan] | None = None
    # enable_return_routed_experts: each position's experts per layer, [positions, layers,
    # top-k] uint8 (uint16 past 256 experts), from routed_experts_prompt_start to the token
    # before the last (the last is sampled, never run); on the final output only.
    routed_experts: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    encoder_prompt: None = None
    lora_request: object | None = None  # the LoRARequest it ran with (jllm/lora/request.py)
    kv_transfer_params: None = None
    extra: dict = field(default_factory=dict, repr=False)


# ---- pooling (vLLM's names; the vectors are numpy arrays, not torch tensors) ------------
@dataclass
class PoolingOutput:
    data: np.ndarray  # what the head made of the pooled hidden state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolingOutput) and bool(np.array_equal(self.data, other.data))


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: object  # PoolingOutput, or the task's output below
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    error: str | None = None  # why the request failed, if it did

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        return cls(
            request_id=out.request_id,
            outputs=cls._output(out.outputs),
            prompt_token_ids=out.prompt_token_ids,
            num_cached_tokens=out.num_cached_tokens,
            finished=out.finished,
            error=out.error,
        )

    @staticmethod
    def _output(pooled: PoolingOutput):
        return pooled


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput):
    @staticmethod
    def _output(pooled: PoolingOutput) -> EmbeddingOutput:
        if pooled.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(pooled.data.tolist())


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput):
    @staticmethod
    def _output(pooled: PoolingOutput) -> ClassificationOutput:
        if pooled.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(pooled.data.tolist())


@dataclass
class ScoringOutput:
    score: float


class ScoringRequestOutput(PoolingRequestOutput):
    @staticmethod
    def _output(pooled: PoolingOutput) -> ScoringOutput:
        data = np.asarray(pooled.data).squeeze()
        if data.ndim != 0:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(float(data))

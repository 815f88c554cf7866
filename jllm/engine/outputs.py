"""What crosses between the front end and the engine core (vLLM V1's `EngineCoreRequest` and
`EngineCoreOutput(s)`): plain data, no text, no JAX.

The front end (`LLMEngine` / `AsyncLLM`, engine/output_processor.py) sends one
`EngineCoreRequest` per user request; the core (engine/core.py) answers each step with an
`EngineCoreOutputs`: per sequence that moved, its new token ids with their raw logprob arrays,
its prompt-logprob arrays, and the finish the core decided (EOS, stop token ids, length,
error, a grammar that failed to compile). Text, stop strings and `RequestOutput`s are the
front end's. Through a client (engine/core_client.py) these records are the whole interface,
so a core could as well run in another thread, process or host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jllm.sampling_params import SamplingParams


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The id of sequence `index` of a user request of `n`: the request's own id when n == 1
    (vLLM's naming of parallel sampling's children otherwise)."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass(kw_only=True, slots=True)
class EngineCoreRequest:
    """A validated user request: its `n` sequences get seeds `seed`, `seed + 1`, ... and
    share its prompt, cache salt, priority, LoRA adapter and images."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    lora: object | None = None  # its LoRA adapter (jllm/lora/peft.py:LoraAdapter)
    mm_items: list = field(default_factory=list)  # its images (engine/multimodal.py)
    # An embeddings prompt's rows [tokens, D] float32 (its token ids are placeholders)
    prompt_embeds: object | None = None
    # A pooling request (jllm/pooling): its verified PoolingParams; `sampling_params` then
    # runs its prompt and ends it after one placeholder token.
    pooling_params: object | None = None


@dataclass(kw_only=True, slots=True)
class EngineCoreOutput:
    """One sequence's results of one step. `request_id` is the sequence's id
    (`sequence_id`)."""

    request_id: str
    new_token_ids: list[int]
    # One per new token when the request asked for logprobs: the runner's SampledToken
    # (its logprob and rank, the top ids and their logprobs as numpy arrays), as sampled.
    new_logprobs: list | None = None
    # Prompt logprobs computed this step: (prompt position of the first target, logprobs [n],
    # ranks [n], top ids [n, J], top logprobs [n, J]), as the runner returns them.
    new_prompt_logprobs: tuple | None = None
    # "stop" (EOS or a stop token id, named by `stop_reason`), "length", "abort" or "error";
    # None while it runs. A stop string is the front end's to find.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # its prefix-cache hit, in tokens
    first_scheduled_time: float | None = None
    # Seconds of the steps it was in spent scheduling and in the runner (summed only with
    # --collect-detailed-traces, for the request's span).
    scheduler_time: float = 0.0
    model_execute_time: float = 0.0
    # The weight version its new tokens were sampled under (one step: one version).
    weight_version: str | None = None
    # enable_return_routed_experts: the routing rows that became final this step
    # ([n, L, k], engine/routed_experts.py), or None
    routed_experts: object = None
    # A pooling request's final-norm hidden state [D] float32 (jllm/pooling), at its end
    pooled: object = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True, slots=True)
class EngineCoreOutputs:
    """A step's outputs; `timestamp` is the core's clock (time.time()) when it applied them,
    which the front end takes as their tokens' time."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0

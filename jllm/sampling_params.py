"""`SamplingParams`: vLLM's sampling parameters, names, defaults and validation.

Host-side only (no JAX). The device sampler reads these through `runner/sampling.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from jllm.config.limits import check_num_sequences

# Temperatures below this are greedy, as in vLLM.
SAMPLING_EPS = 1e-5
# Token ids the sampler can suppress per sequence (EOS and stop_token_ids under min_tokens).
MAX_SUPPRESS = 16
FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint of one request: exactly one of `json` (a JSON
    schema, as a dict or a string), `regex`, `choice`, `grammar` (EBNF/GBNF; Lark with the
    guidance backend), `json_object` (any JSON object) or `structural_tag` (xgrammar's
    structural-tag JSON). The grammar backend is the engine's (`structured_outputs_config`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The backend the engine chose for this request (set when it is validated).
    _backend: str | None = field(default=None, init=False, repr=False, compare=False)

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {given}."
            )
        if not given:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are "
                f"specified (one of {list(self.KINDS)})."
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of strings.")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}.")
        if self.grammar == "":
            raise ValueError("grammar cannot be an empty string.")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                "json must be a JSON schema (an object or its text), got "
                f"{type(self.json).__name__}."
            )
        if self.json_object is False:
            raise ValueError("json_object must be true when given.")
        for name in (
            "json_object",
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {type(value).__name__}.")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) is not None)

    @property
    def spec(self):
        """The constraint itself (a JSON schema as a canonical string)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            import json

            return json.dumps(value, sort_keys=True)
        return value


# vLLM's older name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Arguments for custom logits processors (vLLM's `extra_args`; the server's vllm_xargs).
    extra_args: dict | None = None
    # RL (engine's enable_return_routed_experts): skip the first this many prompt tokens in
    # the returned routing (a multi-turn agent's prefix returned in an earlier turn).
    routed_experts_prompt_start: int = 0
    # A grammar the output must follow (vLLM's `structured_outputs`; `guided_decoding` is
    # its older name). A dict is read as the parameters' fields.
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    # Filled by the engine: the tokenizer's EOS id and ids that end generation.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine from `bad_words` and the tokenizer (vLLM's `bad_words_token_ids`).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            # JSON object keys arrive as strings; vLLM converts them the same way.
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}."
                ) from e
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("Give structured_outputs or guided_decoding, not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's: a random seed
            self.seed = None
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters have no effect, as in vLLM.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        check_num_sequences(self.n)
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        for name in (
            "min_tokens",
            "max_tokens",
            "logprobs",
            "prompt_logprobs",
            "routed_experts_prompt_start",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__}.")
        if self.routed_experts_prompt_start < 0:
            raise ValueError(
                "routed_experts_prompt_start must be between 0 and the prompt length, got "
                f"{self.routed_experts_prompt_start}."
            )
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by jllm yet; leave it unset.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}."
            )
        if self.logit_bias and not all(math.isfinite(b) for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite numbers.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids is not None and empty!")
        if self.bad_words is not None and not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError("bad_words must be a list of strings.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_bias(self) -> bool:
        """Whether the request has a fixed per-token bias or mask (`runner/logit_bias.py`)."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids is not None
            or any(len(w) == 1 for w in self.bad_words_token_ids)
        )

    @property
    def multi_token_bad_words(self) -> list[list[int]]:
        return [w for w in self.bad_words_token_ids if len(w) > 1]

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search` (`jllm/beam_search.py`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check_num_sequences(self.beam_width, "beam_width")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")

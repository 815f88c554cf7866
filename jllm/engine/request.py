"""Host-side state of one sequence being generated (one `n` branch of a user request)."""

from __future__ import annotations

import enum
import hashlib
import time

from jllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # A request-level internal error (vLLM's): the server answers it with a 500.
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    """A sequence: the prompt, the tokens generated so far and how much of it is computed.

    The scheduler only ever reasons about `num_computed_tokens` against `num_tokens`: a
    prefill, a chunk of one, a decode and a prefix-cache hit are all the same thing.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        seed: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora=None,
        mm_items=(),
        prompt_embeds=None,
    ) -> None:
        self.request_id = request_id
        # An embeddings prompt's rows [prompt tokens, D] float32, which the forward takes
        # instead of its placeholder token ids' embeddings; None for a token prompt.
        self.prompt_embeds = prompt_embeds
        self._embeds_digests: dict[int, bytes] = {}
        # Its images (engine/multimodal.py:ImageItem), in prompt order.
        self.mm_items = list(mm_items)
        # Its LoRA adapter (jllm/lora/peft.py:LoraAdapter) or None, and the device slot it
        # pins while running (1-based; 0: none).
        self.lora = lora
        self.lora_slot = 0
        self.priority = priority  # lower first, under scheduling_policy="priority"
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.seed = seed  # per-sequence PRNG seed; token i uses fold_in(seed, i)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first schedule
        self.cache_salt = cache_salt  # only requests with the same salt share cached blocks
        # ... and the same adapter, by the digest of its files
        self.lora_digest = None if lora is None else lora.digest
        self.block_hashes: list[bytes] = []
        # Draft tokens a proposer wrote for the next step, to be verified there.
        self.spec_token_ids: list[int] = []
        # Tokens being sampled by steps in flight whose results the engine has not seen yet
        # (async scheduling): the scheduler counts them as known.
        self.num_output_placeholders = 0
        # Structured outputs: the sequence's grammar matcher (jllm/structured_output), set
        # when its grammar is compiled; it accepts every appended token.
        self.grammar = None
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Seconds of the steps it was in, spent scheduling and in the runner (summed only
        # with --collect-detailed-traces; vLLM's scheduler_time and model_execute_time).
        self.scheduler_time = 0.0
        self.model_execute_time = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def embeds_digest(self, start: int, end: int) -> bytes | None:
        """sha256 of the prompt embedding rows at positions start .. end - 1 (a block's: a
        prefix-cache key's extra key, as vLLM's); None past them or for a token prompt."""
        if self.prompt_embeds is None or start >= len(self.prompt_embeds):
            return None
        digest = self._embeds_digests.get(start)
        if digest is None:
            rows = self.prompt_embeds[start:end]
            digest = hashlib.sha256(str(rows.shape).encode() + rows.tobytes()).digest()
            self._embeds_digests[start] = digest
        return digest

    def reached_length(self, max_model_len: int, pending: int = 0) -> bool:
        """Whether the sequence is at its length limit (`max_tokens`, else the context),
        counting `pending` tokens not appended yet."""
        p = self.sampling_params
        max_tokens = p.max_tokens if p.max_tokens is not None else max_model_len
        return (
            self.num_tokens + pending >= max_model_len
            or self.num_output_tokens + pending >= max_tokens
        )

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.finished

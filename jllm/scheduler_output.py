"""What the scheduler hands the model runner each step (vLLM V1's `SchedulerOutput`).

A request's full data crosses once, when it enters the running set (`NewRequestData`, again
after a preemption, since jllm recomputes a preempted request from scratch); after that only
deltas do (`CachedRequestData`: new block ids and how far the request is computed). The
runner keeps the rest in its persistent input batch and appends the tokens it samples itself,
so neither side holds the other's objects. Plain data: no JAX, no engine import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jllm.sampling_params import SamplingParams

# Prompt tokens per step whose prompt logprobs are computed: the runner gathers their hidden
# states into a fixed-size array (`runner/prompt_logprobs.py`), and the scheduler caps the
# chunks of requests that asked for prompt logprobs to fit it.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before a preemption (empty when new)
    sampling_params: SamplingParams
    seed: int
    eos_token_id: int | None
    block_ids: tuple[list[int], ...]  # one list per KV-cache group
    num_computed_tokens: int  # before this step (the prefix-cache hit)
    lora_slot: int = 0  # the device slot of its LoRA adapter (1-based; 0: none)
    lora: object | None = None  # that adapter (jllm/lora/peft.py:LoraAdapter)
    # An embeddings prompt: its token ids are placeholders (no prompt tokens to penalize)
    prompt_is_embeds: bool = False
    # M-RoPE (Qwen-VL): its images' (first token, token count, grid_h, grid_w) in the language
    # model's tokens (engine/mrope.py); empty without images
    mrope_spans: tuple = ()


@dataclass
class CachedRequestData:
    """Running requests scheduled again: parallel lists, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    # Appended to its block tables: one list per KV-cache group.
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # drafts included
    total_num_scheduled_tokens: int = 0
    # Draft tokens to verify, per request: its row carries 1 + len(drafts) tokens and
    # samples after each of them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the runner drops from its batch before this step: finished or aborted since
    # the last step, and preempted ones (they come back as new requests).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    # Requests with a grammar that sample in this step, and (filled by the engine core from
    # their matchers) each one's bitmask rows [1 + drafts, ceil(V / 32)] int32.
    structured_output_request_ids: set[str] = field(default_factory=set)
    grammar_bitmask: dict = field(default_factory=dict)
    # Images: (encoder-cache pages, pixels, patch grid or None) of each image to encode before
    # this step, and per request the (first token, token count, pages) of every image its
    # scheduled tokens touch (engine/encoder_cache.py).
    encoder_inputs: list[tuple[tuple, object, object]] = field(default_factory=list)
    mm_slots: dict[str, list[tuple[int, int, tuple]]] = field(default_factory=dict)
    # The host KV tier (engine/host_kv_tier.py): blocks to copy before this step, device to
    # host (pool, device block, host block) for blocks (and state snapshots) evicted from
    # the device's prefix cache, then host to device (pool, host block, device block) for
    # host hits.
    kv_stores: list[tuple[int, int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int, int]] = field(default_factory=list)
    # Per-request state snapshots (engine/single_type_manager.py: StateManager): slots to
    # copy before this step's forward, in order, as (KV-cache group, source, destination).
    state_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # Embeddings prompts (enable_prompt_embeds): per request, the rows [n, D] float32 of its
    # scheduled prompt positions, from its first scheduled token on (engine/request.py)
    prompt_embeds: dict[str, object] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """The tokens each scheduled request produced this step, in order: none for a prefill
    chunk that does not reach its end, one for a decode, 1..k+1 for a row verifying k
    drafts (the accepted drafts, then the token sampled after them)."""

    sampled: dict[str, list] = field(default_factory=dict)  # req id -> [SampledToken]
    # req id -> (prompt position of the first target, target logprobs [n], ranks [n],
    # top ids [n, J], top logprobs [n, J]) for requests that asked for prompt logprobs
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)
    # req id -> the next step's draft tokens, from a speculative draft model on the device
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req id -> why its admission failed: the engine fails that request alone (its tokens
    # this step were computed with neutral sampling parameters and are dropped)
    failed: dict[str, str] = field(default_factory=dict)
    # req id -> its routed experts this step (enable_return_routed_experts): a StepRoutes
    # of runner/routed_experts.py (positions, KV slots, ids [n, L, k])
    routed_experts: dict[str, object] = field(default_factory=dict)
    # A pooling model's step: req id -> the final-norm hidden state [D] float32 of the
    # request's last prompt token (jllm/pooling)
    pooled: dict[str, object] = field(default_factory=dict)

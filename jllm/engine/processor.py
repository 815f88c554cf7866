"""Turn user prompts and sampling parameters into validated engine inputs.

Accepts vLLM's prompt forms (a string, `{"prompt": ...}`, `{"prompt_token_ids": [...]}`,
either dict with vLLM's `cache_salt`), tokenizes, truncates on request and rejects what the
engine cannot serve with a ValueError that names the problem, before anything reaches the
scheduler. Host-side only: no JAX import.
"""

from __future__ import annotations

from dataclasses import dataclass

from jllm.sampling_params import MAX_SUPPRESS, SamplingParams

# Prompt-dict keys vLLM defines that jllm cannot honour yet: refused by name, never ignored.
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None


def cache_salt_of(prompt) -> str | None:
    if not isinstance(prompt, dict):
        return None
    unsupported = [k for k in prompt if k in UNSUPPORTED_PROMPT_KEYS]
    if unsupported:
        raise ValueError(f"Prompt field {unsupported[0]!r} is not supported by jllm yet.")
    unknown = [k for k in prompt if k not in PROMPT_KEYS]
    if unknown:
        raise ValueError(
            f"Unknown prompt field {unknown[0]!r}; a prompt dict takes {', '.join(PROMPT_KEYS)}."
        )
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, max_logprobs: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs

    def process_prompt(self, prompt, params: SamplingParams) -> ProcessedPrompt:
        salt = cache_salt_of(prompt)
        text = None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            text = prompt.get("prompt")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
        else:
            raise ValueError(
                "A prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}."
            )
        if not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer; skip_tokenizer_init is set.")
            ids = self.tokenizer.encode(text)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        self.validate(ids, params)
        return ProcessedPrompt(text, ids, salt)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("The prompt cannot be empty.")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"Token id out of vocabulary (size {self.vocab_size}) in prompt.")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {self.max_model_len}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens plus the tokens to generate."
            )
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"Requested sample logprobs of {params.logprobs}, which is greater than "
                f"max allowed: {self.max_logprobs}"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary.")
        if params.min_tokens and len(params.all_stop_token_ids) + 1 > MAX_SUPPRESS:
            raise ValueError(
                f"min_tokens with more than {MAX_SUPPRESS - 1} stop_token_ids is not supported."
            )

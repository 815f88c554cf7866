"""Turn user prompts and sampling parameters into validated engine inputs.

Accepts vLLM's prompt forms (a string, `{"prompt": ...}`, `{"prompt_token_ids": [...]}`,
either dict with vLLM's `cache_salt`, and for a vision-language model `multi_modal_data` and
`mm_processor_kwargs`, which go through the model's processor: `engine/multimodal.py`;
with `enable_prompt_embeds`, `{"prompt_embeds": [tokens, hidden_size] floats}`), tokenizes,
truncates on request and rejects what the
engine cannot serve with a ValueError that names the problem, before anything reaches the
scheduler. Host-side only: no JAX import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jllm.config.limits import MAX_BAD_WORDS, MAX_BAD_WORDS_TOTAL_TOKENS
from jllm.sampling_params import MAX_SUPPRESS, SamplingParams

# Prompt-dict keys vLLM defines that jllm cannot honour yet: refused by name, never ignored.
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_uuids",)
MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs")
PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "cache_salt", *MULTIMODAL_KEYS)
PROMPT_EMBEDS_OFF = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora: object | None = None  # the LoRA adapter (jllm/lora/peft.py:LoraAdapter), if any
    mm_items: list = field(default_factory=list)  # its images (engine/multimodal.py)
    # An embeddings prompt's rows [tokens, hidden_size] float32 (its token ids are 0s, as in
    # vLLM: placeholders the forward replaces with these rows)
    prompt_embeds: np.ndarray | None = None


def prompt_embeds_array(value, hidden_size: int) -> np.ndarray:
    """A prompt's `prompt_embeds` (a numpy, JAX or PyTorch array) as float32 [tokens,
    hidden_size], checked as vLLM checks them (a leading axis of 1 is dropped; floats only;
    the model's hidden size) and finite: a NaN row would reach no other request, but it is
    a caller's mistake."""
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu()
        if not value.is_floating_point():
            raise ValueError("`prompt_embeds` must hold floats.")
        value = value.float().numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`prompt_embeds` must be an array, got {type(value).__name__}.") from e
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2:
        raise ValueError(
            "`prompt_embeds` must be a 2D tensor of shape (num_tokens, hidden_size); got shape "
            f"{tuple(array.shape)}."
        )
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise ValueError(
            f"`prompt_embeds` dtype {array.dtype} is not a floating-point type, cannot safely "
            "cast to the model's dtype."
        )
    if array.shape[1] != hidden_size:
        raise ValueError(
            f"`prompt_embeds` hidden_size {array.shape[1]} does not match the model's "
            f"hidden_size {hidden_size}."
        )
    array = np.ascontiguousarray(array, np.float32)
    if not np.isfinite(array).all():
        raise ValueError("`prompt_embeds` must be finite (no NaN or infinity).")
    return array


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
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        max_logprobs: int,
        mm=None,
        embeds_size: int = 0,
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.mm = mm  # a vision-language model's MultiModalProcessor, else None
        # enable_prompt_embeds: the model's hidden size, which the rows must have (0: off)
        self.embeds_size = embeds_size

    def process_prompt(
        self, prompt, params: SamplingParams, add_special_tokens: bool = True, pooling=False
    ) -> ProcessedPrompt:
        """`add_special_tokens`: whether a text prompt's tokenization adds the tokenizer's
        special tokens (False for a chat template's output, which holds them). `pooling`: a
        pooling request's prompt (it generates nothing)."""
        salt = cache_salt_of(prompt)
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            return self._process_embeds(prompt, params, salt)
        if isinstance(prompt, dict) and any(k in prompt for k in MULTIMODAL_KEYS):
            return self._process_multimodal(prompt, params, salt, add_special_tokens)
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
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        if pooling and len(ids) > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt."
            )
        self.validate(ids, params, generate=not pooling)
        return ProcessedPrompt(text, ids, salt)

    def _process_embeds(self, prompt: dict, params, salt) -> ProcessedPrompt:
        if not self.embeds_size:
            raise ValueError(PROMPT_EMBEDS_OFF)
        others = sorted(set(prompt) - {"prompt_embeds", "cache_salt"})
        if others:
            raise ValueError(
                f"A prompt_embeds prompt takes only 'cache_salt' beside it, not {others[0]!r} "
                "(prompts that mix token ids and embeddings are not supported yet)."
            )
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not compatible with prompt embeds.")
        rows = prompt_embeds_array(prompt["prompt_embeds"], self.embeds_size)
        if params.truncate_prompt_tokens is not None:
            rows = rows[-params.truncate_prompt_tokens :]
        ids = [0] * len(rows)
        self.validate(ids, params)
        return ProcessedPrompt(None, ids, salt, prompt_embeds=rows)

    def _process_multimodal(self, prompt: dict, params, salt, add_special_tokens: bool):
        if self.mm is None:
            raise ValueError(
                "multi_modal_data was given, but this model takes text only (image inputs: "
                "LLaVA-1.5, Gemma 3 and Qwen2.5-VL families)."
            )
        kwargs = prompt.get("mm_processor_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("mm_processor_kwargs must be a dict.")
        images = self.mm.images(prompt.get("multi_modal_data") or {})
        ids = prompt.get("prompt_token_ids")
        text = prompt.get("prompt")
        if ids is None and text is None:
            raise ValueError("A prompt with images needs 'prompt' or 'prompt_token_ids'.")
        ids, items = self.mm.process(
            text if ids is None else None,
            None if ids is None else [int(t) for t in ids],
            images,
            kwargs,
            add_special_tokens,
        )
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens would cut a prompt with images.")
        self.validate(ids, params)
        return ProcessedPrompt(text, ids, salt, mm_items=items)

    def validate(self, ids: list[int], params: SamplingParams, generate: bool = True) -> None:
        """`generate`: a request that generates (a pooling request's prompt may fill the
        whole context; one that generates must leave room for a token, vLLM's rule)."""
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
        if generate and len(ids) == self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output "
                f"tokens (at least 1) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens (prompt + requested output tokens)."
            )
        if params.routed_experts_prompt_start > len(ids):
            raise ValueError(
                "routed_experts_prompt_start must be between 0 and the prompt length "
                f"({len(ids)}), inclusive."
            )
        # A top_k past the vocabulary keeps every token: the filter is off (vLLM clamps it).
        if params.top_k >= self.vocab_size:
            params.top_k = 0
        # vLLM checks min_tokens against an unset max_tokens as the room the context leaves.
        room = self.max_model_len - len(ids)
        if params.max_tokens is None and params.min_tokens > room:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={room}, got "
                f"{params.min_tokens}."
            )
        # -1 asks for the whole vocabulary, and max_logprobs=-1 allows it (vLLM's rule).
        limit = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for kind, value in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            wanted = self.vocab_size if value == -1 else value
            if wanted is not None and wanted > limit:
                raise ValueError(
                    f"Requested {kind} logprobs of {wanted}, which is greater than "
                    f"max allowed: {limit}"
                )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary.")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if not 0 <= t < self.vocab_size)
            if bad:
                raise ValueError(
                    f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {self.vocab_size}"
                )
        if params.allowed_token_ids is not None:
            if not all(0 <= t < self.vocab_size for t in params.allowed_token_ids):
                raise ValueError("allowed_token_ids contains out-of-vocab token id!")
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        # Ids the sampler masks per step: EOS and stop ids under min_tokens, and the last
        # token of each bad word of several tokens whose beginning was just generated.
        suppressed = len(params.multi_token_bad_words)
        if params.min_tokens:
            suppressed += len(params.all_stop_token_ids) + 1
        if suppressed > MAX_SUPPRESS:
            raise ValueError(
                f"At most {MAX_SUPPRESS} token ids can be masked per step: min_tokens with "
                f"{len(params.all_stop_token_ids)} stop token ids and "
                f"{len(params.multi_token_bad_words)} bad-word token sequences of several "
                "tokens is too many."
            )

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of `bad_words`: each word as it would start the text, and with a
        leading space (as it would follow another word) when that is a different token
        sequence of the same length."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; skip_tokenizer_init is set.")
        out: list[list[int]] = []
        for word in dict.fromkeys(words):  # duplicates once
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError("bad_words entries must tokenize to at least one token.")
            out.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        if len(out) > MAX_BAD_WORDS:
            raise ValueError(
                f"Too many bad words after tokenization: {len(out)}. "
                f"The max number is {MAX_BAD_WORDS}."
            )
        total = sum(map(len, out))
        if total > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise ValueError(
                f"Too many total bad word tokens: {total}. The max is "
                f"{MAX_BAD_WORDS_TOTAL_TOKENS} (VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)."
            )
        bad = [t for ids in out for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"The model vocabulary size is {self.vocab_size}, but the following tokens "
                f"were specified as bad: {bad}."
            )
        return out

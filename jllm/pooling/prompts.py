"""A pooling request's prompt cut to `truncate_prompt_tokens` (vLLM's tokenization argument of
`LLM.encode` and the pooling routes' field), the one rule `LLM` and the server share.
Host-side only."""

from __future__ import annotations


def truncated_prompt(prompt, n, max_model_len: int, tokenize, side: str | None = None) -> dict:
    """`prompt` (text, or a dict with `prompt` or `prompt_token_ids`) as token ids, its last
    `n` kept (its first with `side="right"`; -1: max_model_len). `tokenize(text)` gives a
    text's ids. ValueError with vLLM's message for an `n` past the context."""
    if n == -1:
        n = max_model_len
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"truncate_prompt_tokens must be an int >= 1 or -1, got {n!r}.")
    if n > max_model_len:
        raise ValueError(
            "truncate_prompt_tokens value is greater than max_model_len. Please request a "
            "smaller truncation size."
        )
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
    else:
        ids = tokenize(prompt["prompt"] if isinstance(prompt, dict) else prompt)
    return {"prompt_token_ids": ids[:n] if side == "right" else ids[-n:]}

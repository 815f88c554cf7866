"""Upper bounds on what one request may ask for, under vLLM's environment variables.

Each bound caps work that grows with a request field and runs on the engine thread or the
tokenization thread (sequences per request, stop strings scanned per token), so no single
request can stall the others. The names and defaults are vLLM's (`vllm/envs.py`); read once,
at import, as vLLM does.
"""

from __future__ import annotations

import os

INT64_MAX = 2**63 - 1

# Sequences one request may ask for (`n`, beam width).
MAX_N_SEQUENCES = int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
# Stop strings in one server request (OpenAI's limit, too).
MAX_STOP_STRINGS = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))
# Token sequences one request's bad words may tokenize to, and their tokens together (each is
# matched after every token).
MAX_BAD_WORDS = int(os.environ.get("VLLM_MAX_NUM_BAD_WORDS", "128"))
MAX_BAD_WORDS_TOTAL_TOKENS = int(os.environ.get("VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "1024"))


def check_num_sequences(value: int, name: str = "n") -> None:
    """vLLM's check of `n` and the beam width: an int in [1, VLLM_MAX_N_SEQUENCES]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, but is of type {type(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
    if value > MAX_N_SEQUENCES:
        raise ValueError(
            f"{name} must be at most {MAX_N_SEQUENCES}, got {value}. To increase this limit, "
            "set the VLLM_MAX_N_SEQUENCES environment variable."
        )

"""Speculative decoding: vLLM's `speculative_config` and the n-gram (prompt lookup) proposer;
the draft-model proposer runs on the device beside the target (`spec_decode/draft_model.py`).

The engine verifies drafts in its ordinary step (`runner/sampler.py`): a request with k
drafts is a (k+1)-row group, every row sampled from the target model, and a row's token
counts while the rows before it sampled exactly their drafts. For a draft that is a function
of the context (n-gram lookup) this is rejection sampling with a one-hot q: the draft is
accepted with probability p(draft), and a rejected position yields a token from p without
the draft, so the output distribution is the target model's and greedy output is unchanged.

Host-side; no JAX.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger("jllm")

# vLLM's method names that jllm does not build yet, refused by name.
NOT_YET = (
    "eagle",
    "eagle3",
    "mtp",
    "deepseek_mtp",
    "suffix",
    "ngram_gpu",
    "medusa",
    "mlp_speculator",
)


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (a dict offline, JSON for `--speculative-config`)."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    disable_by_batch_size: int | None = None
    # draft_model only: the draft checkpoint (same vocabulary as the target), how it is read.
    model: str | None = None
    quantization: str | None = None
    revision: str | None = None
    draft_tensor_parallel_size: int | None = None  # must equal the target's

    @classmethod
    def create(cls, spec: dict | None) -> SpeculativeConfig | None:
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        spec = {k.replace("-", "_"): v for k, v in spec.items()}
        known = {
            "method",
            "model",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
            "quantization",
            "revision",
            "draft_tensor_parallel_size",
        }
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
        model = spec.get("model")
        method = spec.get("method")
        if method is None:
            if model in ("ngram", "[ngram]"):
                method = "ngram"
            elif model is not None:
                method = "draft_model"
            else:
                raise ValueError(
                    "speculative_config needs a method ('ngram') or a draft model, e.g. "
                    '{"method": "ngram", "num_speculative_tokens": 4}.'
                )
        if method in NOT_YET:
            raise ValueError(
                f"Speculative method {method!r} is not supported by jllm yet; use "
                "method='ngram' or a draft model ({'model': PATH})."
            )
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"Unsupported speculative method: {method!r}.")
        k = spec.get("num_speculative_tokens")
        if not _int_at_least(k, 1):
            raise ValueError(
                f"num_speculative_tokens must be an integer greater than zero, got {k!r}."
            )
        off = spec.get("disable_by_batch_size")
        if off is not None and not _int_at_least(off, 2):
            raise ValueError(
                "Expect the batch size threshold of disabling speculative decoding is > 1, "
                f"but got {off!r}"
            )
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'draft_model' needs a 'model' path.")
            dtp = spec.get("draft_tensor_parallel_size")
            if dtp is not None and not _int_at_least(dtp, 1):
                raise ValueError(f"draft_tensor_parallel_size must be >= 1, got {dtp!r}.")
            return cls(
                method,
                k,
                disable_by_batch_size=off,
                model=model,
                quantization=spec.get("quantization"),
                revision=spec.get("revision"),
                draft_tensor_parallel_size=dtp,
            )
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        elif lo is None or hi is None:
            lo = hi = hi if lo is None else lo  # one given: both
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _int_at_least(value, 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(method, k, lo, hi, off)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's prompt lookup: the longest suffix of `tokens` (of min_n..max_n tokens) that
    also occurs earlier (the earlier occurrence may overlap the suffix), at its earliest
    occurrence; the up to k tokens that followed it there. [] when none matches.

    Vectorised over the ends of earlier occurrences: the ends where the last min_n tokens
    match, then, one token further back at a time, the ends where the longer suffix still
    does (a longer match contains the shorter one)."""
    n = len(tokens)
    if n < min_n + 1 or k < 1:
        return []
    count = n - min_n  # candidate ends e = min_n - 1 .. n - 2: a token follows each
    match = tokens[min_n - 1 : min_n - 1 + count] == tokens[n - 1]
    for j in range(1, min_n):
        match &= tokens[min_n - 1 - j : min_n - 1 - j + count] == tokens[n - 1 - j]
    ends = np.flatnonzero(match) + (min_n - 1)
    if ends.size == 0:
        return []
    length = min_n
    while length < min(max_n, n - 1):
        back = ends - length  # the token before each occurrence
        keep = back >= 0
        longer = ends[keep][tokens[back[keep]] == tokens[n - 1 - length]]
        if longer.size == 0:
            break
        ends, length = longer, length + 1
    start = int(ends[0]) + 1
    return tokens[start : start + k].tolist()


class NgramProposer:
    """Drafts for every running request from its own prompt and output (`EngineCore`'s
    proposer: `propose(request, num_running) -> list[int]`). It proposes up to k tokens;
    the scheduler verifies only as many as fit within max_tokens and the context."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # Each request's tokens as a growing int64 buffer, extended by the tokens appended
        # since the last step (a request's tokens are append-only), dropped with the request.
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _tokens(self, req) -> np.ndarray:
        n = req.num_tokens
        buf, have = self._buffers.get(req, (None, 0))
        if buf is None or len(buf) < n:
            grown = np.empty(max(64, 2 * n), np.int64)
            if have:
                grown[:have] = buf[:have]
            buf = grown
        buf[have:n] = req.all_token_ids[have:n]
        self._buffers[req] = (buf, n)
        return buf[:n]

    def propose(self, req, num_running: int = 1) -> list[int]:
        """Drafts for `req`, which sampled a token this step. `num_running`: the running
        batch; from `disable_by_batch_size` requests on, no drafts (vLLM V0's rule)."""
        c = self.config
        if c.disable_by_batch_size is not None and num_running >= c.disable_by_batch_size:
            return []
        return ngram_lookup(
            self._tokens(req), c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens
        )


def make_proposer(config: SpeculativeConfig | None):
    """The engine core's host-side proposer for `config`: None without speculative decoding,
    and for a draft model, whose drafts the model runner returns with each step's results."""
    if config is None or config.method == "draft_model":
        return None
    logger.info(
        "Speculative decoding: %s, %d tokens, prompt lookup %d-%d%s.",
        config.method,
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
        ""
        if config.disable_by_batch_size is None
        else f", off from {config.disable_by_batch_size} running requests",
    )
    return NgramProposer(config)

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

import numpy as np

from jllm.config.speculative import SpeculativeConfig  # noqa: F401 (re-exported)
from jllm.kv_cache_interface import MambaSpec

logger = logging.getLogger("jllm")


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


def check_state_speculation(config: SpeculativeConfig | None, specs) -> None:
    """Refuse a draft model or MTP for a model that keeps per-request state (linear
    attention: `MambaSpec`). N-gram drafts run: a step that rejects some puts the state back
    to its backup from before the step (engine/single_type_manager.py: StateManager)."""
    if config is None or config.method == "ngram":
        return
    if any(isinstance(spec, MambaSpec) for spec in specs):
        raise ValueError(
            f"Speculative decoding ({config.method}) is not supported by jllm yet for a model "
            "that keeps per-request state (linear attention: Qwen3-Next, Qwen3.5); n-gram "
            "drafts are."
        )


def make_proposer(config: SpeculativeConfig | None):
    """The engine core's host-side proposer for `config`: None without speculative decoding,
    and for a draft model, whose drafts the model runner returns with each step's results."""
    if config is None or config.method in ("draft_model", "mtp"):
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

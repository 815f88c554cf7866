"""Logprob entries with text, written by the front end from the core's raw arrays.

The engine core hands over, per sampled token, the runner's arrays (its logprob and rank,
the top ids and their logprobs) and, per prompt chunk, the same for each prompt position
(engine/outputs.py). `LogprobsProcessor` turns them into vLLM's `{token id: Logprob}` dicts,
decoding each token's text once per token id for the engine's life. Host-side: no JAX.
"""

from __future__ import annotations

from jllm.outputs import Logprob


class LogprobsProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # A token's text for logprobs, decoded once per token id for the engine's life.
        self._token_text: dict[int, str] = {}
        # A slow tokenizer's id count: it raises on the ids past it, which a model's padded
        # vocabulary can still produce (a fast tokenizer decodes them to "").
        self._num_ids = None
        if tokenizer is not None and not getattr(tokenizer, "is_fast", True):
            self._num_ids = len(tokenizer)

    def decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            if self._num_ids is not None and not 0 <= token_id < self._num_ids:
                text = ""  # past the tokenizer's vocabulary, as the detokenizer has it
            else:
                text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def entry(self, token: int, logprob, rank, top_ids, top_lps, k: int) -> dict:
        """vLLM's logprob dict of one position: the token first (its own rank), then the
        k most likely (-1: all the runner returned), ranks 1..k."""
        if k == -1:  # the whole vocabulary (the runner returns it when max_logprobs is -1)
            k = len(top_ids)
        entry = {token: Logprob(float(logprob), int(rank), self.decode_one(token))}
        for r, (tid, lp) in enumerate(zip(top_ids[:k], top_lps[:k], strict=True), 1):
            tid = int(tid)
            if tid not in entry:
                entry[tid] = Logprob(float(lp), r, self.decode_one(tid))
        return entry

    def append_sampled(self, seq, tok) -> None:
        """The entry of a sampled token (a runner SampledToken) onto sequence `seq`."""
        k = seq.params.logprobs
        seq.logprobs.append(
            self.entry(tok.token_id, tok.logprob, tok.rank, tok.top_ids, tok.top_logprobs, k)
        )
        seq.cumulative_logprob += tok.logprob

    def record_prompt(self, seq, first: int, lps, ranks, top_ids, top_lps) -> None:
        """Entries for prompt positions first .. first + n - 1 of sequence `seq` (a position
        recomputed after a preemption is written again, with the same values)."""
        k = seq.params.prompt_logprobs
        for i in range(len(lps)):
            pos = first + i
            target = seq.prompt_token_ids[pos]
            entry = self.entry(target, lps[i], ranks[i], top_ids[i], top_lps[i], k)
            if seq.prompt_logprobs[pos] is None:
                seq.num_prompt_logprobs += 1
            seq.prompt_logprobs[pos] = entry

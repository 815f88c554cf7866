"""What the user sees of a request: vLLM's `RequestOutput`s, and the logprob entries they carry.

`ParentRequest` is a user request (its `n` sequences share the prompt) with what its outputs
have already sent; `OutputProcessor` turns the engine core's sequences into outputs (whole,
or only what is new for DELTA streams) and writes the logprob dicts of sampled and prompt
tokens, decoding each token's text once per token id for the engine's life; with tracing on
(jllm/tracing.py) a request's last output also ends its span. Host-side: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jllm.engine.detokenizer import IncrementalDetokenizer
from jllm.engine.request import Request
from jllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    """A user request: `n` sequences that share a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    arrival_time: float
    detokenizers: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    # DELTA outputs: how much text and how many tokens of each sequence were already sent.
    sent_text: dict[str, int] = field(default_factory=dict)
    sent_tokens: dict[str, int] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False
    # The W3C trace headers of the HTTP request it came from (jllm/tracing.py), if traced.
    trace_headers: dict | None = None

    @property
    def finished(self) -> bool:
        return all(c.is_finished() for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # A token's text for logprobs, decoded once per token id for the engine's life.
        self._token_text: dict[int, str] = {}
        # A slow tokenizer's id count: it raises on the ids past it, which a model's padded
        # vocabulary can still produce (a fast tokenizer decodes them to "").
        self._num_ids = None
        if tokenizer is not None and not getattr(tokenizer, "is_fast", True):
            self._num_ids = len(tokenizer)
        # A jllm.tracing.RequestTracer when --otlp-traces-endpoint is set: one span per
        # finished request.
        self.tracer = None

    def logprob_entry(self, token: int, logprob, rank, top_ids, top_lps, k: int) -> dict:
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

    def record_logprobs(self, req: Request, tok) -> None:
        req.logprobs.append(
            self.logprob_entry(
                tok.token_id,
                tok.logprob,
                tok.rank,
                tok.top_ids,
                tok.top_logprobs,
                req.sampling_params.logprobs,
            )
        )
        req.cumulative_logprob += tok.logprob

    def record_prompt_logprobs(self, req: Request, first: int, lps, ranks, top_ids, top_lps):
        """Entries for prompt positions first .. first + n - 1 (a recomputed position after
        a preemption is written again, with the same values)."""
        k = req.sampling_params.prompt_logprobs
        for i in range(len(lps)):
            pos = first + i
            target = req.prompt_token_ids[pos]
            entry = self.logprob_entry(target, lps[i], ranks[i], top_ids[i], top_lps[i], k)
            if req.prompt_logprobs[pos] is None:
                req.num_prompt_logprobs += 1
            req.prompt_logprobs[pos] = entry

    def _prompt_logprobs(self, parent: ParentRequest, delta: bool):
        """The prompt logprobs once computed (any sequence's: they share the prompt); a
        DELTA stream gets them once, in its first output after that."""
        if parent.params.prompt_logprobs is None or (delta and parent.sent_prompt_logprobs):
            return None
        done = next((c.prompt_logprobs for c in parent.children if c.prompt_logprobs_done), None)
        if done is not None:
            parent.sent_prompt_logprobs = True
        return done

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

    def make_output(self, parent: ParentRequest, now: float, touched: set[str]) -> RequestOutput:
        """CUMULATIVE and FINAL_ONLY: every sequence so far. DELTA: only the sequences that
        moved this step (`touched`), each with the text, tokens and logprobs since the last
        output; their `index` says which of the `n` they are."""
        p = parent.params
        delta = p.output_kind == RequestOutputKind.DELTA
        completions = []
        for i, child in enumerate(parent.children):
            rid = child.request_id
            if delta and rid not in touched:
                continue
            detok = parent.detokenizers.get(rid)
            finished = child.is_finished()
            visible = detok.visible_len(finished) if detok is not None else 0
            # DELTA copies only what is new: a stream's outputs stay linear in its length.
            sent_text = parent.sent_text.get(rid, 0) if delta else 0
            sent = parent.sent_tokens.get(rid, 0) if delta else 0
            text = detok.text[sent_text:visible] if detok is not None else ""
            token_ids = child.output_token_ids[sent:]
            logprobs = child.logprobs[sent:] if p.logprobs is not None else None
            if delta:
                parent.sent_text[rid] = max(visible, sent_text)
                parent.sent_tokens[rid] = len(child.output_token_ids)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=child.cumulative_logprob if logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=child.status.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        first = parent.children[0]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=now if parent.finished else None,
        )
        if self.tracer is not None and parent.finished:
            self.tracer.trace(parent, now)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs(parent, delta),
            outputs=completions,
            finished=parent.finished,
            metrics=metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            lora_request=None if first.lora is None else first.lora.request,
        )

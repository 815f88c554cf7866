"""The front end's half of a step: from the core's token ids to what the user sees.

The engine core (engine/core.py) returns per sequence its new token ids, raw logprob arrays
and the finish it decided (engine/outputs.py). `OutputProcessor` keeps each user request
(`ParentRequest`, its `n` sequences as `RequestState`s) and, per step, detokenizes, scans
stop strings, writes logprob dicts with text (engine/logprobs.py) and builds vLLM's
`RequestOutput`s (whole, or only what is new for DELTA streams; FINAL_ONLY once finished);
with tracing on (jllm/tracing.py) a request's last output also ends its span.

A stop string found here ends its sequence here; the tokens the core produced after it are
dropped, and `OutputProcessorOutput.reqs_to_abort` names the sequences the core must still
end (vLLM's split), which the caller sends back as aborts with finish status "stop". It
runs inline after each core step under `LLM` and on AsyncLLM's output thread when serving
(engine/output_thread.py), never on the engine thread there. Host-side: no JAX.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from jllm.engine.detokenizer import IncrementalDetokenizer
from jllm.engine.logprobs import LogprobsProcessor
from jllm.engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    sequence_id,
)
from jllm.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    WeightVersionSpan,
)
from jllm.pooling.head import apply_head
from jllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestState:
    """One sequence of a user request as the front end sees it: its tokens, text and
    logprobs, its finish, and the times the core reported (the attributes the tracer reads
    of a sequence)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params, detokenizer):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.output_token_ids: list[int] = []
        self.logprobs: list = []  # per output token, filled when logprobs are requested
        self.cumulative_logprob = 0.0
        # vLLM's format: None for the first prompt token, then {token id: Logprob} per
        # position, filled as the prompt's chunks are computed.
        self.prompt_logprobs: list | None = None
        self.num_prompt_logprobs = 0  # positions filled
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.scheduler_time = 0.0
        self.model_execute_time = 0.0
        self.weight_versions: list[list] = []  # [version, start, end] over output tokens
        self.routed_experts: list = []  # the core's routing chunks ([n, L, k] each)
        self.pooled = None  # a pooling request's hidden state [D], once computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.num_prompt_logprobs == len(self.prompt_token_ids) - 1

    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def routing(self):
        """The routed experts at finish (vLLM's `CompletionOutput.routed_experts`, [n, L, k]):
        the core's chunks joined, cut to the positions the kept tokens need (a stop string
        found here drops the tokens after it); None without any."""
        if not self.routed_experts:
            return None
        start = min(self.params.routed_experts_prompt_start, len(self.prompt_token_ids))
        n = len(self.prompt_token_ids) - start + len(self.output_token_ids) - 1
        return np.concatenate(self.routed_experts)[: max(n, 0)]

    def note_version(self, version: str | None) -> None:
        """The next output token was sampled under weight `version`."""
        n, spans, version = len(self.output_token_ids), self.weight_versions, version or "default"
        if spans and spans[-1][0] == version:
            spans[-1][2] = n + 1
        else:
            spans.append([version, n, n + 1])


@dataclass
class ParentRequest:
    """A user request: `n` sequences that share a prompt, with what its outputs have already
    sent."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list  # its RequestStates
    arrival_time: float
    # DELTA outputs: how much text and how many tokens of each sequence were already sent.
    sent_text: dict[str, int] = field(default_factory=dict)
    sent_tokens: dict[str, int] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False
    # The W3C trace headers of the HTTP request it came from (jllm/tracing.py), if traced.
    trace_headers: dict | None = None
    lora_request: object | None = None  # the LoRARequest it runs with
    pooling_params: object | None = None  # a pooling request's (jllm/pooling)

    @property
    def finished(self) -> bool:
        return all(c.is_finished() for c in self.children)


@dataclass(kw_only=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Sequences a stop string ended here that the core still runs: abort them there with
    # finish status "stop".
    reqs_to_abort: list[str]
    # User requests whose outputs failed to build here: end them in the core with "error".
    reqs_to_fail: list[str]


class OutputProcessor:
    def __init__(self, tokenizer, pooling=None) -> None:
        self.tokenizer = tokenizer
        self.pooling = pooling  # a pooling model's PoolingSpec: its head runs here
        self.logprobs = LogprobsProcessor(tokenizer)
        self.parents: dict[str, ParentRequest] = {}
        self.sequences: dict[str, RequestState] = {}  # sequence id -> its state
        self._parent_of: dict[str, ParentRequest] = {}  # sequence id -> its user request
        # A jllm.tracing.RequestTracer when --otlp-traces-endpoint is set: one span per
        # finished request.
        self.tracer = None

    def decode_one(self, token_id: int) -> str | None:
        """A token's text as logprob entries show it."""
        return self.logprobs.decode_one(token_id)

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, trace_headers: dict | None = None
    ) -> None:
        """Track a request the core admitted; its sequences' ids are the core's."""
        params = request.sampling_params
        rid, ids = request.request_id, request.prompt_token_ids
        children = []
        # An embeddings prompt's ids are placeholders: its text starts from no context.
        context = [] if request.prompt_embeds is not None else ids
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, context, params)
            children.append(RequestState(sequence_id(rid, i, params.n), ids, params, detok))
        lora = request.lora
        parent = ParentRequest(
            rid,
            prompt,
            ids,
            params,
            children,
            request.arrival_time,
            trace_headers=trace_headers,
            lora_request=None if lora is None else lora.request,
            pooling_params=request.pooling_params,
        )
        self.parents[rid] = parent
        for child in children:
            self.sequences[child.request_id] = child
            self._parent_of[child.request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget user requests (the client left: no output)."""
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is not None:
                self._forget(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.sequences.pop(child.request_id, None)
            self._parent_of.pop(child.request_id, None)

    # ---- a step --------------------------------------------------------------------------
    def process_outputs(self, outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        now = outputs.timestamp
        request_outputs, reqs_to_abort, reqs_to_fail = [], [], []
        touched: dict[str, tuple[ParentRequest, set[str]]] = {}

        def fail_here(parent: ParentRequest, e: Exception) -> None:
            """This processor failed one request: its final output, and the core frees it."""
            logger.error("Request %s failed: %s: %s", parent.request_id, type(e).__name__, e)
            request_outputs.append(self._fail(parent))
            reqs_to_fail.append(parent.request_id)

        for out in outputs.outputs:
            seq = self.sequences.get(out.request_id)
            if seq is None or seq.is_finished():  # ended here already (a stop string)
                continue
            parent = self._parent_of[out.request_id]
            if out.finish_reason == "error":
                request_outputs.append(self._fail(parent))
                continue
            try:
                moved = self._update(seq, out, now)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                fail_here(parent, e)
                continue
            if seq.is_finished() and not out.finished:
                reqs_to_abort.append(seq.request_id)
            if moved:
                touched.setdefault(parent.request_id, (parent, set()))[1].add(seq.request_id)
        for parent, children in touched.values():
            if self.parents.get(parent.request_id) is not parent:  # failed above
                continue
            if not parent.finished and parent.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            try:
                out = self.make_output(parent, now, children)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                fail_here(parent, e)
                continue
            if parent.finished:
                self._forget(parent)
            request_outputs.append(out)
        return OutputProcessorOutput(
            request_outputs=request_outputs,
            reqs_to_abort=reqs_to_abort,
            reqs_to_fail=reqs_to_fail,
        )

    def _update(self, seq: RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Apply one core output to its sequence: True when it got tokens or finished."""
        seq.num_cached_tokens = out.num_cached_tokens
        seq.first_scheduled_time = out.first_scheduled_time
        seq.scheduler_time, seq.model_execute_time = out.scheduler_time, out.model_execute_time
        if out.routed_experts is not None:
            seq.routed_experts.append(out.routed_experts)
        if out.pooled is not None:
            seq.pooled = out.pooled
        if out.new_prompt_logprobs is not None:
            self.logprobs.record_prompt(seq, *out.new_prompt_logprobs)
        tokens = out.new_token_ids
        if tokens:
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
        p, detok, last = seq.params, seq.detokenizer, len(tokens) - 1
        for i, token in enumerate(tokens):
            # The core's finish applies to its last token only.
            core_reason = out.finish_reason if i == last else None
            seq.note_version(out.weight_version)
            seq.output_token_ids.append(token)
            if out.new_logprobs is not None:
                self.logprobs.append_sampled(seq, out.new_logprobs[i])
            # An EOS or stop token's text is not shown unless include_stop_str_in_output.
            if detok is None or (core_reason == "stop" and not p.include_stop_str_in_output):
                continue
            stop = detok.update(token)
            if stop is not None:
                # Ends here, as "stop" whatever the core said of this token (a stop string
                # its last allowed token completes): the core's tokens after it are dropped.
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        if out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return bool(tokens) or out.finished

    def _fail(self, parent: ParentRequest) -> RequestOutput:
        """The final output of a request that failed (vLLM's finish reason "error", a 500 from
        the server): every sequence not ended yet ends with "error". No text: what failed
        may be the text itself, and the error replaces the answer."""
        for child in parent.children:
            if not child.is_finished():
                child.finish_reason = "error"
        self._forget(parent)
        if parent.pooling_params is not None:
            return PoolingRequestOutput(
                parent.request_id,
                PoolingOutput(np.zeros(0, np.float32)),
                parent.prompt_token_ids,
                0,
                True,
                error="the request failed in the engine",
            )
        outputs = [
            CompletionOutput(
                index=i,
                text="",
                token_ids=list(child.output_token_ids),
                cumulative_logprob=None,
                logprobs=None,
                finish_reason=child.finish_reason,
            )
            for i, child in enumerate(parent.children)
        ]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=True,
        )

    def _prompt_logprobs(self, parent: ParentRequest, delta: bool):
        """The prompt logprobs once computed (any sequence's: they share the prompt); a
        DELTA stream gets them once, in its first output after that."""
        if parent.params.prompt_logprobs is None or (delta and parent.sent_prompt_logprobs):
            return None
        done = next((c.prompt_logprobs for c in parent.children if c.prompt_logprobs_done), None)
        if done is not None:
            parent.sent_prompt_logprobs = True
        return done

    def make_output(self, parent: ParentRequest, now: float, touched: set[str]) -> RequestOutput:
        """CUMULATIVE and FINAL_ONLY: every sequence so far. DELTA: only the sequences that
        moved this step (`touched`), each with the text, tokens and logprobs since the last
        output; their `index` says which of the `n` they are."""
        if parent.pooling_params is not None:
            return self._pooling_output(parent)
        p = parent.params
        delta = p.output_kind == RequestOutputKind.DELTA
        completions = []
        for i, child in enumerate(parent.children):
            rid = child.request_id
            if delta and rid not in touched:
                continue
            detok = child.detokenizer
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
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    weight_versions=(
                        [WeightVersionSpan(*span) for span in child.weight_versions]
                        if finished
                        else None
                    ),
                    routed_experts=child.routing() if finished else None,
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
            num_cached_tokens=first.num_cached_tokens,
            lora_request=parent.lora_request,
        )

    def _pooling_output(self, parent: ParentRequest) -> PoolingRequestOutput:
        """A pooling request's one output: the model's head over its pooled hidden state."""
        seq = parent.children[0]
        if seq.pooled is None:
            raise RuntimeError("the engine returned no hidden state for a pooling request")
        data = apply_head(self.pooling, parent.pooling_params, seq.pooled)
        return PoolingRequestOutput(
            parent.request_id,
            PoolingOutput(data),
            parent.prompt_token_ids,
            seq.num_cached_tokens,
            True,
        )

"""The engine core loop: schedule, execute, update, emit each sequence's new tokens.

`EngineCore.step()` is the whole engine in four lines: the scheduler picks tokens, the runner
computes them and samples, every sequence that got tokens appends them one by one, checked
for a stop after each (a verification row can bring several; what follows a stop is
dropped), and each sequence that moved comes out as an `EngineCoreOutput` (engine/outputs.py):
token ids, raw logprob arrays, the finish the core decided. No text: detokenizing, stop
strings and `RequestOutput`s are the front end's (engine/output_processor.py), off this
thread under AsyncLLM, so a request with a long stop list slows nobody's step. A stop string
the front end finds comes back as `abort_request(ids, FINISHED_STOPPED)`.
Drafts the runner computed but did not accept are handed back to the scheduler.

The front end reaches the core only through a client (engine/core_client.py): add, abort,
step outputs and utility calls by name (`reset_prefix_cache` and what later needs the
engine between steps).

With `async_scheduling` the loop runs one step ahead: it schedules and dispatches step N+1,
then waits for step N's results and processes them, so the host's work overlaps the
device's. The runner then needs `dispatch(SchedulerOutput) -> handle` and
`fetch(handle) -> ModelRunnerOutput`; a request finished by step N's tokens may have
computed one more token in step N+1, which is dropped.

The runner is injected (anything with `execute(SchedulerOutput) -> ModelRunnerOutput`), so
this module stays free of JAX and is tested with a mock runner. So is an optional proposer
(anything with `propose(request, num_running) -> list[int]`), asked for draft tokens for
every running request that sampled in the step (the others, mid-prompt, get none). A draft
model drafts on the device instead: the runner's result carries its drafts
(`ModelRunnerOutput.spec_token_ids`).

Structured outputs (`jllm/structured_output`): a request with a grammar waits here, outside
the scheduler, until its grammar is compiled on the manager's worker thread, so nothing
else waits for it. Each step the core fills the bitmask rows of the grammar sequences that
sample (from their matchers) into the `SchedulerOutput`, and each appended token advances
the sequence's matcher. A mask depends on the tokens before it, so while a grammar sequence
is running the async loop runs its steps one at a time.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from jllm.engine.outputs import EngineCoreOutput, EngineCoreOutputs, sequence_id
from jllm.engine.request import Request, RequestStatus
from jllm.engine.scheduler import Scheduler
from jllm.metrics.stats import FinishedRequestStats, SchedulerStats, StepStats
from jllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long an idle engine waits for a grammar being compiled before it returns from a step.
GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        max_model_len: int,
        eos_token_id: int | None,
        stat_loggers: list | None = None,
        proposer=None,
        async_scheduling: bool = False,
        structured=None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        # Anything with `record(StepStats, SchedulerStats)` (see jllm.metrics).
        self.stat_loggers = list(stat_loggers or [])
        self.proposer = proposer
        self.async_scheduling = async_scheduling
        self._in_flight = None  # async: (SchedulerOutput, runner handle) of the last step
        self.structured = structured  # a StructuredOutputManager, or None
        # Requests whose grammar is being compiled: (their sequences, future of the grammar).
        self._compiling: list[tuple[list[Request], Future]] = []
        # User request id -> its sequences, and each sequence's user request id.
        self.parents: dict[str, list[Request]] = {}
        self._child_parent: dict[str, str] = {}
        # Add each step's scheduling and runner time to its requests (for the spans of
        # --collect-detailed-traces; jllm/tracing.py turns it on).
        self.step_timing = False

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora=None,
        mm_items=(),
    ) -> None:
        """Admit a validated request; its `n` sequences get seeds `seed`, `seed + 1`, ...
        and share its `cache_salt`, `priority`, LoRA adapter (`lora`) and images
        (`mm_items`)."""
        if request_id in self.parents:
            raise ValueError(f"Request id {request_id!r} is already running.")
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("Structured outputs need a tokenizer (skip_tokenizer_init).")
            self.structured.resolve(params)
        now = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_id = sequence_id(request_id, i, params.n)
            child = Request(
                child_id,
                prompt_token_ids,
                params,
                self.eos_token_id,
                seed + i,
                now,
                cache_salt,
                priority,
                lora,
                mm_items,
            )
            children.append(child)
            self._child_parent[child_id] = request_id
        self.parents[request_id] = children
        if params.structured_outputs is not None:
            self._compiling.append((children, self.structured.compile(params.structured_outputs)))
            return
        for child in children:
            self.scheduler.add_request(child)

    def abort_request(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish each named request (all its sequences) or sequence with `status`: an abort
        (a client left), or the front end's verdict (a stop string it found,
        FINISHED_STOPPED; a failure building its outputs, FINISHED_ERROR). No output: the
        front end already knows. Unknown or finished ids are skipped."""
        stats = StepStats()
        now = time.time()
        for rid in request_ids:
            children = self.parents.get(rid)
            if children is None:
                parent_id = self._child_parent.get(rid)
                if parent_id is None:
                    continue
                children = [c for c in self.parents[parent_id] if c.request_id == rid]
            for child in children:
                if child.is_finished():
                    continue
                self.scheduler.finish_request(child, status)
                stats.finished.append(self._finished_stats(child, now))
                self._release(child)
        if stats.finished:
            self._record(stats)

    def has_unfinished_requests(self) -> bool:
        return (
            self._in_flight is not None
            or bool(self._compiling)
            or self.scheduler.has_unfinished_requests()
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False, and nothing forgotten, while requests
        run (a utility call: it runs between steps)."""
        return self.scheduler.kv_cache.reset_prefix_cache()

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand the requests whose grammar is ready to the scheduler, each sequence with its
        own matcher; a grammar that failed ends its request (finish reason "abort")."""
        if not self._compiling:
            return []
        if self._in_flight is None and not self.scheduler.has_unfinished_requests():
            wait([f for _, f in self._compiling], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        outputs, still = [], []
        for children, future in self._compiling:
            request_id = self._child_parent.get(children[0].request_id)
            if self.parents.get(request_id) is not children:  # aborted meanwhile
                continue
            if not future.done():
                still.append((children, future))
                continue
            so = children[0].sampling_params.structured_outputs
            try:
                compiled = future.result()
                matchers = [self.structured.matcher(so, compiled) for _ in children]
            except Exception as e:
                logger.error("Request %s: its grammar failed to compile: %s", request_id, e)
                for child in children:
                    child.status = RequestStatus.FINISHED_ABORTED
                    self._release(child)
                    outputs.append(self._output(child, [], None))
                continue
            for child, matcher in zip(children, matchers, strict=True):
                child.grammar = matcher
                self.scheduler.add_request(child)
        self._compiling = still
        return outputs

    def _grammar_running(self) -> bool:
        return any(r.grammar is not None for r in self.scheduler.requests.values())

    def _fill_bitmasks(self, sched_out) -> None:
        """The bitmask rows of every grammar sequence that samples in this step."""
        for rid in sched_out.structured_output_request_ids:
            req = self.scheduler.requests[rid]
            drafts = sched_out.scheduled_spec_decode_tokens.get(rid, [])
            sched_out.grammar_bitmask[rid] = self.structured.bitmask(req.grammar, drafts)

    def _release(self, child: Request) -> None:
        """Forget a finished sequence, and its user request once all its sequences are."""
        parent_id = self._child_parent.pop(child.request_id, None)
        children = self.parents.get(parent_id)
        if children is not None and all(c.is_finished() for c in children):
            del self.parents[parent_id]

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        outputs = self._admit_compiled()
        if self.async_scheduling and not self._grammar_running():
            outputs += self._step_ahead()
        else:
            outputs += self._step_sync()
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def _step_sync(self) -> list[EngineCoreOutput]:
        outputs = []
        if self._in_flight is not None:  # async, and a grammar arrived: finish the last step
            in_flight, self._in_flight = self._in_flight, None
            outputs += self._fetch(*in_flight)
        sched_out, t_sched = self._timed(self.scheduler.schedule)
        if sched_out.is_empty():
            return outputs
        self._fill_bitmasks(sched_out)
        result, t_run = self._timed(self.runner.execute, sched_out)
        return outputs + self._update(sched_out, result, (t_sched, t_run))

    def _step_ahead(self) -> list[EngineCoreOutput]:
        if self.proposer is not None:
            raise ValueError("Draft tokens need the step's results: async scheduling is off.")
        sched_out, t_sched = self._timed(self.scheduler.schedule)
        handle, t_run = None, 0.0
        if not sched_out.is_empty():
            handle, t_run = self._timed(self.runner.dispatch, sched_out)
        outputs = []
        if self._in_flight is not None:
            outputs = self._fetch(*self._in_flight)
        self._in_flight = None if handle is None else (sched_out, handle, (t_sched, t_run))
        return outputs

    def _fetch(self, sched_out, handle, times) -> list[EngineCoreOutput]:
        """A dispatched step's results; its runner time is the dispatch's plus the fetch's."""
        result, t_fetch = self._timed(self.runner.fetch, handle)
        return self._update(sched_out, result, (times[0], times[1] + t_fetch))

    def _timed(self, fn, *args):
        """(fn(*args), its duration in seconds), timed only when `step_timing` is on."""
        if not self.step_timing:
            return fn(*args), 0.0
        start = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - start

    def _update(self, sched_out, result, times=(0.0, 0.0)) -> list[EngineCoreOutput]:
        """Apply a step's results; `times`: its (scheduling, runner) seconds."""
        now = time.time()
        stats = StepStats(num_computed_tokens=sched_out.total_num_scheduled_tokens)
        sampled: set[str] = set()
        outputs = []
        for rid, reason in result.failed.items():
            outputs += self._fail(rid, reason, now, stats)
        for rid, num_new in sched_out.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if self.step_timing:
                req.scheduler_time += times[0]
                req.model_execute_time += times[1]
            prompt_logprobs = result.prompt_logprobs.get(rid)
            tokens = result.sampled.get(rid, ())
            if tokens:
                req.num_output_placeholders -= 1
            drafts = sched_out.scheduled_spec_decode_tokens.get(rid, ())
            if drafts:
                self.scheduler.reject_drafts(req, len(drafts) + 1 - len(tokens))
                if tokens:
                    stats.spec_decoding.observe(len(drafts), len(tokens) - 1)
            elif req.num_computed_tokens - num_new < req.num_prompt_tokens or not tokens:
                stats.num_prefill_tokens += num_new
            if tokens:
                sampled.add(rid)
            appended = []
            try:
                for tok in tokens:
                    appended.append(tok)
                    if self._append(req, tok, now, stats):
                        break
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                outputs += self._fail(rid, f"{type(e).__name__}: {e}", now, stats)
                continue
            if appended or prompt_logprobs is not None:
                outputs.append(self._output(req, appended, prompt_logprobs))
        self._record(stats)
        if self.proposer is not None or result.spec_token_ids:
            num_running = len(self.scheduler.running)
            for req in self.scheduler.running:
                drafts = []
                if req.request_id in result.spec_token_ids:  # a draft model's, on the device
                    drafts = result.spec_token_ids[req.request_id]
                elif self.proposer is not None and req.request_id in sampled:
                    drafts = self.proposer.propose(req, num_running)
                if drafts and req.grammar is not None:
                    drafts = self.structured.valid_drafts(req.grammar, drafts)
                req.spec_token_ids = drafts
        return outputs

    def _output(self, req: Request, tokens: list, prompt_logprobs) -> EngineCoreOutput:
        """What the front end needs of `req` after this step: its new `tokens` (the runner's
        SampledTokens) and `prompt_logprobs`, its finish and timings."""
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[tok.token_id for tok in tokens],
            new_logprobs=tokens if req.sampling_params.logprobs is not None else None,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_scheduled_time=req.first_scheduled_time,
            scheduler_time=req.scheduler_time,
            model_execute_time=req.model_execute_time,
        )

    def _fail(self, child_id: str, reason: str, now: float, stats=None) -> list[EngineCoreOutput]:
        """Fail the user request of sequence `child_id` with a request-level error (vLLM's
        finish reason "error", a 500 from the server) and free its sequences; the requests
        beside it go on. Returns an output per sequence it ended."""
        parent_id = self._child_parent.get(child_id)
        if parent_id is None:
            return []
        logger.error("Request %s failed: %s", parent_id, reason)
        own = StepStats() if stats is None else stats
        outputs = []
        for child in self.parents[parent_id]:
            if child.is_finished():
                continue
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            own.finished.append(self._finished_stats(child, now))
            self._release(child)
            outputs.append(self._output(child, [], None))
        if stats is None:
            self._record(own)
        return outputs

    def _record(self, stats: StepStats) -> None:
        if self.stat_loggers:
            sched = SchedulerStats.from_scheduler(self.scheduler)
            for stat_logger in self.stat_loggers:
                stat_logger.record(stats, sched)

    def _finished_stats(self, req: Request, now: float) -> FinishedRequestStats:
        scheduled = req.first_scheduled_time or now
        return FinishedRequestStats(
            finish_reason=req.status.finish_reason,
            e2e_latency=now - req.arrival_time,
            queued_time=scheduled - req.arrival_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=req.num_output_tokens,
            max_tokens_param=req.sampling_params.max_tokens,
            n=req.sampling_params.n,
        )

    def _append(self, req: Request, tok, now: float, stats: StepStats) -> bool:
        """Append one token; True when it finished the request (EOS, a stop token id, its
        length; stop strings are the front end's)."""
        req.append_output_token(tok.token_id)
        if req.grammar is not None and not req.grammar.is_terminated():
            if not req.grammar.accept(tok.token_id):
                logger.error(
                    "Request %s: token %d does not follow its grammar.",
                    req.request_id,
                    tok.token_id,
                )
        stats.num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            stats.time_to_first_tokens.append(now - req.arrival_time)
            stats.num_prompt_tokens += req.num_prompt_tokens
        else:
            stats.inter_token_latencies.append(now - req.last_token_time)
        req.last_token_time = now
        status = self._check_stop(req)
        if status is not None:
            self.scheduler.finish_request(req, status)
            stats.finished.append(self._finished_stats(req, now))
            self._release(req)
        return status is not None

    def _check_stop(self, req: Request) -> RequestStatus | None:
        p = req.sampling_params
        if req.reached_length(self.max_model_len):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if req.num_output_tokens < p.min_tokens:
            return None
        last = req.output_token_ids[-1]
        if not p.ignore_eos and last == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in p.all_stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        return None

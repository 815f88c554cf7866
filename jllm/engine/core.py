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


def check_pause_mode(mode: str) -> None:
    if mode not in ("abort", "wait", "keep"):
        raise ValueError(f"Invalid pause mode: {mode!r}; use 'abort', 'wait' or 'keep'.")


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
        weights=None,
        routes=None,
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
        # RL: the runner's weight sessions and sleep (runner/weight_sync.py), or None.
        self.weights = weights
        self.weight_version = "default"
        # Pause: None, "new" (abort/wait: the front end refuses new requests, running ones
        # finish) or "all" (keep: nothing is scheduled until resume). Outputs of requests a
        # pause ended, delivered by the next step.
        self.pause_state: str | None = None
        self._pending: list[EngineCoreOutput] = []
        # enable_return_routed_experts: the RoutedExpertsRecord (engine/routed_experts.py)
        self.routes = routes

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
        prompt_embeds=None,
    ) -> None:
        """Admit a validated request; its `n` sequences get seeds `seed`, `seed + 1`, ...
        and share its `cache_salt`, `priority`, LoRA adapter (`lora`), images (`mm_items`)
        and an embeddings prompt's rows (`prompt_embeds`)."""
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
                prompt_embeds,
            )
            children.append(child)
        self.scheduler.check_fits(children[0])  # its sequences are alike
        for child in children:
            self._child_parent[child.request_id] = request_id
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
                if self.routes is not None:  # no output follows an abort
                    self.routes.drop(child.request_id)
        if stats.finished:
            self._record(stats)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: while paused with "keep", only a step in flight or the
        outputs of requests a pause ended."""
        if self._in_flight is not None or self._pending:
            return True
        if self.pause_state == "all":
            return False
        return bool(self._compiling) or self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prefix block; False, and nothing forgotten, while requests
        run, unless `reset_running_requests`: then the running requests are preempted first
        (recomputed when next scheduled) and the reset cannot fail. `reset_connector` is
        vLLM's for an external KV connector; jllm has none, so there is nothing more to
        reset (a utility call: it runs between steps)."""
        del reset_connector  # no KV connector: nothing outside this engine holds its blocks
        if not reset_running_requests:
            return self.scheduler.kv_cache.reset_prefix_cache()
        self._flush_in_flight()
        self.scheduler.preempt_all()
        if not self.scheduler.kv_cache.reset_prefix_cache():
            raise RuntimeError("The prefix cache held blocks with every request preempted.")
        return True

    # ---- RL: weight updates, pause, sleep (utility calls, between steps) ------------------
    def _weight_sync(self):
        if self.weights is None:
            raise RuntimeError("This engine's runner takes no weight updates.")
        return self.weights

    def start_weight_update(self) -> None:
        self._weight_sync().start()

    def update_weights(self, weights, native: bool = False) -> None:
        self._weight_sync().update(weights, native)

    def finish_weight_update(self, weight_version: str | None = None) -> int:
        """Install the session's weights: from the next step on every token is computed
        with them. Nothing computed with the old ones is reused: cached prefixes become
        unreachable (running requests go on with their own blocks but cache no more of
        them), image embeddings are dropped (held ones too), drafts are discarded."""
        count = self._weight_sync().finish()
        sched = self.scheduler
        sched.kv_cache.new_weights(sched.requests.values())
        if sched.encoder_cache is not None:
            sched.encoder_cache.new_weights()
        for req in sched.running:
            req.spec_token_ids = []
        if weight_version is not None:
            self.weight_version = weight_version
        return count

    def update_weight_version(self, version: str) -> None:
        self.weight_version = version

    def get_weight_version(self) -> str:
        return self.weight_version

    def get_weights(self):
        return self._weight_sync().get_weights()

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause: "abort" ends every request (finish reason "abort"), "wait" lets
        them finish, and both leave new requests to the front end to refuse; "keep" freezes
        them where they are until `resume_scheduler`. `clear_cache` resets the caches as
        vLLM's `_reset_caches` does: under "keep" the frozen requests are preempted (their
        KV blocks go; they are recomputed on resume) and the cached prefixes forgotten;
        under "wait" the front end resets once the requests have drained."""
        check_pause_mode(mode)
        if mode == "abort":
            stats, now = StepStats(), time.time()
            for children in list(self.parents.values()):
                for child in children:
                    if child.is_finished():
                        continue
                    self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                    stats.finished.append(self._finished_stats(child, now))
                    self._release(child)
                    self._pending.append(self._output(child, [], None))
            self._compiling.clear()
            if stats.finished:
                self._record(stats)
        self.pause_state = "all" if mode == "keep" else "new"
        if clear_cache and mode != "wait":
            self._reset_caches()

    def _reset_caches(self) -> None:
        """vLLM's `_reset_caches` after a completed pause: nothing keeps a KV block and
        no idle image embedding stays."""
        self.reset_prefix_cache(reset_running_requests=True)
        if self.scheduler.encoder_cache is not None:
            self.scheduler.encoder_cache.drop_idle()

    def resume_scheduler(self) -> None:
        """Schedule again; refused while the weights or the KV cache sleep (`wake_up`
        brings them back and resumes), so a resume cannot run a step on freed memory."""
        if self.weights is not None and self.weights.is_sleeping:
            raise RuntimeError(
                "The engine is asleep (sleep or release_kv_cache_memory): call wake_up, "
                "which resumes scheduling once everything is back."
            )
        self.pause_state = None

    def is_scheduler_paused(self) -> bool:
        return self.pause_state is not None

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Level 0 pauses scheduling; level 1 also moves the weights to host memory and
        frees the KV cache, level 2 frees both (runner/weight_sync.py). Requests kept
        through a sleep of level 1 or 2 lose their cache and are recomputed on waking."""
        if level not in (0, 1, 2):
            raise ValueError(f"Invalid sleep level: {level}; use 0, 1 or 2.")
        self.pause_scheduler(mode, clear_cache=level >= 1)
        self.pause_state = "all"  # asleep: whatever arrives waits for wake_up
        if level >= 1:
            self._reset_caches()  # after "wait" too: the KV cache's memory goes
            self._weight_sync().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back the memory of `tags` ("weights", "kv_cache"; None: all) and, once
        everything is back, resume scheduling ("scheduling" alone resumes a level 0 sleep).
        Returns whether the engine is fully awake."""
        if tags is not None:
            unknown = set(tags) - {"weights", "kv_cache", "scheduling"}
            if unknown:
                raise ValueError(
                    f"Unknown wake_up tags {sorted(unknown)}; use 'weights', 'kv_cache' or "
                    "'scheduling'."
                )
            tags = [t for t in tags if t != "scheduling"]
        if self.weights is not None and (tags is None or tags):
            self.weights.wake_up(tags)
        awake = self.weights is None or not self.weights.is_sleeping
        if awake:
            self.resume_scheduler()
        return awake

    def release_kv_cache_memory(self) -> None:
        """Free the KV cache's device memory after a completed pause with nothing left to
        run; `wake_up(["kv_cache"])` brings it back."""
        if not self.is_scheduler_paused() or self.scheduler.has_unfinished_requests():
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        self._flush_in_flight()
        self.scheduler.kv_cache.reset_prefix_cache()
        self._weight_sync().release_kv_cache()

    def is_sleeping(self) -> bool:
        return self.is_scheduler_paused() or (self.weights is not None and self.weights.is_sleeping)

    def _flush_in_flight(self) -> None:
        """Finish the step in flight (async scheduling) before its arrays go: its outputs
        wait for the next step."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._pending += self._fetch(*in_flight)

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
                matchers = [
                    self.structured.matcher(so, compiled, c.prompt_token_ids) for c in children
                ]
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
        outputs, self._pending = self._pending, []
        if self.pause_state == "all":  # keep: nothing moves until resume
            self._flush_in_flight()
            outputs, self._pending = outputs + self._pending, []
            return EngineCoreOutputs(outputs=outputs, timestamp=time.time())
        outputs += self._admit_compiled()
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
        self._in_flight = (
            None if handle is None else (sched_out, handle, (t_sched, t_run), self.weight_version)
        )
        return outputs

    def _fetch(self, sched_out, handle, times, version) -> list[EngineCoreOutput]:
        """A dispatched step's results; its runner time is the dispatch's plus the fetch's.
        Its tokens were sampled under the weight version of its dispatch."""
        result, t_fetch = self._timed(self.runner.fetch, handle)
        return self._update(sched_out, result, (times[0], times[1] + t_fetch), version)

    def _timed(self, fn, *args):
        """(fn(*args), its duration in seconds), timed only when `step_timing` is on."""
        if not self.step_timing:
            return fn(*args), 0.0
        start = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - start

    def _update(
        self, sched_out, result, times=(0.0, 0.0), version: str | None = None
    ) -> list[EngineCoreOutput]:
        """Apply a step's results; `times`: its (scheduling, runner) seconds; `version`:
        the weight version it ran under (default: the current one)."""
        now = time.time()
        version = self.weight_version if version is None else version
        stats = StepStats(num_computed_tokens=sched_out.total_num_scheduled_tokens)
        sampled: set[str] = set()
        outputs = []
        for rid, reason in result.failed.items():
            outputs += self._fail(rid, reason, now, stats)
        if self.routes is not None:
            self.routes.apply(sched_out, result, self.scheduler.requests)
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
                self.scheduler.reject_drafts(req, len(drafts) + 1 - len(tokens), num_new)
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
                outputs.append(
                    self._output(req, appended, prompt_logprobs, version, result.pooled.get(rid))
                )
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

    def _output(
        self, req: Request, tokens: list, prompt_logprobs, version: str | None = None, pooled=None
    ) -> EngineCoreOutput:
        """What the front end needs of `req` after this step: its new `tokens` (the runner's
        SampledTokens, sampled under weight `version`) and `prompt_logprobs`, its finish
        and timings; a pooling model's `pooled` hidden state."""
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
            weight_version=version,
            routed_experts=None if self.routes is None else self.routes.take(req),
            pooled=pooled,
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
            sched.num_deferred = sum(len(children) for children, _ in self._compiling)
            for stat_logger in self.stat_loggers:
                stat_logger.record(stats, sched)

    def _finished_stats(self, req: Request, now: float) -> FinishedRequestStats:
        scheduled = req.first_scheduled_time or now
        first = req.first_token_time or now
        last = req.last_token_time or now
        return FinishedRequestStats(
            finish_reason=req.status.finish_reason,
            e2e_latency=now - req.arrival_time,
            queued_time=scheduled - req.arrival_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=req.num_output_tokens,
            max_tokens_param=req.sampling_params.max_tokens,
            n=req.sampling_params.n,
            prefill_time=first - scheduled,
            decode_time=last - first,
            inference_time=last - scheduled,
            num_preemptions=req.num_preemptions,
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
        """vLLM's order: an EOS or stop token ends the request as "stop" even when it is also
        the last token max_tokens or the context allows; below min_tokens neither ends it
        (the sampler masks them there)."""
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            last = req.output_token_ids[-1]
            if not p.ignore_eos and last == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in p.all_stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if req.reached_length(self.max_model_len):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

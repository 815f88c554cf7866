"""`AsyncLLM`: the engine for serving. The engine core steps on a background thread while
asyncio handlers add requests and read their outputs as they are produced.

Three kinds of thread share the work:

- the engine thread owns the engine core: it takes commands (add, abort, finish, utility
  calls, stop) from a queue, steps while any request is unfinished, and passes each step's
  token ids on without touching text, so it goes from one device step to the next;
- the output thread (engine/output_thread.py) owns the output processor: detokenizing,
  stop strings, logprob text, `RequestOutput`s, which it hands to each request's asyncio
  queue (`loop.call_soon_threadsafe`); a stop string it finds comes back to the engine
  thread as a "finish" command, the path a client's abort takes;
- the processor pool (`run_processor`: `renderer_num_workers` threads) runs what a new
  request needs before it reaches the engine: chat templates, tokenization, image fetches,
  LoRA adapter loads, so one slow image host holds one worker, not every new request.

Device steps release the GIL, so the event loop keeps accepting connections and streaming
while the model runs. A consumer that stops listening (a client disconnects, a task is
cancelled) aborts its request, which frees its KV blocks on the engine thread before the
next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from jllm.config import EngineArgs
from jllm.engine.core import check_pause_mode
from jllm.engine.output_thread import OutputThread
from jllm.outputs import RequestOutput
from jllm.sampling_params import SamplingParams
from jllm.tracing import extract_trace_headers, start_tracing

logger = logging.getLogger("jllm")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served any more."""


class AsyncLLM:
    def __init__(self, engine, stat_loggers: list | None = None) -> None:
        self.engine = engine
        self.engine.core.stat_loggers.extend(stat_loggers or [])
        self.tracer = start_tracing(engine)  # None unless --otlp-traces-endpoint is set
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.dead_error: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._outputs = OutputThread(
            engine, self._deliver, self._commands.put, self._output_thread_died
        )
        engine.output_handler = self._outputs
        # pause_generation with "abort" or "wait": the engine thread holds the requests that
        # arrive (their "add" commands, in order) until resume or wake_up (vLLM queues them).
        self._held: dict[str, tuple] = {}
        self._holding = False  # the engine thread's: set and cleared by "hold" commands
        self._thread = threading.Thread(target=self._run, name="jllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list | None = None) -> AsyncLLM:
        from jllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args), stat_loggers)

    # ---- front end (event loop) ----------------------------------------------------------
    @property
    def processor_pool(self) -> ThreadPoolExecutor:
        """The bounded pool of `run_processor`, made on first use with the engine's
        `renderer_num_workers` threads."""
        with self._pool_lock:
            if self._pool is None:
                workers = self.engine.args.renderer_num_workers
                # Named as the one tokenization thread it replaces.
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="jllm-tokenize")
            return self._pool

    async def run_processor(self, fn, *args):
        """fn(*args) on the processor pool, off the event loop: what a request needs before
        it reaches the engine (chat template, tokenization, images, its LoRA adapter).
        Its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.processor_pool, fn, *args)

    async def call_utility(self, name: str, *args):
        """The engine core's method `name` called with `args` on the engine thread, between
        two steps (engine/core_client.py); its result, or its exception."""
        self.check_health()
        result: Future = Future()
        self._commands.put(("utility", name, args, result))
        # The engine may have died since the check and drained its queue before this.
        if self.dead_error is not None:
            _fail(result, EngineDeadError(f"The engine stopped: {self.dead_error!r}"))
        return await asyncio.wrap_future(result)

    def prepare(
        self, prompt, params: SamplingParams, lora_request=None, add_special_tokens: bool = True
    ):
        """Validate and tokenize (raises ValueError); nothing reaches the engine yet."""
        self.check_health()
        return self.engine.prepare(prompt, params, lora_request, add_special_tokens)

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams,
        request_id: str,
        prepared=None,
        priority: int = 0,
        trace_headers: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them, the last one finished.

        Pass `prepared` (from `prepare`) to validate before starting a response, and the
        HTTP request's `trace_headers` (`trace_headers()`) to trace it under their trace."""
        processed, params = prepared or self.prepare(prompt, sampling_params)
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already running.")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", request_id, processed, params, priority, trace_headers))
        finished = False
        try:
            # The engine may have died since `prepare` and told only the streams it saw:
            # this one, registered after, must not wait for an output that never comes.
            self.check_health()
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """End the named requests (None: every request this front end is serving); returns
        how many it asked to end."""
        ids = list(self._streams) if request_ids is None else list(request_ids)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    # ---- RL: pause, sleep, weight updates (vLLM's AsyncLLM methods; docs/rl.md) ----------
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """ "abort": every request ends now (finish reason "abort"); "wait": they finish
        first; under both, requests that arrive queue until `resume_generation` (vLLM's
        rule: held before the engine, so "wait" drains). "keep": requests freeze where they
        are and new ones queue; all go on after resume with the outputs they would have
        had. `clear_cache` resets the caches once the pause is complete, as vLLM: the cached
        prefixes are forgotten and, under "keep", the frozen requests lose their KV blocks
        and are recomputed on resume (with the weights installed meanwhile)."""
        check_pause_mode(mode)  # before anything is held
        if mode != "keep":
            self._commands.put(("hold", True))  # adds after this one wait for resume
        await self.call_utility("pause_scheduler", mode, clear_cache)
        if mode == "wait":
            while await self.call_utility("has_unfinished_requests"):
                await asyncio.sleep(0.01)
            if clear_cache:
                await self.call_utility("reset_prefix_cache", True)
        # The ended requests' final outputs reach their streams before this returns.
        await asyncio.sleep(0.02)

    async def resume_generation(self) -> None:
        """Resume after `pause_generation`; refused (RuntimeError) while asleep: `wake_up`
        resumes then. The requests held meanwhile start, in the order they came."""
        await self.call_utility("resume_scheduler")
        self._commands.put(("hold", False))

    async def is_paused(self) -> bool:
        return await self.call_utility("is_scheduler_paused")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """`LLM.sleep`'s levels; requests that arrive while asleep wait for `wake_up`."""
        if mode == "wait":  # drain first, then sleep with nothing running
            await self.pause_generation(mode="wait", clear_cache=False)
            mode = "keep"
        await self.call_utility("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Fully awake, the engine schedules again: held requests start too."""
        awake = await self.call_utility("wake_up", tags)
        if awake:
            self._commands.put(("hold", False))
        return awake

    async def is_sleeping(self) -> bool:
        return await self.call_utility("is_sleeping")

    async def release_kv_cache_memory(self) -> None:
        await self.call_utility("release_kv_cache_memory")

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """`LLM.reset_prefix_cache`."""
        return await self.call_utility(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )

    async def init_weight_transfer_engine(self, request=None) -> None:
        self.engine.init_weight_transfer_engine(request)

    async def start_weight_update(self) -> None:
        await self.call_utility("start_weight_update")

    async def update_weights(self, weights) -> None:
        """`LLM.update_weights`: tensors, `get_weights()`'s state, or {"update_info": ...}."""
        await self.call_utility("update_weights", *self.engine.weight_tensors(weights))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.call_utility("finish_weight_update", weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await self.call_utility("update_weight_version", new_version)

    async def get_weight_version(self) -> str:
        return await self.call_utility("get_weight_version")

    async def get_weights(self):
        return await self.call_utility("get_weights")

    def trace_headers(self, headers) -> dict | None:
        """The W3C trace headers of an HTTP request's `headers` to pass to `generate`; None
        when tracing is off (jllm/tracing.py)."""
        return extract_trace_headers(headers, self.tracer is not None)

    def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine stopped: {self.dead_error!r}")

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_params(self) -> dict:
        return self.engine.default_sampling_params

    def shutdown(self) -> None:
        self._commands.put(("stop",))
        self._thread.join(timeout=30)
        self._outputs.stop()  # after the engine thread: the outputs it queued are delivered
        self.engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # sends the spans still batched
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread -------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _handle(self, command) -> bool:
        kind = command[0]
        if kind == "stop":
            return False
        if kind == "hold":
            self._holding = command[1]
            if not self._holding:  # resumed: the held requests start, in order
                held, self._held = self._held, {}
                for add in held.values():
                    self._handle(add)
        elif kind == "abort":
            if self._held.pop(command[1], None) is None:  # a held one never reached it
                self.engine.abort_request([command[1]])
        elif kind == "finish":  # the output thread ended these (a stop string, a failure)
            self.engine.engine_core.abort_requests(command[1], command[2])
        elif kind == "utility":
            _, name, args, result = command
            try:
                result.set_result(self.engine.engine_core.call_utility(name, *args))
            except Exception as e:  # noqa: BLE001 - the caller's to handle
                result.set_exception(e)
        elif self._holding:  # paused ("abort" or "wait"): it waits for resume
            self._held[command[1]] = command
        else:
            _, request_id, processed, params, priority, trace_headers = command
            try:
                self.engine.add_request(request_id, processed, params, priority, trace_headers)
            except ValueError as e:
                self._deliver(request_id, e)
        return True

    def _run(self) -> None:
        engine = self.engine
        try:
            while self.dead_error is None:  # the output thread may have died
                # Sleep on the queue when idle; otherwise take what arrived and step.
                if not engine.has_unfinished_requests():
                    if not self._handle(self._commands.get()):
                        return
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(command):
                        return
                if engine.has_unfinished_requests():
                    # Empty with the output thread: it delivers this step's outputs.
                    for out in engine.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            logger.exception("The engine loop failed; failing all running requests.")
            self.dead_error = e
            dead = EngineDeadError(f"The engine stopped: {e!r}")
            while True:  # utility calls waiting for this thread
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "utility":
                    _fail(command[3], dead)
            # After the outputs already queued, which their requests still get.
            self._outputs.call(lambda: self._fail_streams(dead))

    def _output_thread_died(self, error: BaseException) -> None:
        if self.dead_error is None:
            self.dead_error = error
        self._fail_streams(EngineDeadError(f"The engine stopped: {self.dead_error!r}"))

    def _fail_streams(self, dead: EngineDeadError) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, dead)


def _fail(result: Future, error: BaseException) -> None:
    """Fail a utility call's future unless it is answered already."""
    try:
        result.set_exception(error)
    except InvalidStateError:
        pass

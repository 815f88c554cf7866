"""`AsyncLLM`: the engine for serving. The engine core steps on a background thread while
asyncio handlers add requests and read their outputs as they are produced.

One thread owns the engine: it takes commands (add, abort, stop) from a queue, steps while
any request is unfinished, and hands each `RequestOutput` to the asyncio queue of the
request it belongs to (`loop.call_soon_threadsafe`). Device steps release the GIL, so the
event loop keeps accepting connections and streaming while the model runs. A consumer that
stops listening (a client disconnects, a task is cancelled) aborts its request, which frees
its KV blocks on the engine thread before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from jllm.config import EngineArgs
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
        self._thread = threading.Thread(target=self._run, name="jllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list | None = None) -> AsyncLLM:
        from jllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args), stat_loggers)

    # ---- front end (event loop) ----------------------------------------------------------
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
        self.engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # sends the spans still batched

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
        if kind == "abort":
            self.engine.abort_request([command[1]])
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
            while True:
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
                    for out in engine.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            logger.exception("The engine loop failed; failing all running requests.")
            self.dead_error = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"The engine stopped: {e!r}"))

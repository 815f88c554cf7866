"""AsyncLLM's output thread: the front end's output processing, off the engine thread.

The engine thread steps the core and hands this thread, in order, each request it admitted,
each client abort and each step's `EngineCoreOutputs`; this thread alone owns the engine's
`OutputProcessor` (no lock), detokenizes, scans stop strings, builds the `RequestOutput`s and
delivers them. The sequences a stop string ended go back to the engine thread as commands
(`("finish", ids, status)`, the queue client aborts take), so the core frees them before its
next step.

Why a thread and not the event loop (vLLM's output_handler task): in one process both hold
the same GIL, but work on the event loop would also delay every stream's writes and every
new request's parsing; on its own thread the processing runs while the engine thread waits
on the device (XLA releases the GIL) and the loop only forwards finished objects.
Host-side: no JAX.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from jllm.engine.request import RequestStatus

logger = logging.getLogger("jllm")


class OutputThread:
    """`engine`: the LLMEngine whose `output_processor` this thread drives; `deliver(request
    id, item)`: hand an output (or an exception) to its stream; `send(command)`: a command to
    the engine thread; `on_error(exc)`: this thread failed and stops."""

    def __init__(
        self,
        engine,
        deliver: Callable[[str, object], None],
        send: Callable[[tuple], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self._deliver, self._send, self._on_error = deliver, send, on_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jllm-outputs", daemon=True)
        self._thread.start()

    # ---- the engine thread's side (LLMEngine calls these in place of its inline processing)
    def add_request(self, request, prompt, trace_headers) -> None:
        self._queue.put(("add", request, prompt, trace_headers))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._queue.put(("abort", request_ids))

    def process_outputs(self, outputs) -> None:
        if outputs.outputs:
            self._queue.put(("outputs", outputs))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on this thread after everything queued before it."""
        self._queue.put(("call", fn))

    def stop(self, timeout: float = 30) -> None:
        self._queue.put(("stop",))
        self._thread.join(timeout=timeout)

    # ---- this thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._handle(self._queue.get()):
                pass
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            logger.exception("The output thread failed; failing all running requests.")
            self._on_error(e)

    def _handle(self, item) -> bool:
        kind = item[0]
        if kind == "stop":
            return False
        if kind == "call":
            item[1]()
            return True
        processor = self.engine.output_processor
        if kind == "outputs":
            processed = processor.process_outputs(item[1])
            for out in processed.request_outputs:
                self._deliver(out.request_id, out)
            if processed.reqs_to_abort:
                self._send(("finish", processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED))
            if processed.reqs_to_fail:
                self._send(("finish", processed.reqs_to_fail, RequestStatus.FINISHED_ERROR))
        elif kind == "add":
            processor.add_request(*item[1:])
        else:
            processor.abort_requests(item[1])
        return True

"""AsyncLLM's engine thread with a fake engine: what a request sees when the engine dies."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from jllm.engine.async_llm import AsyncLLM, EngineDeadError


class DyingEngine:
    """An engine whose first step fails."""

    def __init__(self) -> None:
        self.core = SimpleNamespace(stat_loggers=[])
        self.requests: list[str] = []
        self.shut = threading.Event()

    def prepare(self, prompt, params, lora_request=None, add_special_tokens=True):
        return prompt, params

    def add_request(self, request_id, processed, params, priority=0, trace_headers=None):
        self.requests.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        raise RuntimeError("the device step failed")

    def abort_request(self, request_ids) -> None:
        pass

    def shutdown(self) -> None:
        self.shut.set()


def test_a_request_prepared_before_the_engine_died_fails_at_once():
    """A request validated (`prepare`) while the engine was alive, and started after the
    engine thread reported its death to the requests it knew, raises EngineDeadError instead
    of waiting for an output that never comes."""

    async def main():
        llm = AsyncLLM(DyingEngine())
        prepared = llm.prepare("late", None)  # the engine is still alive
        with pytest.raises(EngineDeadError, match="the device step failed"):
            async for _ in llm.generate("first", None, "first"):
                pass
        llm._thread.join()  # the engine thread has exited: nothing more is delivered
        first_output = llm.generate(None, None, "late", prepared=prepared).__anext__()
        # Run it up to its first wait for an output: it must raise before that.
        with pytest.raises(EngineDeadError, match="the device step failed"):
            first_output.send(None)
        assert not llm._streams

    asyncio.run(main())


class SplitEngine(DyingEngine):
    """An engine whose steps hand their outputs to AsyncLLM's output thread (as LLMEngine
    does once AsyncLLM sets `output_handler`); the output processor and the core client are
    fakes: a step's outputs are the ids added, and every step after the first fails (or, with
    `fail_processing`, the processing of its outputs)."""

    def __init__(self, fail_processing: bool = False) -> None:
        super().__init__()
        self.output_handler = None
        self.fail_processing = fail_processing
        self.fail_step = threading.Event()
        self.output_processor = SimpleNamespace(
            add_request=lambda *a: None,
            abort_requests=lambda ids: None,
            process_outputs=self._process,
        )
        self.engine_core = SimpleNamespace(call_utility=lambda name, *args: (name, args))

    def _process(self, outputs):
        if self.fail_processing:
            raise RuntimeError("the output processor failed")
        from jllm.outputs import RequestOutput

        outs = [RequestOutput(rid, None, [], None, [], False) for rid in outputs.outputs]
        return SimpleNamespace(request_outputs=outs, reqs_to_abort=[], reqs_to_fail=[])

    def step(self):
        if self.fail_step.is_set():
            raise RuntimeError("the device step failed")
        self.output_handler.process_outputs(SimpleNamespace(outputs=list(self.requests)))
        if not self.fail_processing:
            self.fail_step.set()  # the next step fails
        return []


def test_outputs_queued_before_the_engine_died_come_first():
    async def main():
        llm = AsyncLLM(SplitEngine())
        got = []
        with pytest.raises(EngineDeadError, match="the device step failed"):
            async for out in llm.generate("p", None, "r"):
                got.append(out.request_id)
        assert got == ["r"]  # queued before the failure: delivered before the error

    asyncio.run(main())


def test_a_failed_output_thread_fails_every_request_and_stops_the_engine():
    async def main():
        llm = AsyncLLM(SplitEngine(fail_processing=True))
        with pytest.raises(EngineDeadError, match="the output processor failed"):
            async for _ in llm.generate("p", None, "r"):
                pass
        llm._thread.join(60)
        assert not llm._thread.is_alive()  # the engine thread saw it and stopped
        with pytest.raises(EngineDeadError):
            await llm.call_utility("anything")

    asyncio.run(main())


def test_utility_calls_are_answered_on_the_engine_thread():
    async def main():
        llm = AsyncLLM(SplitEngine())
        assert await llm.call_utility("pause", 1, 2) == ("pause", (1, 2))

    asyncio.run(main())

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

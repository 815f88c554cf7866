"""Stopping the server on SIGTERM or SIGINT, as vLLM does under `--shutdown-timeout`.

The first signal stops new requests (503) and gives the running ones `--shutdown-timeout`
seconds (vLLM's default 0: none) to finish; then every request still running is aborted:
its KV blocks are freed and its client gets a 503 error (in-band, then `[DONE]`, for a
stream) instead of tokens until its `max_tokens`. Only then does uvicorn stop, so it has no
open stream to wait for. A second signal is uvicorn's own: stop now (SIGINT: without
waiting for connections).

`StoppableLLM` is the engine that can end its requests this way; `GracefulServer` is the
uvicorn server that does it before exiting.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from jllm.engine.async_llm import AsyncLLM
from jllm.entrypoints.openai.serving_engine import OpenAIError

logger = logging.getLogger("jllm.entrypoints.openai")

SHUTTING_DOWN = "The server is shutting down."
_END = object()


def _resolve(stop: asyncio.Future) -> None:
    if not stop.done():
        stop.set_result(None)


class StoppableLLM(AsyncLLM):
    """AsyncLLM whose running requests can all be ended at once (`stop_requests`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stopping = False  # new requests are refused
        self._stops: set[asyncio.Future] = set()  # one per running request, on its loop

    async def generate(self, *args, **kwargs):
        """AsyncLLM.generate, ended by `stop_requests` with an OpenAIError (503)."""
        if self.stopping:
            raise OpenAIError(SHUTTING_DOWN, 503)
        stop = asyncio.get_running_loop().create_future()
        self._stops.add(stop)
        outputs = super().generate(*args, **kwargs)
        step = None
        try:
            while True:
                step = asyncio.ensure_future(anext(outputs, _END))
                await asyncio.wait((step, stop), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise OpenAIError(SHUTTING_DOWN, 503)
                out = step.result()
                if out is _END:
                    return
                yield out
        finally:
            self._stops.discard(stop)
            if step is not None and not step.done():
                # Ends the request's stream where it waits; that aborts the request.
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await outputs.aclose()

    async def stop_requests(self, timeout: float = 0) -> None:
        """Refuse new requests, wait up to `timeout` seconds for the running ones to finish,
        then end the rest."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._stops and timeout > 0:
            logger.info(
                "Waiting up to %s s for %d running request(s) (--shutdown-timeout).",
                timeout,
                len(self._stops),
            )
        while self._stops and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self._stops:
            logger.info("Aborting %d running request(s).", len(self._stops))
        for stop in list(self._stops):
            stop.get_loop().call_soon_threadsafe(_resolve, stop)


class GracefulServer(uvicorn.Server):
    """uvicorn's server; its first SIGTERM/SIGINT stops the engine's requests before the HTTP
    server (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: StoppableLLM, timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = timeout
        self.signalled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopper: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.signalled or self._loop is None:
            return super().handle_exit(sig, frame)
        self.signalled = True
        logger.info("Shutdown requested: stopping the running requests.")
        self._loop.call_soon_threadsafe(self._start_stopping)

    def _start_stopping(self) -> None:
        self._stopper = asyncio.ensure_future(self._stop())

    async def _stop(self) -> None:
        try:
            await self.engine.stop_requests(self.shutdown_timeout)
        except Exception:  # noqa: BLE001 - the server stops all the same
            logger.exception("Stopping the running requests failed.")
        self.should_exit = True

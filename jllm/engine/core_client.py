"""The front end's handle on an engine core (vLLM V1's `core_client.py`).

`LLMEngine` and `AsyncLLM` reach the core only through a client: `add_request`,
`abort_requests`, `get_output` (one step's `EngineCoreOutputs`), `has_unfinished_requests`
and `call_utility(name, *args)`, a core method called by name between steps (pause, sleep,
weight updates and several data-parallel cores are meant to arrive this way). Everything
that crosses is plain data (engine/outputs.py), so a client for a core in another thread or
process keeps this surface; today's `InprocClient` calls the core in place, on the thread
that owns it (the caller's under `LLM`, the engine thread under `AsyncLLM`). No JAX.
"""

from __future__ import annotations

from jllm.engine.core import EngineCore
from jllm.engine.outputs import EngineCoreOutputs, EngineCoreRequest
from jllm.engine.request import RequestStatus


class InprocClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit `request`; ValueError if the core refuses it (its id is already running)."""
        self.core.add_request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            seed=request.seed,
            arrival_time=request.arrival_time,
            cache_salt=request.cache_salt,
            priority=request.priority,
            lora=request.lora,
            mm_items=request.mm_items,
            prompt_embeds=request.prompt_embeds,
        )

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """End requests (by their id: all their sequences) or single sequences with `status`."""
        if request_ids:
            self.core.abort_request(request_ids, status)

    def get_output(self) -> EngineCoreOutputs:
        """One engine step's outputs."""
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def call_utility(self, name: str, *args):
        """The core's public method `name` called with `args`; its result or its exception."""
        method = getattr(self.core, name, None) if not name.startswith("_") else None
        if not callable(method):
            raise ValueError(f"The engine core has no utility {name!r}.")
        return method(*args)

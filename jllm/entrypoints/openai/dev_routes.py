"""vLLM's development routes for RL rollouts: pause, sleep, caches, aborts and weight
updates, served only with VLLM_SERVER_DEV_MODE=1 (a 404 without: anyone who can reach them
can stop the server's work or change its weights).

Methods, query parameters, bodies and replies are vLLM's (`entrypoints/rl/online` and
`entrypoints/serve/dev`). A refused call (a bad mode, an update out of order, a tensor the
model cannot take) is an OpenAI-style 400, never a 500; the engine goes on serving.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from jllm.entrypoints.openai.serving_engine import error_response
from jllm.version import __version__ as JLLM_VERSION

PauseMode = Literal["abort", "wait", "keep"]


def dev_mode() -> bool:
    return os.environ.get("VLLM_SERVER_DEV_MODE", "") == "1"


def engine_config(args) -> dict:
    """The engine arguments as JSON values (anything else as its text)."""
    return json.loads(json.dumps(dataclasses.asdict(args), default=str))


def system_env() -> dict:
    import jax

    return {
        "python_version": sys.version,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_version": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "jllm_version": JLLM_VERSION,
    }


def attach_dev_routes(app: FastAPI, engine) -> None:
    """The routes, each calling the AsyncLLM `engine`."""

    async def call(work, reply: dict) -> JSONResponse:
        try:
            await work
        except (ValueError, RuntimeError) as e:
            return error_response(str(e), 400)
        return JSONResponse(reply)

    @app.get("/server_info")
    async def server_info(config_format: Annotated[Literal["text", "json"], Query()] = "text"):
        """vLLM's: the engine's configuration, the VLLM_* variables (none holding a key) and
        the system's."""
        config = engine_config(engine.engine.args)
        return {
            "vllm_config": str(config) if config_format == "text" else config,
            "vllm_env": {
                k: v for k, v in os.environ.items() if k.startswith("VLLM_") and "KEY" not in k
            },
            "system_env": system_env(),
        }

    @app.post("/pause")
    async def pause(mode: Annotated[PauseMode, Query()] = "abort", clear_cache: bool = True):
        return await call(
            engine.pause_generation(mode=mode, clear_cache=clear_cache), {"status": "paused"}
        )

    @app.post("/resume")
    async def resume():
        return await call(engine.resume_generation(), {"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await engine.is_paused()}

    @app.post("/sleep")
    async def sleep(
        level: Annotated[int, Query(ge=0, le=2)] = 1,
        mode: Annotated[PauseMode, Query()] = "abort",
    ):
        return await call(engine.sleep(level, mode), {"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        tags = raw.query_params.getlist("tags") or None
        try:
            awake = await engine.wake_up(tags)
        except (ValueError, RuntimeError) as e:
            return error_response(str(e), 400)
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = False, reset_external: bool = False
    ):
        """vLLM's: `reset_running_requests` preempts the running requests first;
        `reset_external` (an external connector's cache: jllm has none) resets nothing
        more."""
        try:
            success = await engine.reset_prefix_cache(reset_running_requests, reset_external)
        except (ValueError, RuntimeError) as e:
            return error_response(str(e), 400)
        return {"success": bool(success)}

    @app.post("/release_kv_cache_memory")
    async def release_kv_cache_memory():
        return await call(engine.release_kv_cache_memory(), {"status": "kv_cache_released"})

    @app.post("/abort_requests")
    async def abort_requests(raw: Request):
        try:
            body = await raw.json()
        except ValueError:
            return error_response("The request body is not valid JSON.", 400)
        if not isinstance(body, dict):
            return error_response("Request body must be a JSON object", 400)
        ids = body.get("request_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return error_response("request_ids must be a list of strings.", 400, "request_ids")
        aborted = engine.abort_requests(ids or None)
        return {"status": "aborted", "aborted": aborted}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(
        init_info: Annotated[dict[str, Any], Body(embed=True)],
    ):
        return await call(
            engine.init_weight_transfer_engine(init_info),
            {"message": "Weight transfer initialized"},
        )

    @app.post("/start_weight_update")
    async def start_weight_update():
        return await call(engine.start_weight_update(), {"message": "Weight update started"})

    @app.post("/update_weights")
    async def update_weights(update_info: Annotated[dict[str, Any], Body(embed=True)]):
        return await call(
            engine.update_weights({"update_info": update_info}), {"message": "Weights updated"}
        )

    @app.post("/finish_weight_update")
    async def finish_weight_update(
        weight_version: Annotated[str | None, Body(embed=True)] = None,
    ):
        return await call(
            engine.finish_weight_update(weight_version), {"message": "Weight update finished"}
        )

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: Annotated[str, Body(embed=True)]):
        return await call(
            engine.update_weight_version(new_version),
            {"success": True, "new_version": new_version},
        )

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": await engine.get_weight_version()}

"""What the completion and chat handlers share: OpenAI error bodies, model-name checks,
request logging, running several sub-requests at once, and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from jllm.beam_search import BeamSearch
from jllm.engine.async_llm import AsyncLLM
from jllm.outputs import RequestOutput
from jllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("jllm.entrypoints.openai")

# JSON has no -inf; vLLM reports impossible tokens with this logprob.
MIN_LOGPROB = -9999.0

_STATUS_TYPE = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _STATUS_TYPE.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


async def json_object(raw) -> dict:
    """A request's body as a JSON object, else a 400 saying what it is not."""
    try:
        body = await raw.json()
    except ValueError:
        raise OpenAIError("The request body is not valid JSON.", 400) from None
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.", 400)
    return body


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_event(name: str, data: dict) -> str:
    """A named event (Anthropic's and the Responses API's streams): `event:` and `data:`."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """`data:` events of dict chunks; closing it closes `chunks` (aborting their requests)."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield sse(chunk)


async def event_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE events of `chunks`, then `[DONE]`. Once the stream has started an error can
    no longer change the status code, so it is sent in-band in OpenAI's error body."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except OpenAIError as e:
            yield sse(error_body(e.message, e.status, e.param))
        except Exception as e:  # noqa: BLE001 - reported to the client, in-band
            logger.exception("Error in a streaming response.")
            yield sse(error_body(str(e), 500))
    yield sse("[DONE]")


class SSEResponse(StreamingResponse):
    """An event stream (see `event_stream`) whose generator is always closed, so a dropped
    client aborts its requests even when the server notices only at the next write."""

    def __init__(self, chunks: AsyncIterator[str], framed: bool = False) -> None:
        """`framed`: `chunks` are whole events already, errors included (no `[DONE]`)."""
        body = chunks if framed else event_stream(chunks)
        super().__init__(body, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def clamp(logprob: float) -> float:
    """A logprob JSON can carry: -inf, and NaN (every token masked: a grammar the
    vocabulary cannot follow), as MIN_LOGPROB."""
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def prompt_logprobs_json(prompt_logprobs) -> list | None:
    """vLLM's `prompt_logprobs` in responses: per prompt token null (the first) or
    {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def usage_options(request) -> tuple[bool, bool]:
    """(a final usage chunk, usage in every chunk) from `stream_options`, as vLLM reads them:
    `continuous_usage_stats` counts only together with `include_usage`."""
    opts = request.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int | None = None,
    cached_tokens: int | None = None,
) -> dict:
    """OpenAI's usage; `reasoning_tokens` (a reasoning parser is on) and `cached_tokens`
    (--enable-prompt-tokens-details): their details too."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def fit_max_tokens(params: SamplingParams, num_prompt: int, max_len: int) -> None:
    """vLLM's `get_max_tokens`: max_tokens past the room the prompt leaves in the context is
    that room (an unset one already is); a prompt that fills the context leaves none."""
    room = max_len - num_prompt
    if room < 1:
        raise OpenAIError(
            f"This model's maximum context length is {max_len} tokens, and the prompt has "
            f"{num_prompt}: no room is left for the completion. Please reduce the length of "
            "the prompt.",
            400,
        )
    if params.max_tokens is not None and params.max_tokens > room:
        params.max_tokens = room
        if params.min_tokens > room:
            raise OpenAIError(
                f"min_tokens must be less than or equal to max_tokens={room}, got "
                f"{params.min_tokens}.",
                400,
                "min_tokens",
            )


def raise_if_error(out: RequestOutput) -> None:
    """A request-level internal error (finish reason "error") is a 500, as in vLLM; the
    engine and the requests beside it go on."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise OpenAIError("Internal server error", 500)


def check_beam_search(params: SamplingParams) -> None:
    """Beam search scores plain continuations: it cannot honour a grammar (a tool_choice
    "required" or named function is one)."""
    if params.structured_outputs is not None:
        raise OpenAIError(
            "use_beam_search cannot be combined with structured outputs or tool_choice "
            '"required" or a named function.',
            400,
            "use_beam_search",
        )


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        models,
        log_requests: bool = True,
        max_log_len: int | None = None,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        self.prompt_tokens_details = prompt_tokens_details  # --enable-prompt-tokens-details
        self.models = models  # ServingModels (serving_models.py): base names and adapters
        self.model_name = models.base_names[0]
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.tokenizer = engine.get_tokenizer()

    async def off_loop(self, fn, *args):
        """fn(*args) on the engine's processor pool (`AsyncLLM.run_processor`), so chat
        templates, tokenization, image fetches and adapter loads neither stall the streams
        the event loop serves nor wait for one another; its exceptions propagate."""
        return await self.engine.run_processor(fn, *args)

    def check_request(self, request):
        """Refuses what the request asks that this server cannot do; returns the LoRA
        adapter its `model` names, or None for the base model."""
        lora = self.models.resolve(request.model)
        try:
            request.check_stream_options()
        except ValueError as e:
            raise OpenAIError(str(e), 400, getattr(e, "param", None)) from e
        field = request.unsupported_field()
        if field is not None:
            raise OpenAIError(f"{field} is not supported by jllm yet.", 400, field)
        backend = request.guided_decoding_backend
        if backend is not None:
            config = self.engine.engine.args.structured_outputs_config
            if backend != config.backend:
                raise OpenAIError(
                    "Request-level structured output backend selection is not supported; "
                    f"this server's backend is {config.backend!r} "
                    "(--structured-outputs-config).",
                    400,
                    "guided_decoding_backend",
                )
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError(
                "prompt_logprobs are not available when stream is enabled.", 400, "prompt_logprobs"
            )
        return lora

    def trace_headers(self, raw_request) -> dict | None:
        """The HTTP request's W3C trace headers when tracing is on (vLLM's
        `_get_trace_headers`), for `run_all`."""
        return None if raw_request is None else self.engine.trace_headers(raw_request.headers)

    def served_name(self, request) -> str:
        """The model name a response reports: the adapter the request named, else the
        base model's first name."""
        if request.model in self.models.loras:
            return request.model
        return self.model_name

    def prepare(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        lora=None,
        add_special_tokens: bool = True,
    ):
        try:
            prepared = self.engine.prepare(prompt, params, lora, add_special_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), 400) from e
        fit_max_tokens(prepared[1], len(prepared[0].prompt_token_ids), self.engine.max_model_len)
        if self.log_requests:
            text = prepared[0].prompt
            ids = prepared[0].prompt_token_ids
            if self.max_log_len is not None:
                text = text[: self.max_log_len] if text is not None else None
                ids = ids[: self.max_log_len]
            logger.info(
                "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                request_id,
                text,
                params,
                ids,
            )
        return prepared

    async def beam_search(self, request_id: str, prepared, request, params: SamplingParams):
        """vLLM's beam search for one prepared prompt (`jllm/beam_search.py`), each step's
        beams run concurrently as single-token requests: the best `n` beams as (beam, its
        generated tokens, their text without a final EOS unless include_stop_str_in_output).
        Not streamed, as in vLLM."""
        if request.stream:
            raise OpenAIError(
                "Streaming is not currently supported with beam search.", 400, "stream"
            )
        processed, _ = prepared
        num_prompt = len(processed.prompt_token_ids)
        try:
            beam_params = BeamSearchParams(
                beam_width=request.n,
                max_tokens=params.max_tokens or self.engine.max_model_len - num_prompt,
                ignore_eos=request.ignore_eos,
                temperature=params.temperature,
                length_penalty=request.length_penalty,
                include_stop_str_in_output=request.include_stop_str_in_output,
            )
        except ValueError as e:
            raise OpenAIError(str(e), 400) from e
        search = BeamSearch(
            None, processed.prompt_token_ids, beam_params, self.engine.eos_token_ids
        )
        step_params = search.step_params()

        async def final(rid: str, item):
            last = None
            async for out in self.engine.generate(None, None, rid, item, request.priority):
                raise_if_error(out)
                last = out
            return last

        while not search.done:
            self.engine.check_health()
            try:
                items = [
                    self.engine.engine.continue_prompt(processed, tokens, step_params)
                    for tokens in search.beam_tokens()
                ]
            except ValueError as e:
                raise OpenAIError(str(e), 400) from e
            outs = await asyncio.gather(
                *(final(f"{request_id}-{search.steps}-{j}", it) for j, it in enumerate(items))
            )
            search.advance(list(outs))
        results = []
        for beam in search.best():
            tokens = beam.tokens[num_prompt:]
            shown = tokens
            if beam.finish_reason == "stop" and not request.include_stop_str_in_output:
                shown = tokens[:-1]
            results.append((beam, tokens, self.tokenizer.decode(shown, skip_special_tokens=True)))
        return results

    async def run_all(
        self, request_id: str, prepared: list, priority: int = 0, trace_headers=None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt and yield `(prompt index, output)` as they
        come; each is traced under `trace_headers` (`trace_headers()`). Leaving early (a
        disconnect, an error) aborts every unfinished one."""
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, item) -> None:
            try:
                async for out in self.engine.generate(
                    None, None, f"{request_id}-{i}", item, priority, trace_headers
                ):
                    await merged.put((i, out))
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
                await merged.put((i, e))
            await merged.put((i, done))

        tasks = [asyncio.create_task(pump(i, item)) for i, item in enumerate(prepared)]
        remaining = len(tasks)
        try:
            while remaining:
                i, out = await merged.get()
                if out is done:
                    remaining -= 1
                elif isinstance(out, Exception):
                    raise out
                else:
                    raise_if_error(out)
                    yield i, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.log_requests:
                logger.info("Finished request %s.", request_id)

    def cached(self, outputs) -> int | None:
        """usage's cached_tokens of some outputs, when the server reports them."""
        if not self.prompt_tokens_details:
            return None
        return sum(out.num_cached_tokens or 0 for out in outputs)

    @staticmethod
    def created() -> int:
        return int(time.time())

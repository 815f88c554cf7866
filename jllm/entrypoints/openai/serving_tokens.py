"""Token-in/token-out (vLLM's scale-out `/inference/v1/generate`, behind `--enable-scale-out`):
token ids and a `SamplingParams` object in, token ids, logprobs by token id and the routed
experts out, no chat template and no text unless `output_mode: "text"` asks. What RL
rollout workers and routers that tokenize themselves call; `/inference/v1/abort_requests`
stops requests by id. Without the flag both answer 403, as vLLM's do.
"""

from __future__ import annotations

import base64
import io
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field

from jllm.entrypoints.openai.protocol import (
    TOKEN_ID_KEY,
    Int,
    NonEmpty,
    OpenAIBaseModel,
    StopList,
    StreamOptions,
    TokenId,
)
from jllm.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    OpenAIError,
    OpenAIServing,
    SSEResponse,
    clamp,
    prompt_logprobs_json,
    sse_events,
    usage,
    usage_options,
)
from jllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

DISABLED = (
    "Scale-out endpoints are disabled. Restart jllm serve with --enable-scale-out to enable them."
)


class TokenSamplingParams(OpenAIBaseModel):
    """`SamplingParams`' fields as JSON (an unknown one is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    n: Int(1, 1024) = 1
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: Int(-1) = 0
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: Int(0) | None = None
    stop: NonEmpty | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    max_tokens: Int(1) | None = None
    min_tokens: Int(0) = 0
    logprobs: Int(-1) | None = None
    prompt_logprobs: Int(-1) | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[NonEmpty] | None = None
    structured_outputs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    routed_experts_prompt_start: Int(0) = 0

    def build(self, stream: bool) -> SamplingParams:
        fields = self.model_dump(exclude={"logit_bias", "structured_outputs"})
        try:
            if self.logit_bias is not None:
                bad = [k for k in self.logit_bias if not TOKEN_ID_KEY.fullmatch(k)]
                if bad:
                    raise ValueError(f"logit_bias key {bad[0]!r} is not a token id.")
                fields["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            if self.structured_outputs is not None:
                fields["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
            return SamplingParams(**fields, output_kind=kind)
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"Invalid sampling_params: {e}", 400, "sampling_params") from e


class GenerateRequest(OpenAIBaseModel):
    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: TokenSamplingParams
    model: str | None = None
    request_id: NonEmpty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: NonEmpty | None = None
    priority: Int(-(2**63)) = 0
    return_token_ids: bool = False
    output_mode: Literal["tokens", "text"] = "tokens"


class AbortRequests(OpenAIBaseModel):
    request_ids: list[NonEmpty]


def engine_request_id(request_id: str) -> str:
    """vLLM's id of a token route's request (its prompt's engine request adds "-0")."""
    return f"generate-tokens-{request_id}"


def npy_base64(array: np.ndarray | None) -> str | None:
    """An array as vLLM sends it: base64 of `np.save`'s bytes (no pickle)."""
    if array is None:
        return None
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def token_logprobs(c) -> dict:
    """Per generated token: its id, logprob and rank, and the top alternatives by rank."""
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
        sampled = entry.get(tid)
        top = sorted(
            ((t, lp) for t, lp in entry.items() if lp.rank is not None),
            key=lambda x: x[1].rank,
        )
        content.append(
            {
                "token_id": tid,
                "logprob": clamp(sampled.logprob) if sampled else MIN_LOGPROB,
                "rank": sampled.rank if sampled else None,
                "top_logprobs": [
                    {"token_id": t, "logprob": clamp(lp.logprob), "rank": lp.rank} for t, lp in top
                ],
            }
        )
    return {"content": content}


class ServingTokens(OpenAIServing):
    async def generate(self, request: GenerateRequest, raw_request=None):
        lora = self.models.resolve(request.model)
        if request.output_mode == "text" and not request.sampling_params.detokenize:
            raise OpenAIError('output_mode "text" needs detokenize.', 400, "output_mode")
        params = request.sampling_params.build(request.stream)
        if request.output_mode == "tokens":
            params.detokenize = False
        request_id = engine_request_id(request.request_id or uuid.uuid4().hex)
        prompt = {"prompt_token_ids": request.token_ids}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        prepared = [await self.off_loop(self.prepare, request_id, prompt, params, lora, False)]
        trace = self.trace_headers(raw_request)
        run = (request, request_id, prepared, trace)
        if request.stream:
            return SSEResponse(sse_events(self._chunks(run)))
        return await self._full(run)

    def _choice(self, request, c) -> dict:
        choice = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids),
            "routed_experts": npy_base64(c.routed_experts),
            "logprobs": token_logprobs(c) if c.logprobs is not None else None,
        }
        if request.output_mode == "text":
            choice["text"] = c.text
        return choice

    def _body(self, request, request_id) -> dict:
        return {
            "request_id": request_id,
            "model": self.served_name(request),
            "created": self.created(),
            "output_mode": request.output_mode,
        }

    async def _full(self, run) -> dict:
        request, request_id, prepared, trace = run
        final = None
        async for _, out in self.run_all(request_id, prepared, request.priority, trace):
            final = out
        body = self._body(request, request_id)
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        body.update(
            choices=[self._choice(request, c) for c in final.outputs],
            usage=usage(len(final.prompt_token_ids), num_generated),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
        )
        if request.return_token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        return body

    async def _chunks(self, run):
        request, request_id, prepared, trace = run
        include_usage, continuous = usage_options(request)
        num_prompt = len(prepared[0][0].prompt_token_ids)
        generated, first = 0, True
        async for _, out in self.run_all(request_id, prepared, request.priority, trace):
            for c in out.outputs:
                generated += len(c.token_ids)
                if not (c.token_ids or c.finish_reason):
                    continue
                chunk = self._body(request, request_id)
                chunk["choices"] = [self._choice(request, c)]
                chunk["usage"] = usage(num_prompt, generated) if continuous else None
                if first and request.return_token_ids:
                    chunk["prompt_token_ids"] = list(out.prompt_token_ids)
                first = False
                yield chunk
        if include_usage:
            yield {
                **self._body(request, request_id),
                "choices": [],
                "usage": usage(num_prompt, generated),
            }


def attach_token_routes(
    app: FastAPI, serving: ServingTokens, enabled: bool, cancellable, check_priority
) -> None:
    """`/inference/v1/generate` and `/inference/v1/abort_requests`; 403 unless `enabled`."""

    def check() -> None:
        if not enabled:
            raise OpenAIError(DISABLED, 403)

    @app.post("/inference/v1/generate", include_in_schema=enabled)
    async def generate(body: GenerateRequest, raw: Request):
        check()
        check_priority(body)
        if body.stream:
            return await serving.generate(body, raw)
        return await cancellable(raw, serving.generate(body, raw))

    @app.post("/inference/v1/abort_requests", include_in_schema=enabled)
    async def abort_requests(body: AbortRequests):
        check()
        for rid in body.request_ids:
            serving.engine.abort(f"{engine_request_id(rid)}-0")  # run_all's one prompt
        return {}

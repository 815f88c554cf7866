"""The pooling routes' handlers: each input becomes one engine request run concurrently;
outputs come back in the inputs' order with vLLM's bodies and usage. The response's id is the
client's (X-Request-Id, else the body's request_id) or a fresh one; the engine's ids add a
random suffix, as vLLM's do, so two requests carrying the same id run side by side."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import ml_dtypes
import numpy as np
from fastapi import FastAPI, Request

from jllm.entrypoints.openai.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from jllm.entrypoints.openai.protocol import TokenizeRequest
from jllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing
from jllm.pooling.prompts import truncated_prompt
from jllm.pooling.scoring import pair_scores, score_pairs, score_prompts, scoring_spec
from jllm.pooling_params import PoolingParams

# embed_dtype -> the numpy dtype whose bytes base64 carries (vLLM's tensor2binary).
DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}


def encode_vector(data: np.ndarray, request) -> list[float] | str:
    """A vector as the request's `encoding_format` asks: floats, or base64 of its bytes in
    `embed_dtype` and `endianness` (native: this machine's)."""
    if request.encoding_format == "float":
        return np.asarray(data, np.float32).tolist()
    array = np.asarray(data, np.float32).astype(DTYPES[request.embed_dtype])
    if request.endianness != "native" and array.dtype.itemsize > 1:
        want = "<" if request.endianness == "little" else ">"
        array = array.astype(array.dtype.newbyteorder(want))
    return base64.b64encode(array.tobytes()).decode()


def usage(outs) -> dict:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


class ServingPooling(OpenAIServing):
    """Embeddings, classification, pooling, scores and reranking over a pooling model."""

    def __init__(self, engine, chat, **common) -> None:
        super().__init__(engine, **common)
        self.chat = chat  # renders `messages` inputs with the chat template
        self.spec = engine.engine.pooling

    # ---- the shared path -------------------------------------------------------------
    def _id(self, raw: Request, request, prefix: str) -> str:
        given = raw.headers.get("X-Request-Id") or request.request_id
        return f"{prefix}-{given or uuid.uuid4().hex}"

    async def _prompts(self, request) -> list:
        """The request's inputs as prompts: texts, token-id lists, or its chat messages
        rendered."""
        if getattr(request, "messages", None) is not None:
            if request.input is not None:
                raise OpenAIError("Give input or messages, not both.", 400, "messages")
            body = TokenizeRequest.model_construct(
                model=request.model,
                messages=request.messages,
                add_special_tokens=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                tools=None,
            )
            prompts = [{"prompt_token_ids": await self.chat.prompt_ids(body)}]
        else:
            value = request.input
            if value is None or value == []:
                raise OpenAIError("You must pass at least one prompt", 400, "input")
            if isinstance(value, str) or isinstance(value[0], int):
                value = [value]
            prompts = [v if isinstance(v, str) else {"prompt_token_ids": list(v)} for v in value]
        return prompts

    def _truncate(self, prompt, request) -> dict:
        def tokenize(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

        n, limit = request.truncate_prompt_tokens, self.engine.max_model_len
        try:
            return truncated_prompt(prompt, n, limit, tokenize, request.truncation_side)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "truncate_prompt_tokens") from e

    def _params(self, params: PoolingParams, task: str, api: str) -> PoolingParams:
        try:
            return self.engine.engine.pooling_params(params, task, api)
        except ValueError as e:
            raise OpenAIError(str(e), 400) from e

    async def _run(self, raw, request, rid: str, prompts: list, params: PoolingParams) -> list:
        """Every prompt, cut to `truncate_prompt_tokens` when set, through the engine (all
        refused before any runs); their final outputs in order."""
        lora = self.models.resolve(request.model)
        if request.truncate_prompt_tokens is not None:
            prompts = [await self.off_loop(self._truncate, p, request) for p in prompts]
        if request.cache_salt is not None:
            prompts = [
                {"prompt": p, "cache_salt": request.cache_salt}
                if isinstance(p, str)
                else {**p, "cache_salt": request.cache_salt}
                for p in prompts
            ]
        prepared = []
        for p in prompts:
            try:
                prepared.append(
                    await self.off_loop(
                        self.engine.prepare, p, params, lora, request.add_special_tokens
                    )
                )
            except ValueError as e:
                raise OpenAIError(str(e), 400) from e
        headers = self.trace_headers(raw)
        suffix = uuid.uuid4().hex[:8]  # the client's id need not be unique among running ones

        async def one(i: int, item):
            last = None
            async for out in self.engine.generate(
                None, None, f"{rid}-{i}-{suffix}", item, request.priority, headers
            ):
                last = out
            if last.error is not None:
                raise OpenAIError(f"The request failed: {last.error}", 500)
            return last

        tasks = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(prepared)]
        try:
            return await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others stop too, their engine
            for task in tasks:  # requests aborted as their streams close
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _head(self, rid: str, request) -> dict:
        return {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": self.served_name(request),
        }

    # ---- the routes --------------------------------------------------------------------
    async def embeddings(self, request: EmbeddingRequest, raw: Request) -> dict:
        params = self._params(
            PoolingParams(use_activation=request.use_activation, dimensions=request.dimensions),
            "embed",
            "Embeddings API",
        )
        rid = self._id(raw, request, "embd")
        outs = await self._run(raw, request, rid, await self._prompts(request), params)
        data = [
            {"index": i, "object": "embedding", "embedding": encode_vector(o.outputs.data, request)}
            for i, o in enumerate(outs)
        ]
        return {**self._head(rid, request), "data": data, "usage": usage(outs)}

    async def classify(self, request: ClassificationRequest, raw: Request) -> dict:
        params = self._params(
            PoolingParams(use_activation=request.use_activation), "classify", "Classification API"
        )
        rid = self._id(raw, request, "classify")
        outs = await self._run(raw, request, rid, await self._prompts(request), params)
        labels = self.spec.id2label or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            data.append(
                {
                    "index": i,
                    "label": labels.get(int(np.argmax(probs))),
                    "probs": probs.tolist(),
                    "num_classes": len(probs),
                }
            )
        return {**self._head(rid, request), "data": data, "usage": usage(outs)}

    async def pooling(self, request: PoolingRequest, raw: Request) -> dict:
        task = request.task or self.spec.task
        if request.dimensions is not None:
            raise OpenAIError("dimensions is currently not supported", 400, "dimensions")
        if task not in self.spec.supported_tasks:
            raise OpenAIError(
                f"Unsupported task: {task!r}. Try switching the model's pooling_task via "
                f"--pooler-config.task {task}.",
                400,
                "task",
            )
        params = self._params(
            PoolingParams(use_activation=request.use_activation), task, "Pooling API"
        )
        rid = self._id(raw, request, "pooling")
        outs = await self._run(raw, request, rid, await self._prompts(request), params)
        data = [
            {"index": i, "object": "pooling", "data": encode_vector(o.outputs.data, request)}
            for i, o in enumerate(outs)
        ]
        return {**self._head(rid, request), "data": data, "usage": usage(outs)}

    async def _scores(self, raw, request, queries, docs, rid) -> tuple[list[float], list]:
        """One score per (query, document) pair and the outputs whose prompts they counted."""
        try:
            spec = scoring_spec(self.spec, "Scoring API")
            queries, docs = score_pairs(queries, docs)
        except ValueError as e:
            raise OpenAIError(str(e), 400) from e
        if request.max_tokens_per_query or request.max_tokens_per_doc:
            raise OpenAIError(
                "max_tokens_per_query and max_tokens_per_doc are not supported by jllm yet.", 400
            )
        params = self._params(
            PoolingParams(use_activation=request.use_activation), spec.task, "Scoring API"
        )
        prompts = score_prompts(spec, queries, docs, self.tokenizer)
        outs = await self._run(raw, request, rid, prompts, params)
        return [score for score, _ in pair_scores(spec, queries, outs)], outs

    async def score(self, request: ScoreRequest, raw: Request) -> dict:
        try:
            queries, docs = request.sides()
        except ValueError as e:
            raise OpenAIError(str(e), 400) from e
        rid = self._id(raw, request, "score")
        scores, outs = await self._scores(raw, request, queries, docs, rid)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {**self._head(rid, request), "data": data, "usage": usage(outs)}

    async def rerank(self, request: RerankRequest, raw: Request) -> dict:
        rid = self._id(raw, request, "score")
        scores, outs = await self._scores(raw, request, request.query, request.documents, rid)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if 0 < request.top_n < len(order):
            order = order[: request.top_n]
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "id": rid,
            "model": self.served_name(request),
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "results": [
                {
                    "index": i,
                    "document": {"text": request.documents[i], "multi_modal": None},
                    "relevance_score": scores[i],
                }
                for i in order
            ],
        }


def attach_pooling_routes(app: FastAPI, serving: ServingPooling, with_cancellation, check) -> None:
    """vLLM's mounting: /pooling always; /v1/embeddings for an embedding model, /classify for
    a classifier; the score and rerank routes where the model scores. `check(body)`: the
    server's refusals before any work (a priority the scheduler would ignore)."""
    spec = serving.spec

    def run(body, raw, work):
        check(body)
        return with_cancellation(raw, work(body, raw))

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw: Request):
        return await run(body, raw, serving.pooling)

    if "embed" in spec.supported_tasks:

        @app.post("/v1/embeddings")
        async def create_embedding(body: EmbeddingRequest, raw: Request):
            return await run(body, raw, serving.embeddings)

    if "classify" in spec.supported_tasks:

        @app.post("/classify")
        async def create_classify(body: ClassificationRequest, raw: Request):
            return await run(body, raw, serving.classify)

    if not spec.enable_scoring:
        return

    async def create_score(body: ScoreRequest, raw: Request):
        return await run(body, raw, serving.score)

    async def do_rerank(body: RerankRequest, raw: Request):
        return await run(body, raw, serving.rerank)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, create_score, methods=["POST"], name=f"score{path}")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, do_rerank, methods=["POST"], name=f"rerank{path}")

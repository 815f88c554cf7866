"""`POST /v1/completions`: prompts as text or token ids, one engine request per prompt,
`n` choices each (choice index = prompt index * n + sequence index), streamed or not."""

from __future__ import annotations

import uuid

from jllm.engine.processor import PROMPT_EMBEDS_OFF
from jllm.entrypoints.openai.protocol import CompletionRequest
from jllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    SSEResponse,
    check_beam_search,
    clamp,
    prompt_logprobs_json,
    sse,
    usage,
    usage_options,
)
from jllm.entrypoints.prompt_embeds import load_prompt_embeds
from jllm.outputs import CompletionOutput


def normalize_prompts(prompt, cache_salt: str | None = None) -> list[dict]:
    """str | list[str] | list[int] | list[list[int]] -> engine prompt dicts."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    if isinstance(prompt, str):
        return [{"prompt": prompt, **salt}]
    if not prompt:
        raise OpenAIError("prompt cannot be empty.", 400, "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt, **salt}]
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p, **salt} for p in prompt]
    return [{"prompt_token_ids": p, **salt} for p in prompt]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request=None):
        lora = self.check_request(request)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported by jllm yet.", 400, "suffix")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        try:
            params = request.sampling_params(
                request.max_tokens, request.logprobs, self.engine.default_sampling_params
            )
            if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
                params.prompt_logprobs = request.logprobs  # the echoed tokens' logprobs
        except ValueError as e:
            raise OpenAIError(str(e), 400, getattr(e, "param", None)) from e
        if request.use_beam_search:
            check_beam_search(params)
        prompts = await self._prompts(request, params)
        prepared = [
            await self.off_loop(self.prepare, f"{request_id}-{i}", p, params, lora)
            for i, p in enumerate(prompts)
        ]
        if request.use_beam_search:
            return await self._beam_search(request, request_id, prepared, params)
        trace = self.trace_headers(raw_request)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prepared, trace))
        return await self._full(request, request_id, prepared, trace)

    async def _prompts(self, request: CompletionRequest, params) -> list[dict]:
        """The request's prompts: its `prompt_embeds` first (vLLM's order), then `prompt`'s."""
        embeds = request.prompt_embeds
        embeds = [] if embeds is None else [embeds] if isinstance(embeds, str) else embeds
        if not embeds and request.prompt is None:
            raise OpenAIError(
                "Either prompt or prompt_embeds must be provided and non-empty.", 400, "prompt"
            )
        prompts = []
        if embeds:
            if not self.engine.engine.args.enable_prompt_embeds:
                raise OpenAIError(PROMPT_EMBEDS_OFF, 400, "prompt_embeds")
            if request.echo:
                raise OpenAIError("Echo is unsupported with prompt embeds.", 400, "echo")
            if params.prompt_logprobs is not None:
                raise OpenAIError(
                    "prompt_logprobs is not compatible with prompt embeds.", 400, "prompt_logprobs"
                )
            for data in embeds:
                try:
                    rows = await self.off_loop(load_prompt_embeds, data)
                except ValueError as e:
                    raise OpenAIError(str(e), 400, "prompt_embeds") from e
                salt = {} if request.cache_salt is None else {"cache_salt": request.cache_salt}
                prompts.append({"prompt_embeds": rows, **salt})
        if request.prompt is not None:
            prompts += normalize_prompts(request.prompt, request.cache_salt)
        return prompts

    async def _beam_search(self, request, request_id, prepared, params) -> dict:
        """`use_beam_search`: the best `n` beams per prompt, as vLLM's server returns them."""
        if request.echo:
            raise OpenAIError("echo is not supported with beam search.", 400, "echo")
        choices, num_generated = [], 0
        for i, item in enumerate(prepared):
            beams = await self.beam_search(f"{request_id}-{i}", item, request, params)
            for j, (beam, tokens, text) in enumerate(beams):
                num_generated += len(tokens)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(tokens, beam.logprobs, request.logprobs, 0)
                choices.append(
                    {
                        "index": i * request.n + j,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": beam.finish_reason,
                        "stop_reason": beam.stop_reason,
                    }
                )
        return self._response(request, request_id, prepared, choices, num_generated)

    def _echo(self, prepared) -> str:
        processed = prepared[0]
        if processed.prompt is not None:
            return processed.prompt
        return self.tokenizer.decode(processed.prompt_token_ids) if self.tokenizer else ""

    def _logprobs(self, token_ids, entries, k: int, offset: int) -> dict:
        """OpenAI's legacy completion logprobs for `token_ids` with their logprob entries
        (None for the prompt's first token: null logprob and top_logprobs, as vLLM)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries, strict=True):
            if entry is None:
                text = self.tokenizer.decode([tid]) if self.tokenizer else ""
                tokens.append(text)
                token_logprobs.append(None)
                top.append(None)
                offsets.append(offset)
                offset += len(text)
                continue
            sampled = entry[tid]
            text = sampled.decoded_token or ""
            tokens.append(text)
            token_logprobs.append(clamp(sampled.logprob))
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            top.append(
                {
                    (lp.decoded_token or ""): clamp(lp.logprob)
                    for t, lp in ranked
                    if t == tid or (lp.rank or 0) <= k
                }
            )
            offsets.append(offset)
            offset += len(text)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top,
        }

    def _choice_logprobs(self, request, out, c: CompletionOutput, offset: int) -> dict:
        """The output's logprobs; with echo, the prompt's first (from its prompt logprobs)."""
        got = self._logprobs(c.token_ids, c.logprobs, request.logprobs, offset)
        if not request.echo or out.prompt_logprobs is None:
            return got
        echoed = self._logprobs(out.prompt_token_ids, out.prompt_logprobs, request.logprobs, 0)
        # The output's offsets follow the echoed prompt text.
        return {key: echoed[key] + got[key] for key in got}

    async def _full(self, request, request_id, prepared, trace=None) -> dict:
        n = request.n
        finals = {}
        async for i, out in self.run_all(request_id, prepared, request.priority, trace):
            finals[i] = out
        choices = []
        num_generated = 0
        for i in range(len(prepared)):
            out = finals[i]
            prefix = self._echo(prepared[i]) if request.echo else ""
            for c in out.outputs:
                num_generated += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._choice_logprobs(request, out, c, len(prefix))
                choice = {
                    "index": i * n + c.index,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
                }
                if request.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        cached = self.cached(finals.values())
        return self._response(request, request_id, prepared, choices, num_generated, cached)

    def _response(
        self, request, request_id, prepared, choices, num_generated: int, cached=None
    ) -> dict:
        num_prompt = sum(len(p[0].prompt_token_ids) for p in prepared)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": self.created(),
            "model": self.served_name(request),
            "choices": choices,
            "usage": usage(num_prompt, num_generated, cached_tokens=cached),
        }

    async def _stream(self, request, request_id, prepared, trace=None):
        n = request.n
        created = self.created()
        include_usage, continuous = usage_options(request)
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        generated: dict[int, int] = {}  # tokens so far, per choice
        sent_ids: set[int] = set()  # choices whose prompt token ids went out
        last = {}  # each prompt's latest output
        async for i, out in self.run_all(request_id, prepared, request.priority, trace):
            last[i] = out
            for c in out.outputs:
                index = i * n + c.index
                text = c.text
                first = request.echo and index not in echoed
                if first:
                    echoed.add(index)
                    text = self._echo(prepared[i]) + text
                generated[index] = generated.get(index, 0) + len(c.token_ids)
                if not (text or c.token_ids or c.finish_reason):
                    continue
                logprobs = None
                if request.logprobs is not None:
                    start = offsets.get(index, 0)
                    if first:
                        logprobs = self._choice_logprobs(
                            request, out, c, len(self._echo(prepared[i]))
                        )
                    else:
                        logprobs = self._logprobs(c.token_ids, c.logprobs, request.logprobs, start)
                    offsets[index] = logprobs["text_offset"][-1] if logprobs["tokens"] else start
                    if logprobs["tokens"]:
                        offsets[index] += len(logprobs["tokens"][-1])
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if request.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                    if index not in sent_ids:  # the prompt's ids once, with the first chunk
                        sent_ids.add(index)
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                chunk = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.served_name(request),
                    "choices": [choice],
                }
                if include_usage:
                    chunk["usage"] = (
                        usage(len(prepared[i][0].prompt_token_ids), generated[index])
                        if continuous
                        else None
                    )
                yield sse(chunk)
        if include_usage:
            num_prompt = sum(len(p[0].prompt_token_ids) for p in prepared)
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.served_name(request),
                    "choices": [],
                    "usage": usage(
                        num_prompt,
                        sum(generated.values()),
                        cached_tokens=self.cached(last.values()),
                    ),
                }
            )

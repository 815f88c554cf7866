"""`POST /v1/chat/completions`: messages through the chat template (the model's, the
server's `--chat-template`, or the request's), `n` choices, streamed (the role first, then
content deltas, then `[DONE]`) or not, with OpenAI's chat logprobs."""

from __future__ import annotations

import uuid

from jllm.entrypoints.openai.protocol import ChatCompletionRequest
from jllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    SSEResponse,
    clamp,
    off_loop,
    prompt_logprobs_json,
    sse,
    usage,
    usage_options,
)
from jllm.outputs import CompletionOutput


def message_text(content) -> str:
    """OpenAI content (a string or a list of parts) as the text the template sees; text
    parts are joined by newlines as vLLM's "string" content format does."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                f"Message content of type {kind!r} is not supported.", 400, "messages"
            )
        texts.append(part.get("text", ""))
    return "\n".join(texts)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, *args, chat_template: str | None = None, response_role: str = "assistant", **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.response_role = response_role

    def render(self, request) -> tuple[str, list[int]]:
        """Apply the chat template; returns the prompt text and its token ids."""
        if self.tokenizer is None:
            raise OpenAIError("Chat needs a tokenizer; the server runs without one.", 400)
        messages = []
        for m in request.messages:
            if not isinstance(m, dict) or "role" not in m:
                raise OpenAIError("Each message needs a 'role'.", 400, "messages")
            messages.append({**m, "content": message_text(m.get("content"))})
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template or self.chat_template,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"Could not apply the chat template: {e}", 400, "messages") from e
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_request(request)
        if request.tools and request.tool_choice != "none":
            raise OpenAIError("tools are not supported by jllm yet.", 400, "tools")
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(
                "top_logprobs can only be used when logprobs is true.", 400, "top_logprobs"
            )
        if not request.messages:
            raise OpenAIError("messages cannot be empty.", 400, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        text, ids = await off_loop(self.render, request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens or request.max_tokens
        try:
            params = request.sampling_params(
                max_tokens, logprobs, self.engine.default_sampling_params
            )
        except ValueError as e:
            raise OpenAIError(str(e), 400, getattr(e, "param", None)) from e
        prompt = {"prompt_token_ids": ids, "prompt": text}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        prepared = [await off_loop(self.prepare, request_id, prompt, params)]
        role = (
            self.response_role
            if request.add_generation_prompt
            else request.messages[-1].get("role", self.response_role)
        )
        if request.use_beam_search:
            return await self._beam_search(request, request_id, prepared[0], params, role)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prepared, role))
        return await self._full(request, request_id, prepared, role)

    async def _beam_search(self, request, request_id, item, params, role) -> dict:
        """`use_beam_search`: the best `n` beams as choices, as vLLM's server returns them."""
        beams = await self.beam_search(request_id, item, request, params)
        choices = [
            {
                "index": j,
                "message": {"role": role, "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": beam.finish_reason,
                "stop_reason": beam.stop_reason,
            }
            for j, (beam, _, text) in enumerate(beams)
        ]
        num_generated = sum(len(tokens) for _, tokens, _ in beams)
        return self._response(request_id, choices, item[0].prompt_token_ids, num_generated)

    def _echo(self, request, role: str) -> str:
        last = request.messages[-1]
        if request.echo and last.get("role") == role:
            return message_text(last.get("content"))
        return ""

    def _logprobs(self, c: CompletionOutput, k: int) -> dict:
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
            sampled = entry[tid]

            def item(lp):
                token = lp.decoded_token or ""
                return {
                    "token": token,
                    "logprob": clamp(lp.logprob),
                    "bytes": list(token.encode("utf-8")),
                }

            top = sorted(
                (lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                key=lambda lp: lp.rank,
            )
            content.append({**item(sampled), "top_logprobs": [item(lp) for lp in top]})
        return {"content": content}

    async def _full(self, request, request_id, prepared, role) -> dict:
        final = None
        async for _, out in self.run_all(request_id, prepared, request.priority):
            final = out
        prefix = self._echo(request, role)
        choices = []
        for c in final.outputs:
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": role, "content": prefix + c.text, "tool_calls": []},
                    "logprobs": (
                        self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None
                    ),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        response = self._response(request_id, choices, final.prompt_token_ids, num_generated)
        response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response

    def _response(self, request_id, choices, prompt_token_ids, num_generated: int) -> dict:
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": self.created(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(prompt_token_ids), num_generated),
        }

    async def _stream(self, request, request_id, prepared, role):
        created = self.created()
        include_usage, continuous = usage_options(request)
        num_prompt = len(prepared[0][0].prompt_token_ids)
        generated = [0] * request.n  # tokens so far, per choice

        def chunk(choices, **extra) -> str:
            body = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                # Continuous stats: each choice's chunk carries its own tokens so far.
                index = choices[0]["index"] if choices else None
                body["usage"] = (
                    usage(num_prompt, generated[index])
                    if continuous and index is not None
                    else None
                )
            body.update(extra)
            return sse(body)

        prefix = self._echo(request, role)
        for i in range(request.n):
            delta = {"role": role, "content": prefix}
            yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        async for _, out in self.run_all(request_id, prepared, request.priority):
            for c in out.outputs:
                generated[c.index] += len(c.token_ids)
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                logprobs = None
                if request.logprobs:
                    logprobs = self._logprobs(c, request.top_logprobs or 0)
                choice = {
                    "index": c.index,
                    "delta": {"content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage(num_prompt, sum(generated)))

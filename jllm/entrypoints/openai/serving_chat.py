"""`POST /v1/chat/completions`: messages through the chat template (the model's, the
server's `--chat-template`, or the request's), `n` choices, streamed (the role first, then
content deltas, then `[DONE]`) or not, with OpenAI's chat logprobs.

Tools (`jllm/entrypoints/openai/tool_parsers.py`): the request's tools go to the chat
template; `tool_choice="required"` and a named function are enforced by a JSON-schema
grammar, so their arguments always parse; `"auto"` (the default with tools) needs the
server's `--enable-auto-tool-choice --tool-call-parser NAME` and reads the calls from the
text with that parser. Streamed, a named function's arguments arrive as they are generated;
the other calls arrive whole, once the output has ended."""

from __future__ import annotations

import json
import uuid

from jllm.entrypoints.media import MediaConnector, chat_messages_with_images
from jllm.entrypoints.openai import harmony
from jllm.entrypoints.openai.chat_templates import check_request_template
from jllm.entrypoints.openai.protocol import ChatCompletionRequest
from jllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    SSEResponse,
    check_beam_search,
    clamp,
    prompt_logprobs_json,
    sse_events,
    usage,
    usage_options,
)
from jllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    check_tools,
    make_tool_call_id,
    named_schema,
    parse_required,
    required_schema,
)
from jllm.outputs import CompletionOutput
from jllm.reasoning import GptOssReasoningParser, ReasoningStream, make_reasoning_parser
from jllm.sampling_params import SamplingParams, StructuredOutputsParams


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


def _template_message(m: dict) -> dict:
    """A message as chat templates expect it: text content, and tool-call arguments as
    objects (OpenAI sends them as JSON strings), as vLLM passes them."""
    content = m.get("content")
    with_images = isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in content
    )  # parts with image placeholders (media.chat_messages_with_images) stay parts
    out = {**m, "content": content if with_images else message_text(content)}
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = []
        for call in calls:
            if not isinstance(call, dict):
                raise OpenAIError("Each tool call in a message must be an object.", 400, "messages")
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise OpenAIError(
                        "A tool call's arguments are not JSON.", 400, "messages"
                    ) from None
            out["tool_calls"].append({**call, "function": fn})
    return out


class ToolMode:
    """How one request's output becomes a message: plain content, or tool calls by
    `choice` ("auto" with a parser, "required", or a function's name)."""

    def __init__(self, choice: str, tools, parser, parallel: bool = True) -> None:
        self.choice, self.tools, self.parser = choice, tools, parser
        self.parallel = parallel  # parallel_tool_calls: false keeps one call

    @property
    def plain(self) -> bool:
        return self.choice == "none"  # check_tools gives "none" to a request without tools

    def schema(self) -> dict | None:
        if self.plain or self.choice == "auto":
            return None
        if self.choice == "required":
            return required_schema(self.tools, single=not self.parallel)
        return named_schema(self.tools, self.choice)

    def message(self, text: str, finish_reason):
        """(content, tool calls, finish reason) of a finished output. A named function's
        output is its arguments whatever ended it (as streamed); a required call's array
        only when it is complete, else the text is content with the engine's reason."""
        if self.plain:
            return text, [], finish_reason
        if self.choice == "auto":
            if finish_reason == "length":
                return text, [], finish_reason
            content, calls = self.parser.parse(text, self.tools)
            calls = calls if self.parallel else calls[:1]
            return content, calls, "tool_calls" if calls else finish_reason
        if self.choice == "required":
            calls = parse_required(text) if finish_reason == "stop" else []
            return ("", calls, "tool_calls") if calls else (text, [], finish_reason)
        return "", [ToolCall(self.choice, text)], finish_reason


class ChoiceStream:
    """One choice's stream: the delta of each output update and of its end."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # content characters sent (auto mode)
        self.call_id = None  # a named function's call, once started

    def update(self, text: str) -> dict | None:
        mode = self.mode
        if mode.plain:
            return {"content": text}
        self.text += text
        if mode.choice == "auto":
            start = mode.parser.stream_start(self.text)
            end = len(self.text) if start is None else start
            if end <= self.sent:
                return None
            delta, self.sent = {"content": self.text[self.sent : end]}, end
            return delta
        if mode.choice == "required" or not text:
            return None
        return self._named_delta(text)

    def _named_delta(self, text: str) -> dict:
        call = {"index": 0, "function": {"arguments": text}}
        if self.call_id is None:
            self.call_id = make_tool_call_id()
            call.update(id=self.call_id, type="function")
            call["function"] = {"name": self.mode.choice, "arguments": text}
        return {"tool_calls": [call]}

    def finish(self, finish_reason) -> tuple[dict | None, str | None]:
        mode = self.mode
        if mode.plain:
            return None, finish_reason
        if mode.choice not in ("auto", "required"):
            if self.call_id is None:  # nothing generated: an empty call
                return self._named_delta(""), finish_reason
            return None, finish_reason
        content, calls, reason = mode.message(self.text, finish_reason)
        delta = {}
        if mode.choice == "auto" and content and len(content) > self.sent:
            delta["content"] = content[self.sent :]
        elif not calls and len(self.text) > self.sent:
            delta["content"] = self.text[self.sent :]
        if calls:
            delta["tool_calls"] = [{"index": j, **c.json()} for j, c in enumerate(calls)]
        return delta or None, reason


def merge_deltas(first: dict | None, second: dict | None) -> dict | None:
    """Two deltas of one chunk as one: their content joined."""
    if not first or not second:
        return first or second
    out = {**first, **second}
    if "content" in first and "content" in second:
        out["content"] = first["content"] + second["content"]
    return out


class Reasoning:
    """One request's reasoning split (`--reasoning-parser`): the parser, whether the prompt
    already ended the reasoning, and whether the response shows it (`include_reasoning`)."""

    def __init__(self, parser, prompt_token_ids, include: bool) -> None:
        self.parser, self.include = parser, include
        self.prompt = prompt_token_ids
        self.ended = parser is not None and parser.ended_in(prompt_token_ids)

    def split(self, text: str) -> tuple[str | None, str]:
        if self.parser is None:
            return None, text
        reasoning, content = self.parser.split(text, self.ended)
        return (reasoning if self.include else None), content or ""

    def stream(self) -> ReasoningStream | None:
        return None if self.parser is None else ReasoningStream(self.parser, self.ended)

    def tokens(self, token_ids) -> int | None:
        """usage's reasoning_tokens (None without a parser: no details, as vLLM)."""
        if self.parser is None:
            return None
        return self.parser.count_reasoning_tokens(token_ids, self.prompt)


class ChatRun:
    """A validated chat request ready to run: its id, prepared prompt, output role, tool
    mode, reasoning split and trace headers; `harmony`: (reasoning, tool calls, whether a call
    finishes with "tool_calls") read from a gpt-oss output's channels, or None."""

    def __init__(self, request, request_id, prepared, role, mode, reasoning, trace) -> None:
        self.request, self.request_id, self.prepared = request, request_id, prepared
        self.role, self.mode, self.reasoning, self.trace = role, mode, reasoning, trace
        self.cached_tokens = 0  # prompt tokens read from the prefix cache, once known
        self.harmony: tuple[bool, bool, bool] | None = None

    def harmony_choice(self) -> harmony.HarmonyChoice:
        reasoning, tools, calls_finish = self.harmony
        return harmony.HarmonyChoice(reasoning, tools, self.request.include_reasoning, calls_finish)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        *args,
        chat_template: str | None = None,
        response_role: str = "assistant",
        tool_parser: str | None = None,
        trust_request_chat_template: bool = False,
        reasoning_parser: str | None = None,
        **kwargs,
    ) -> None:
        """`tool_parser`: the parser of tool_choice "auto" (the server's
        `--tool-call-parser` under `--enable-auto-tool-choice`); None: "auto" is refused.
        `trust_request_chat_template`: render a request's own `chat_template` (the server's
        `--trust-request-chat-template`); otherwise such a request is refused.
        `reasoning_parser`: `--reasoning-parser` (jllm/reasoning): messages carry the
        reasoning apart from the content."""
        super().__init__(*args, **kwargs)
        # gpt-oss speaks harmony: its prompts are harmony's, its channels parsed on the ids.
        self.harmony = harmony.uses_harmony(getattr(self.engine.engine, "hf_config", None))
        self.harmony_reasoning = reasoning_parser == GptOssReasoningParser.name
        self._check_harmony_parsers(reasoning_parser, tool_parser)
        # Built now (an unknown name or a vocabulary without the tags is refused at start),
        # then derived per request; tags the tokenizer calls special stay in the text.
        self.reasoner, self.reasoning_keeps_special = None, False
        if reasoning_parser and not self.harmony:
            self.reasoner = make_reasoning_parser(reasoning_parser, self.tokenizer)
            special = set(getattr(self.tokenizer, "all_special_tokens", ()))
            self.reasoning_keeps_special = bool(special.intersection(self.reasoner.markers()))
        args = self.engine.engine.args
        self.media = MediaConnector(
            args.allowed_local_media_path,
            args.allowed_media_domains,
            max_images=self.engine.engine.max_images_per_prompt,
        )
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.response_role = response_role
        self.tool_parser = None if tool_parser is None else TOOL_PARSERS[tool_parser]()
        if self.harmony and self.tokenizer is not None:
            harmony.encoding(self.tokenizer)  # o200k's vocabulary found (or written) now

    def _check_harmony_parsers(self, reasoning_parser, tool_parser) -> None:
        """vLLM's pairing: a gpt-oss model takes `openai_gptoss` and `openai` only, and
        those two parsers take a gpt-oss model only."""
        harmony_names = (GptOssReasoningParser.name, "openai")
        for flag, name in (
            ("--reasoning-parser", reasoning_parser),
            ("--tool-call-parser", tool_parser),
        ):
            if name is None:
                continue
            if self.harmony and name not in harmony_names:
                raise ValueError(
                    f"{flag} {name} cannot read gpt-oss's harmony format; use "
                    f"{'openai_gptoss' if flag == '--reasoning-parser' else 'openai'}."
                )
            if not self.harmony and name in harmony_names:
                raise ValueError(
                    f"{flag} {name} reads gpt-oss's harmony format: a gpt-oss model only."
                )

    def render(self, request) -> tuple[str, list[int], list]:
        """Apply the chat template; returns the prompt text, its token ids (None with
        images: the model's processor expands their placeholders) and the images."""
        if self.tokenizer is None:
            raise OpenAIError("Chat needs a tokenizer; the server runs without one.", 400)
        if self.harmony:
            ids = harmony.render_chat(request, self.tokenizer)
            return harmony.encoding().decode_utf8(ids), ids, []
        template_kwargs = check_request_template(
            request, self.tokenizer, self.trust_request_chat_template
        )
        try:
            with_parts, images = chat_messages_with_images(request.messages, self.media)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "messages") from e
        messages = [_template_message(m) for m in with_parts]
        tools = request.tools if request.tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template or self.chat_template,
                **template_kwargs,
            )
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"Could not apply the chat template: {e}", 400, "messages") from e
        if images:
            return text, None, images
        return text, self.tokenizer.encode(text, add_special_tokens=False), []

    async def prompt_ids(self, request) -> list[int]:
        """The token ids of a chat request's prompt: its rendered template, with each
        image's placeholder expanded by the model's processor."""
        text, ids, images = await self.off_loop(self.render, request)
        if not images:
            return ids
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        try:
            processed, _ = await self.off_loop(
                self.engine.prepare, prompt, SamplingParams(max_tokens=1), None, False
            )
        except ValueError as e:
            raise OpenAIError(str(e), 400, "messages") from e
        return processed.prompt_token_ids

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request=None):
        run = await self.start(request, raw_request)
        if request.use_beam_search:
            return await self._beam_search(request, run.request_id, run.prepared[0], run.role)
        if request.stream:
            return SSEResponse(sse_events(self.chunks(run)))
        return await self.full(run)

    async def start(self, request: ChatCompletionRequest, raw_request=None, prefix="chatcmpl"):
        """Validate, render and prepare a chat request (every refusal is raised here, before
        anything runs): the `ChatRun` that `full` or `chunks` runs."""
        lora = self.check_request(request)
        mode = self.tool_mode(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(
                "top_logprobs can only be used when logprobs is true.", 400, "top_logprobs"
            )
        if not request.messages:
            raise OpenAIError("messages cannot be empty.", 400, "messages")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        text, ids, images = await self.off_loop(self.render, request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens or request.max_tokens
        try:
            params = request.sampling_params(
                max_tokens, logprobs, self.engine.default_sampling_params
            )
        except ValueError as e:
            raise OpenAIError(str(e), 400, getattr(e, "param", None)) from e
        schema = mode.schema()
        if schema is not None:
            if params.structured_outputs is not None:
                raise OpenAIError(
                    f"tool_choice {request.tool_choice!r} cannot be combined with another "
                    "structured outputs constraint.",
                    400,
                    "tool_choice",
                )
            params.structured_outputs = StructuredOutputsParams(json=schema)
        if self.harmony:  # the constraint goes into its harmony channel, after free analysis
            forced = mode.choice if schema is not None else "none"
            structured = None if schema is not None else params.structured_outputs
            params.structured_outputs = harmony.grammar(structured, request.tools, forced)
        if mode.choice == "auto" and not mode.plain and not self.tool_parser.skip_special_tokens:
            params.skip_special_tokens = False
        parser = self._reasoning_parser(request, params)
        prompt = {"prompt_token_ids": ids, "prompt": text}
        if images:
            prompt = {"prompt": text, "multi_modal_data": {"image": images}}
            if request.mm_processor_kwargs is not None:
                prompt["mm_processor_kwargs"] = request.mm_processor_kwargs
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        prepared = [await self.off_loop(self.prepare, request_id, prompt, params, lora, False)]
        role = (
            self.response_role
            if request.add_generation_prompt
            else request.messages[-1].get("role", self.response_role)
        )
        if request.use_beam_search:
            check_beam_search(params)
        prompt_ids = prepared[0][0].prompt_token_ids
        reasoning = Reasoning(parser, prompt_ids, request.include_reasoning)
        trace = self.trace_headers(raw_request)
        run = ChatRun(request, request_id, prepared, role, mode, reasoning, trace)
        forced = mode.choice not in ("auto", "none")  # "required" or a function's name
        if self.harmony and (self.harmony_reasoning or self.tool_parser is not None or forced):
            calls_finish = mode.choice in ("auto", "required")
            run.harmony = (self.harmony_reasoning, not mode.plain, calls_finish)
        return run

    def _reasoning_parser(self, request, params):
        """The request's reasoning parser (its chat_template_kwargs may turn thinking off)."""
        if self.reasoner is None:
            return None
        if self.reasoning_keeps_special:
            params.skip_special_tokens = False
        return self.reasoner.for_request(request.template_kwargs())

    def tool_mode(self, request) -> ToolMode:
        choice = check_tools(request.tools, request.tool_choice)
        if choice == "auto" and self.tool_parser is None:
            raise OpenAIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                400,
                "tool_choice",
            )
        parallel = request.parallel_tool_calls is not False
        return ToolMode(choice, request.tools, self.tool_parser, parallel)

    async def _beam_search(self, request, request_id, item, role) -> dict:
        """`use_beam_search`: the best `n` beams as choices, as vLLM's server returns them."""
        beams = await self.beam_search(request_id, item, request, item[1])
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
        num_prompt = len(item[0].prompt_token_ids)
        return self._response(request, request_id, choices, usage(num_prompt, num_generated))

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

    async def full(self, run: ChatRun) -> dict:
        """The whole response of a started request (`start`)."""
        request, mode, reasoning = run.request, run.mode, run.reasoning
        final = None
        async for _, out in self.run_all(run.request_id, run.prepared, request.priority, run.trace):
            final = out
        run.cached_tokens = final.num_cached_tokens or 0
        prefix = self._echo(request, run.role)
        choices = []
        for c in final.outputs:
            if run.harmony is not None:
                thought, content, calls, reason = run.harmony_choice().message(
                    c.token_ids, c.finish_reason
                )
                calls = calls if mode.parallel else calls[:1]
            else:
                thought, text = reasoning.split(c.text)
                content, calls, reason = mode.message(text, c.finish_reason)
            if content is not None:
                content = prefix + content
            message = {
                "role": run.role,
                "content": content,
                "tool_calls": [t.json() for t in calls],
            }
            if reasoning.parser is not None or self.harmony_reasoning:
                message["reasoning"] = thought
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": (
                    self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None
                ),
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            if request.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        thinking = None
        if reasoning.parser is not None or self.harmony_reasoning:
            thinking = sum(self._reasoning_tokens(run, c.token_ids) for c in final.outputs)
        response = self._response(
            request,
            run.request_id,
            choices,
            usage(len(final.prompt_token_ids), num_generated, thinking, self.cached([final])),
        )
        response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        if request.return_token_ids:
            response["prompt_token_ids"] = list(final.prompt_token_ids)
        return response

    def _reasoning_tokens(self, run: ChatRun, token_ids) -> int | None:
        if self.harmony_reasoning:
            return harmony.HarmonyChoice.reasoning_tokens(token_ids)
        return run.reasoning.tokens(token_ids)

    def _response(self, request, request_id, choices, usage_: dict) -> dict:
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": self.created(),
            "model": self.served_name(request),
            "choices": choices,
            "usage": usage_,
        }

    @staticmethod
    def _harmony_delta(choice, c, mode) -> tuple[dict | None, str | None]:
        """A harmony output's delta and finish reason for one update (`parallel_tool_calls`
        false keeps the first call)."""
        if c.finish_reason is None:
            delta, reason = choice.update(c.token_ids), None
        else:
            delta, reason = choice.finish(c.token_ids, c.finish_reason)
        if delta and not mode.parallel and "tool_calls" in delta:
            calls = [t for t in delta["tool_calls"] if t["index"] == 0]
            delta = {k: v for k, v in delta.items() if k != "tool_calls"}
            if calls:
                delta["tool_calls"] = calls
            delta = delta or None
        return delta, reason

    async def chunks(self, run: ChatRun):
        """The chunks (dicts) of a started request's stream (`start`): per choice its role,
        then reasoning, content and tool-call deltas, its finish; the usage last if asked."""
        request, mode, reasoning = run.request, run.mode, run.reasoning
        created = self.created()
        include_usage, continuous = usage_options(request)
        num_prompt = len(run.prepared[0][0].prompt_token_ids)
        generated = [0] * request.n  # tokens so far, per choice
        token_ids = [[] for _ in range(request.n)]  # with a reasoning parser: its count
        counting = reasoning.parser is not None or self.harmony_reasoning

        def usage_of(index=None) -> dict:
            ids = token_ids if index is None else [token_ids[index]]
            thinking = None
            if counting:
                thinking = sum(self._reasoning_tokens(run, t) for t in ids)
            done = sum(generated) if index is None else generated[index]
            cached = run.cached_tokens if self.prompt_tokens_details else None
            return usage(num_prompt, done, thinking, cached)

        def chunk(choices, **extra) -> dict:
            body = {
                "id": run.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.served_name(request),
                "choices": choices,
            }
            if include_usage:
                # Continuous stats: each choice's chunk carries its own tokens so far.
                index = choices[0]["index"] if choices else None
                body["usage"] = usage_of(index) if continuous and index is not None else None
            body.update(extra)
            return body

        prefix = self._echo(request, run.role)
        streams = [ChoiceStream(mode) for _ in range(request.n)]
        thoughts = [reasoning.stream() for _ in range(request.n)]
        channels = [run.harmony_choice() if run.harmony else None for _ in range(request.n)]
        for i in range(request.n):
            delta = {"role": run.role, "content": prefix}
            first = [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
            if request.return_token_ids:
                yield chunk(first, prompt_token_ids=list(run.prepared[0][0].prompt_token_ids))
            else:
                yield chunk(first)
        async for _, out in self.run_all(run.request_id, run.prepared, request.priority, run.trace):
            run.cached_tokens = out.num_cached_tokens or 0
            for c in out.outputs:
                generated[c.index] += len(c.token_ids)
                if counting:
                    token_ids[c.index] += c.token_ids
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                stream, thought = streams[c.index], None
                if channels[c.index] is not None:
                    delta, reason = self._harmony_delta(channels[c.index], c, mode)
                else:
                    text = c.text
                    if thoughts[c.index] is not None:
                        thought, text = thoughts[c.index].update(c.text)
                        if c.finish_reason is not None:
                            more, rest = thoughts[c.index].finish()
                            thought, text = thought + more, text + rest
                    delta = stream.update(text) if text or not thoughts[c.index] else None
                    reason = c.finish_reason
                    if reason is not None:
                        last, reason = stream.finish(reason)
                        delta = merge_deltas(delta, last)
                if thought and reasoning.include:
                    delta = {"reasoning": thought, **(delta or {})}
                logprobs = None
                if request.logprobs:
                    logprobs = self._logprobs(c, request.top_logprobs or 0)
                ids = request.return_token_ids and bool(c.token_ids)
                if delta is None and reason is None and logprobs is None and not ids:
                    continue
                choice = {
                    "index": c.index,
                    "delta": delta or {},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
                if request.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                if reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage_of())

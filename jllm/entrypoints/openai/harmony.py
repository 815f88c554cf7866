"""gpt-oss's harmony chat format, through the `openai-harmony` package (as vLLM serves it).

A chat request to a gpt-oss model is rendered by harmony, not by the tokenizer's template:
a system message (the conversation's start date and the request's `reasoning_effort`), a
developer message (the request's leading system or developer text as instructions, and its
function tools), then the conversation (an assistant turn's `reasoning` as an `analysis`
message, its tool calls as `commentary` messages to `functions.NAME`, a tool's result as a
message from `functions.NAME`). The output is parsed by harmony's streaming parser, token
by token: the `analysis` channel is the reasoning (`--reasoning-parser openai_gptoss`),
`final` (and recipient-less `commentary`) the content, a `commentary` message to
`functions.NAME` a tool call (`--tool-call-parser openai`). Without either parser the text
is returned as generated, as vLLM does.

The vocabulary: harmony reads `o200k_base.tiktoken` from `TIKTOKEN_ENCODINGS_BASE` or
downloads it; without either, jllm writes the file from the model's own tokenizer (a gpt-oss
checkpoint's `tokenizer.json` holds the same 199,998 ranks) under ~/.cache/jllm/tiktoken,
and harmony checks its sha256 before using it, so a server needs no network.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import threading
from pathlib import Path

from jllm.entrypoints.openai.serving_engine import OpenAIError
from jllm.entrypoints.openai.tool_calls import ToolCall, make_tool_call_id

# Model types whose chat is harmony's (vLLM: `hf_config.model_type == "gpt_oss"`).
HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})
O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998  # the mergeable ranks; harmony's special tokens follow them
EFFORTS = ("low", "medium", "high")

_lock = threading.Lock()
_encoding = None


def uses_harmony(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in HARMONY_MODEL_TYPES


def o200k_from_tokenizer(tokenizer) -> bytes:
    """`o200k_base.tiktoken`'s bytes from a byte-level BPE tokenizer holding its ranks
    (gpt-oss's): each rank's token as raw bytes, base64, one line per rank. ValueError when
    the vocabulary is not o200k's."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    rows: list[bytes | None] = [None] * O200K_RANKS
    for token, rank in tokenizer.get_vocab().items():
        if rank < O200K_RANKS:
            try:
                rows[rank] = bytes(byte_of[ch] for ch in token)
            except KeyError:
                raise ValueError(f"token {rank} ({token!r}) is not a byte-level token") from None
    missing = sum(r is None for r in rows)
    if missing:
        raise ValueError(f"{missing} of o200k's {O200K_RANKS} ranks are not in the vocabulary")
    data = b"".join(base64.b64encode(r) + b" %d\n" % i for i, r in enumerate(rows))
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise ValueError("the vocabulary's ranks differ from o200k_base's")
    return data


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(root) / "jllm" / "tiktoken"


def encoding(tokenizer=None):
    """harmony's gpt-oss encoding (loaded once per process). When harmony cannot find or
    download o200k_base's file, it is written from `tokenizer` (see the module's text)."""
    global _encoding
    with _lock:
        if _encoding is None:
            _encoding = _load(tokenizer)
        return _encoding


def _load(tokenizer):
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    name = HarmonyEncodingName.HARMONY_GPT_OSS
    given = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    cached = _cache_dir()
    if given is None and (cached / O200K_FILE).exists():
        return _load_from(cached, load_harmony_encoding, name)
    try:
        return load_harmony_encoding(name)
    except HarmonyError as e:
        if given is not None or tokenizer is None:
            raise RuntimeError(
                f"The harmony format needs o200k_base's vocabulary: {e}. Set "
                f"TIKTOKEN_ENCODINGS_BASE to a folder holding {O200K_FILE}."
            ) from e
        reason = e
    try:
        data = o200k_from_tokenizer(tokenizer)
    except ValueError as e:
        raise RuntimeError(
            f"The harmony format needs o200k_base's vocabulary: harmony could not load it "
            f"({reason}) and the model's tokenizer does not hold it ({e})."
        ) from e
    cached.mkdir(parents=True, exist_ok=True)
    part = cached / f"{O200K_FILE}.{os.getpid()}"
    part.write_bytes(data)
    part.replace(cached / O200K_FILE)
    return _load_from(cached, load_harmony_encoding, name)


def _load_from(folder: Path, load, name):
    """Load with TIKTOKEN_ENCODINGS_BASE set to `folder` for the call (harmony checks the
    file's sha256 there)."""
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        return load(name)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


# -- the prompt --


def _text(content) -> str | None:
    """A message's text: a string, or its text parts joined (None: no text)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError("A message's content must be a string or a list of parts.", 400)
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text":
            texts.append(part.get("text") or "")
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                f"Message content of type {kind!r} is not supported by the harmony format.",
                400,
                "messages",
            )
    return "".join(texts)


def _effort(value):
    from openai_harmony import ReasoningEffort

    if value is None:
        return None
    if value not in EFFORTS:
        raise OpenAIError(
            f"reasoning_effort={value!r} is not supported by Harmony. Supported values are: "
            f"{', '.join(EFFORTS)}.",
            400,
            "reasoning_effort",
        )
    return {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM}.get(
        value, ReasoningEffort.HIGH
    )


def _tool_descriptions(tools) -> list:
    from openai_harmony import ToolDescription

    out = []
    for tool in tools or ():
        fn = tool["function"]
        out.append(
            ToolDescription.new(
                name=fn["name"],
                description=fn.get("description") or "",
                parameters=fn.get("parameters"),
            )
        )
    return out


def _messages(m: dict, names: dict[str, str]) -> list:
    """One chat message as harmony messages."""
    from openai_harmony import Author, Message, Role

    role = m.get("role")
    reasoning = m.get("reasoning", m.get("reasoning_content"))
    out = []
    if role == "assistant":
        content = _text(m.get("content"))
        calls = m.get("tool_calls") or []
        if calls and content:
            out.append(
                Message.from_role_and_content(Role.ASSISTANT, content).with_channel("commentary")
            )
        if reasoning:
            out.append(
                Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
            )
        for call in calls:
            fn = call.get("function") or {}
            arguments = fn.get("arguments") or ""
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            msg = Message.from_role_and_content(Role.ASSISTANT, arguments)
            out.append(
                msg.with_channel("commentary")
                .with_recipient(f"functions.{fn.get('name', '')}")
                .with_content_type("json")
            )
        if not calls and content:
            out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        return out
    if role == "tool":
        name = names.get(m.get("tool_call_id", ""), "")
        author = Author.new(Role.TOOL, f"functions.{name}")
        msg = Message.from_author_and_content(author, _text(m.get("content")) or "")
        return [msg.with_channel("commentary").with_recipient("assistant")]
    if role in ("system", "developer"):  # past the first: more instructions
        return [_developer(_text(m.get("content")), None)]
    if role == "user":
        return [Message.from_role_and_content(Role.USER, _text(m.get("content")) or "")]
    raise OpenAIError(f"Unknown message role {role!r}.", 400, "messages")


def _developer(instructions, tools):
    from openai_harmony import DeveloperContent, Message, Role

    content = DeveloperContent.new()
    if instructions is not None:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools(_tool_descriptions(tools))
    return Message.from_role_and_content(Role.DEVELOPER, content)


def render_chat(request, tokenizer=None) -> list[int]:
    """A chat request's prompt token ids in the harmony format (vLLM's rendering: the
    leading system or developer message becomes the developer message's instructions; the
    conversation's start date is VLLM_SYSTEM_START_DATE or today; analysis messages before
    the last final answer are dropped)."""
    from openai_harmony import (
        Conversation,
        Message,
        RenderConversationConfig,
        Role,
        SystemContent,
    )

    enc = encoding(tokenizer)
    messages = [m if isinstance(m, dict) else dict(m) for m in request.messages]
    instructions = None
    if messages and messages[0].get("role") in ("system", "developer"):
        instructions, messages = _text(messages[0].get("content")), messages[1:]
    system = SystemContent.new().with_conversation_start_date(
        os.environ.get("VLLM_SYSTEM_START_DATE") or datetime.date.today().isoformat()
    )
    effort = _effort(getattr(request, "reasoning_effort", None))
    if effort is not None:
        system = system.with_reasoning_effort(effort)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    tools = request.tools or None
    if instructions is not None or tools:
        out.append(_developer(instructions, tools))
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or ():
            names[call.get("id")] = (call.get("function") or {}).get("name", "")
    conversation = [msg for m in messages for msg in _messages(m, names)]
    last_final = max(
        (i for i, msg in enumerate(conversation) if msg.channel == "final"), default=-1
    )
    conversation = [
        msg for i, msg in enumerate(conversation) if i >= last_final or msg.channel != "analysis"
    ]
    ids = enc.render_conversation_for_completion(
        Conversation.from_messages(out + conversation),
        Role.ASSISTANT,
        config=RenderConversationConfig(auto_drop_analysis=False),
    )
    return list(ids)


# -- constraints --


def _lark_regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _content(p) -> str:
    """A request's structured-outputs constraint as a Lark rule body (llguidance's)."""
    from jllm.structured_output.backends import json_schema_text

    if p.kind in ("json", "json_object"):
        try:
            return f"%json {json_schema_text(p)}"
        except ValueError as e:
            raise OpenAIError(str(e), 400, "response_format") from e
    if p.kind == "regex":
        return _lark_regex(p.regex)
    if p.kind == "choice":
        if not p.choice:
            raise OpenAIError("A choice constraint needs at least one choice.", 400)
        return " | ".join(json.dumps(c) for c in p.choice)
    raise OpenAIError(
        f"A {p.kind} constraint is not supported with gpt-oss's harmony format (json, "
        "json_object, regex and choice are).",
        400,
        "structured_outputs",
    )


def _call(tool: dict) -> str:
    fn = tool["function"]
    schema = fn.get("parameters") or {"type": "object"}
    header = json.dumps(f"commentary to=functions.{fn['name']} ")
    return f'<|channel|> {header} <|constrain|> "json" <|message|> %json {json.dumps(schema)}'


def grammar(structured, tools, tool_choice: str):
    """The grammar of a constrained gpt-oss output (vLLM's harmony structural tag, as a Lark
    grammar for llguidance): any number of free `analysis` messages, then the constraint in
    its channel: `structured` (a StructuredOutputsParams: json, json_object, regex or
    choice) as the `final` message, or for tool_choice "required" (any of `tools`) or a
    function's name a `commentary` call to it with JSON arguments. Returns a
    StructuredOutputsParams, or None when nothing is constrained."""
    from jllm.sampling_params import StructuredOutputsParams

    if tool_choice in ("auto", "none"):
        if structured is None:
            return None
        body = f'<|channel|> "final" <|message|> content\ncontent: {_content(structured)}'
    else:
        chosen = [t for t in tools or () if tool_choice == "required"]
        chosen = chosen or [t for t in tools if t["function"]["name"] == tool_choice]
        body = " | ".join(f"call{i}" for i in range(len(chosen)))
        body += "".join(f"\ncall{i}: {_call(t)}" for i, t in enumerate(chosen))
    text = (
        "start: analysis* body\n"
        'analysis: <|channel|> "analysis" <|message|> ANALYSIS <|end|> <|start|> "assistant"\n'
        "ANALYSIS: /(?s:.*)/\n"
        f"body: {body}\n"
    )
    return StructuredOutputsParams(grammar=text)


# -- the output --


def _function(recipient: str | None) -> str | None:
    """The function a recipient names (`functions.NAME`, or a bare name), else None."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return None
    recipient = recipient.split("<|constrain|>", 1)[0].strip()
    if recipient.startswith("functions."):
        return recipient[len("functions.") :] or None
    if recipient.split(".", 1)[0] in ("python", "browser", "container"):
        return None
    return recipient or None


def _kind(channel, recipient) -> str:
    if _function(recipient) is not None:
        return "tool"
    if channel == "analysis":
        return "reasoning"
    if channel == "final" or (channel == "commentary" and not recipient):
        return "content"
    return "ignore"


class HarmonyChoice:
    """One choice's output through harmony's streaming parser: `update(token_ids)` gives the
    delta to stream, `finish(reason)` the last delta and the finish reason; `message()` the
    whole (reasoning, content, tool calls). `reasoning`: the server's `openai_gptoss`
    reasoning parser (without it the analysis is dropped); `tools`: tool calls are read
    (`--tool-call-parser openai` with tool_choice "auto", or a forced call); `include`: the
    request's `include_reasoning`; `calls_finish`: a call makes the finish reason
    "tool_calls" (tool_choice "auto" and "required"; a named function keeps the engine's)."""

    def __init__(
        self, reasoning: bool, tools: bool, include: bool = True, calls_finish: bool = True
    ) -> None:
        from openai_harmony import Role, StreamableParser

        self.parser = StreamableParser(encoding(), role=Role.ASSISTANT)
        self.reasoning, self.tools, self.include = reasoning, tools, include
        self.calls_finish = calls_finish
        self.done = 0  # completed messages read
        self.parts = {"reasoning": [], "content": []}
        self.calls: list[ToolCall] = []
        self.pending: list[int] = []  # the current message's tokens (a broken end's text)
        self.pending_streamed = False  # whether a delta of the current message went out
        self.call_index = -1
        self.recipient = None  # the streamed call's recipient

    def _feed(self, token_ids) -> list[tuple[str, str, str | None, bool]]:
        """(kind, text delta, recipient, whether a message ended) per token; completed
        messages are recorded."""
        from openai_harmony import HarmonyError

        out = []
        for token in token_ids:
            try:
                self.parser.process(token)
            except HarmonyError:
                continue
            self.pending.append(token)
            channel, recipient = self.parser.current_channel, self.parser.current_recipient
            delta = self.parser.last_content_delta or ""
            ended = self._completed()
            self.pending_streamed |= bool(delta) and not ended
            out.append((_kind(channel, recipient), delta, recipient, ended))
        return out

    def _completed(self) -> bool:
        messages = self.parser.messages
        ended = self.done < len(messages)
        while self.done < len(messages):
            msg = messages[self.done]
            self.done += 1
            self.pending.clear()
            self.pending_streamed = False
            if msg.author.role != "assistant" or not msg.content:
                continue
            text = "".join(getattr(c, "text", "") for c in msg.content)
            kind = _kind(msg.channel, msg.recipient)
            if kind == "tool":
                arguments = text
                if msg.content_type is None or "json" in msg.content_type:
                    try:
                        arguments = json.dumps(json.loads(text))
                    except ValueError:
                        pass
                self.calls.append(ToolCall(_function(msg.recipient), arguments))
            elif kind in self.parts and text:
                self.parts[kind].append(text)
        return ended

    def _end(self) -> str:
        """Close the parser at the end of the output; the text of a message it could not
        complete (a malformed or cut-off one) is returned as content."""
        from openai_harmony import HarmonyError

        try:
            self.parser.process_eos()
            self._completed()
            return ""
        except HarmonyError:
            text = encoding().decode_utf8(self.pending) if self.pending else ""
            self.pending.clear()
            return text

    def update(self, token_ids) -> dict | None:
        reasoning, content, calls = "", "", []
        for kind, delta, recipient, ended in self._feed(token_ids):
            if kind == "reasoning" and self.reasoning:
                reasoning += delta
            elif kind == "content":
                content += delta
            elif kind == "tool" and self.tools:
                if recipient != self.recipient:
                    self.call_index += 1
                    self.recipient = recipient
                    calls.append(
                        {
                            "index": self.call_index,
                            "id": make_tool_call_id(),
                            "type": "function",
                            "function": {"name": _function(recipient), "arguments": delta},
                        }
                    )
                elif delta and calls:
                    calls[-1]["function"]["arguments"] += delta
                elif delta:
                    calls.append({"index": self.call_index, "function": {"arguments": delta}})
            if kind != "tool" or ended:
                self.recipient = None
        return self._delta(reasoning, content, calls)

    def _delta(self, reasoning, content, calls) -> dict | None:
        delta = {}
        if reasoning and self.include:
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta or None

    def finish(self, token_ids, finish_reason) -> tuple[dict | None, str | None]:
        """The last tokens' delta and the finish reason ("tool_calls" once a call was read)."""
        delta = self.update(token_ids) or {}
        streamed = self.pending_streamed
        rest = self._end()
        if rest and not streamed:
            delta["content"] = delta.get("content", "") + rest
        return delta or None, self._reason(finish_reason)

    def _reason(self, finish_reason):
        if self.tools and self.calls and self.calls_finish and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def message(self, token_ids, finish_reason):
        """(reasoning or None, content or None, tool calls, finish reason) of a whole output."""
        self._feed(token_ids)
        rest = self._end()
        reasoning = "\n".join(self.parts["reasoning"]) or None
        content = "\n".join([*self.parts["content"], rest] if rest else self.parts["content"])
        calls = self.calls if self.tools else []
        thought = reasoning if self.reasoning and self.include else None
        return thought, content or None, calls, self._reason(finish_reason)

    @staticmethod
    def reasoning_tokens(token_ids) -> int:
        """usage's reasoning_tokens: output tokens inside analysis messages and calls to
        tools (specials not counted), as vLLM counts them."""
        from openai_harmony import HarmonyError, Role, StreamableParser

        enc = encoding()
        parser = StreamableParser(enc, role=Role.ASSISTANT)
        count = 0
        for token in token_ids:
            try:
                parser.process(token)
            except HarmonyError:
                continue
            channel, recipient = parser.current_channel, parser.current_recipient
            thinking = channel == "analysis" or (channel == "commentary" and recipient)
            if thinking and not enc.is_special_token(token):
                count += 1
        return count

"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's thinking apart from its
answer. Host side only, no JAX: the server splits the text (`split`, `ReasoningStream`), the
engine gates a grammar on the token ids (`ReasoningParser.gate_ids`, used by
jllm/structured_output/reasoning.py: structured outputs apply once the reasoning has ended).

- `deepseek_r1`: `<think>` ... `</think>`; what comes before `</think>` is reasoning, also
  when the chat template wrote `<think>` into the prompt (the output then starts inside it).
- `qwen3`: the same tags; `<tool_call>` also ends the reasoning (the call is content), and
  `chat_template_kwargs={"enable_thinking": false}` means no reasoning at all.
- `granite`: Granite 3.2's text markers, "Here is my thought process:" then "Here is my
  response:" ("Here's" also); without the first marker everything is content.
- `openai_gptoss`: gpt-oss's harmony channels, split by the server's harmony parser on the
  token ids (jllm/entrypoints/openai/harmony.py); a grammar applies from the start.

A parser reads one output: `split(text)` gives (reasoning, content), each None when empty.
Streaming is the same function on the text so far, with what might still become a marker
held back, so a stream's deltas always add up to the non-streamed split.
"""

from __future__ import annotations

import bisect
import copy
import re

from jllm.utils import partial_marker

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "make_reasoning_parser"]


class ReasoningParser:
    """A tag parser: reasoning until `end` (a `start` tag is dropped), content after it."""

    name = ""
    start = "<think>"
    end = "</think>"
    # Tags that end the reasoning and belong to the content (and to its grammar).
    implicit_ends: tuple[str, ...] = ()

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.thinking = True
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        missing = [t for t in (self.start, self.end) if t not in vocab]
        if missing:
            raise ValueError(
                f"--reasoning-parser {self.name} needs the tokens {missing} in the model's "
                "vocabulary; this tokenizer has none."
            )
        self.start_id, self.end_id = vocab[self.start], vocab[self.end]
        self.implicit_end_ids = frozenset(vocab[t] for t in self.implicit_ends if t in vocab)

    def for_request(self, chat_template_kwargs: dict | None) -> ReasoningParser:
        """This parser for one request: its `chat_template_kwargs` may turn thinking off
        (`enable_thinking`, or `thinking`, false). A copy: the vocabulary is read once."""
        kwargs = chat_template_kwargs or {}
        parser = copy.copy(self)
        parser.thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
        return parser

    # -- tokens (the engine's grammar gate and the usage count) --

    def ended_in(self, prompt_token_ids) -> bool:
        """Whether the reasoning is over before the output starts: thinking is off, or the
        prompt's last reasoning tag is an end tag (a template that closed an empty
        `<think></think>`)."""
        if not self.thinking:
            return True
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return False
            if token == self.end_id:
                return True
        return False

    def gate_ids(self) -> tuple[frozenset, frozenset]:
        """(end ids the grammar does not see, end ids that are the grammar's first token)."""
        return frozenset((self.end_id,)), self.implicit_end_ids

    def count_reasoning_tokens(self, token_ids, prompt_token_ids=()) -> int:
        """The output tokens inside the reasoning: before its end, tags not counted."""
        if self.ended_in(prompt_token_ids):
            return 0
        count = 0
        for token in token_ids:
            if token == self.end_id or token in self.implicit_end_ids:
                break
            count += token != self.start_id
        return count

    # -- text --

    def split(self, text: str, ended: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; `ended`: the reasoning ended in the
        prompt (`ended_in`), so all of it is content."""
        if ended or not self.thinking:
            return None, text or None
        cut, after = self._end(text)
        reasoning = text if cut is None else text[:cut]
        content = None if cut is None else text[after:]
        reasoning = reasoning.replace(self.start, "", 1)
        return reasoning or None, content or None

    def _end(self, text: str) -> tuple[int | None, int]:
        """Where the reasoning ends: (its end, where the content starts), or (None, 0)."""
        at = text.find(self.end)
        hits = [(at, at + len(self.end))] if at >= 0 else []
        for tag in self.implicit_ends:
            i = text.find(tag)
            if i >= 0:
                hits.append((i, i))
        return min(hits) if hits else (None, 0)

    def markers(self) -> tuple[str, ...]:
        """The strings a stream must see whole before it can say where text belongs."""
        return (self.start, self.end, *self.implicit_ends)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)


class GraniteReasoningParser(ReasoningParser):
    """Granite 3.2's markers are text, not tokens: no grammar gate (vLLM's neither), and the
    reasoning tokens are counted by decoding prefixes of the output."""

    name = "granite"
    _think = re.compile(r"Here(?:'s| is) my thought process:")
    _answer = re.compile(r"Here(?:'s| is) my response:")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.thinking = True
        self.implicit_end_ids = frozenset()

    def ended_in(self, prompt_token_ids) -> bool:
        return False

    def gate_ids(self) -> tuple[frozenset, frozenset]:
        return frozenset(), frozenset()

    def count_reasoning_tokens(self, token_ids, prompt_token_ids=()) -> int:
        """Tokens from the one that completes the thought marker to the one that completes
        the answer marker (bisection over decoded prefixes: markedness only grows)."""
        token_ids = list(token_ids)

        def first(pattern) -> int:
            """The fewest tokens whose text has the marker (len + 1: none has)."""
            return bisect.bisect_left(
                range(len(token_ids) + 1),
                True,
                key=lambda n: bool(pattern.search(self.tokenizer.decode(token_ids[:n]))),
            )

        start = first(self._think)
        if start > len(token_ids):
            return 0
        return max(0, min(first(self._answer) - 1, len(token_ids)) - start)

    def split(self, text: str, ended: bool = False) -> tuple[str | None, str | None]:
        think = self._think.search(text)
        if ended or think is None:
            return None, text or None
        answer = self._answer.search(text, think.end())
        if answer is None:
            return text[think.end() :] or None, None
        return text[think.end() : answer.start()] or None, text[answer.end() :] or None

    def markers(self) -> tuple[str, ...]:
        return ("Here's my thought process:", "Here is my thought process:") + (
            "Here's my response:",
            "Here is my response:",
        )


class GptOssReasoningParser(GraniteReasoningParser):
    """gpt-oss (`openai_gptoss`): the harmony format's channels, read token by token by the
    server's harmony parser (jllm/entrypoints/openai/harmony.py), not from the text. Here it
    only says that a grammar applies from the start (harmony's structural tag already lets
    the analysis channel through), as vLLM's parser of the name does."""

    name = "openai_gptoss"
    channel_tokens = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>")

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if any(t not in vocab for t in self.channel_tokens):
            raise ValueError(
                f"--reasoning-parser {self.name} needs a gpt-oss model (the harmony format's "
                f"tokens {list(self.channel_tokens)}); this tokenizer lacks them."
            )

    def ended_in(self, prompt_token_ids) -> bool:
        return True

    def count_reasoning_tokens(self, token_ids, prompt_token_ids=()) -> int:
        return 0

    def split(self, text: str, ended: bool = False) -> tuple[str | None, str | None]:
        return None, text or None

    def markers(self) -> tuple[str, ...]:
        return ()


REASONING_PARSERS = {
    p.name: p
    for p in (
        DeepSeekR1ReasoningParser,
        Qwen3ReasoningParser,
        GraniteReasoningParser,
        GptOssReasoningParser,
    )
}


def make_reasoning_parser(
    name: str, tokenizer, chat_template_kwargs: dict | None = None
) -> ReasoningParser:
    """The parser `--reasoning-parser NAME` selects (for a request's `chat_template_kwargs`
    when given); ValueError naming the choices. Build it once and derive each request's
    with `for_request`: building reads the whole vocabulary."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"invalid reasoning parser: {name} (choose from {sorted(REASONING_PARSERS)})"
        )
    parser = REASONING_PARSERS[name](tokenizer)
    return parser if chat_template_kwargs is None else parser.for_request(chat_template_kwargs)


class ReasoningStream:
    """One streamed output split as it grows: `update(delta)` gives the (reasoning, content)
    text to send now; `finish()` what was held back (a marker's beginning at the end)."""

    def __init__(self, parser: ReasoningParser, ended: bool = False) -> None:
        self.parser, self.ended = parser, ended
        self.text = ""
        self.sent = ["", ""]  # reasoning and content sent so far

    def update(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(self._stable(self.text))

    def finish(self) -> tuple[str, str]:
        return self._emit(self.text)

    def _stable(self, text: str) -> str:
        """`text` without a tail that may be the beginning of a marker."""
        if self.ended:
            return text
        return text[: len(text) - partial_marker(text, self.parser.markers())]

    def _emit(self, text: str) -> tuple[str, str]:
        parts = self.parser.split(text, self.ended)
        out = []
        for i, part in enumerate(parts):
            part = part or ""
            # A part only grows while the text does; should a later marker reshape it, what
            # was sent stays sent and only the new tail goes.
            new = part[len(self.sent[i]) :] if part.startswith(self.sent[i]) else ""
            self.sent[i] += new
            out.append(new)
        return out[0], out[1]

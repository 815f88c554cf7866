"""The reasoning parsers (jllm/reasoning) on text and token ids, the stream against the
whole-text split for any chunking, and the grammar gate (jllm/structured_output/reasoning.py)
against a recording matcher."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jllm.reasoning import REASONING_PARSERS, ReasoningStream, make_reasoning_parser
from jllm.structured_output.reasoning import ReasoningGate


class Vocab:
    """A tokenizer stub: the tags' ids, and decode over a fixed table."""

    def __init__(self, table: dict[int, str] | None = None) -> None:
        self.table = table or {}

    def get_vocab(self) -> dict[str, int]:
        return {"<think>": 100, "</think>": 101, "<tool_call>": 102, "x": 5}

    def decode(self, ids) -> str:
        return "".join(self.table[i] for i in ids)


def parser(name: str, **kwargs):
    return make_reasoning_parser(name, Vocab(), kwargs or None)


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("deepseek_r1", "abc", ("abc", None)),
        ("deepseek_r1", "<think>abc", ("abc", None)),
        ("deepseek_r1", "abc</think>xyz", ("abc", "xyz")),
        ("deepseek_r1", "<think>abc</think>", ("abc", None)),
        ("deepseek_r1", "<think></think>xyz", (None, "xyz")),
        ("deepseek_r1", "abc</think>x</think>y", ("abc", "x</think>y")),
        ("qwen3", "<think>abc</think>xyz", ("abc", "xyz")),
        ("qwen3", "abc<tool_call>{}</tool_call>", ("abc", "<tool_call>{}</tool_call>")),
        ("granite", "plain answer", (None, "plain answer")),
        ("granite", "Here is my thought process: A Here's my response: B", (" A ", " B")),
        ("granite", "Here's my thought process: A", (" A", None)),
    ],
)
def test_split(name, text, expected):
    assert parser(name).split(text) == expected


def test_thinking_off_and_reasoning_ended_in_the_prompt():
    off = parser("qwen3", enable_thinking=False)
    assert off.split("<think>a</think>b") == (None, "<think>a</think>b")
    assert off.ended_in([1, 2])
    on = parser("deepseek_r1")
    assert on.ended_in([7, 100, 8, 101, 9])  # an empty <think></think> in the prompt
    assert not on.ended_in([7, 100, 8])  # the template opened the reasoning
    assert not on.ended_in([7, 8])
    assert on.split("all content", ended=True) == (None, "all content")


def test_reasoning_tokens():
    r1 = parser("deepseek_r1")
    assert r1.count_reasoning_tokens([100, 5, 5, 5, 101, 5, 5]) == 3
    assert r1.count_reasoning_tokens([5, 5, 101, 5], prompt_token_ids=[100]) == 2
    assert r1.count_reasoning_tokens([5, 5], prompt_token_ids=[100, 101]) == 0
    assert parser("qwen3").count_reasoning_tokens([5, 102, 5, 5]) == 1
    table = {
        1: "Here is my ",
        2: "thought process:",
        3: " a",
        4: " b",
        5: "Here is my response:",
        6: "!",
    }
    granite = make_reasoning_parser("granite", Vocab(table))
    assert granite.count_reasoning_tokens([1, 2, 3, 4, 1, 5, 6]) == 3  # " a", " b", "Here is my "
    assert granite.count_reasoning_tokens([3, 4]) == 0


def test_refusals():
    with pytest.raises(ValueError, match="invalid reasoning parser: nope"):
        make_reasoning_parser("nope", Vocab())

    class NoTags:
        def get_vocab(self):
            return {"a": 1}

    with pytest.raises(ValueError, match="needs the tokens"):
        make_reasoning_parser("deepseek_r1", NoTags())


TEXTS = [
    "<think>Let me see.</think>The answer is four",
    "one</think>two",
    "<think>a <thin b</think> c </thi d",
    "Here is my thought process: x y Here's my response: z",
    'lead <think>r<tool_call>{"a": 1}</tool_call>',
]


# The text parsers; openai_gptoss reads harmony's channels from the token ids
# (tests/entrypoints/openai/test_harmony.py).
TEXT_PARSERS = sorted(set(REASONING_PARSERS) - {"openai_gptoss"})


@settings(max_examples=60, deadline=None, database=None)
@given(st.sampled_from(TEXT_PARSERS), st.sampled_from(TEXTS), st.data())
def test_the_stream_adds_up_to_the_split(name, text, data):
    """Any chunking of any output: the deltas joined equal the whole text's split."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    p = parser(name)
    stream = ReasoningStream(p)
    got = ["", ""]
    for piece in pieces:
        for i, part in enumerate(stream.update(piece)):
            got[i] += part
    for i, part in enumerate(stream.finish()):
        got[i] += part
    reasoning, content = p.split(text)
    assert got == [reasoning or "", content or ""]


class Recorder:
    """A matcher that accepts digits (ids 0-9) only and records what it saw."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept(self, token: int) -> bool:
        if token >= 10 and token != 102:
            return False
        self.seen.append(token)
        return True

    def fill(self, bitmask, index) -> None:
        bitmask[index] = 0b1111111111

    def rollback(self, n: int) -> None:
        del self.seen[len(self.seen) - n :]

    def is_terminated(self) -> bool:
        return False


def test_the_gate_opens_after_the_end_tag_and_rolls_back_over_it():
    m = Recorder()
    gate = ReasoningGate(m, frozenset({101}), frozenset({102}), ended=False)
    rows = np.zeros((2, 1), np.int32)
    gate.fill(rows, 0)
    assert rows[0, 0] == -1  # free while thinking
    assert gate.accept(50) and gate.accept(51) and m.seen == []
    assert gate.accept(101) and gate.ended and m.seen == []  # the end tag is not the grammar's
    gate.fill(rows, 1)
    assert rows[1, 0] == 0b1111111111
    assert gate.accept(3) and not gate.accept(60) and m.seen == [3]
    gate.rollback(2)  # the digit and the end tag: thinking again
    assert not gate.ended and m.seen == []
    implicit = ReasoningGate(Recorder(), frozenset({101}), frozenset({102}), ended=False)
    assert implicit.accept(102) and implicit.ended and implicit._m.seen == [102]
    implicit.rollback(1)
    assert not implicit.ended and implicit._m.seen == []
    assert ReasoningGate(Recorder(), frozenset({101}), frozenset(), ended=True).ended


def test_openai_gptoss_needs_harmony_tokens():
    """The harmony parser refuses a vocabulary without the channel tokens; with them it
    gates no grammar (harmony's channels are the server's to split)."""
    with pytest.raises(ValueError, match="gpt-oss"):
        make_reasoning_parser("openai_gptoss", Vocab())

    class Harmony(Vocab):
        def get_vocab(self):
            return {"<|channel|>": 1, "<|message|>": 2, "<|start|>": 3, "<|end|>": 4}

    p = make_reasoning_parser("openai_gptoss", Harmony())
    assert p.ended_in([]) and p.gate_ids() == (frozenset(), frozenset())

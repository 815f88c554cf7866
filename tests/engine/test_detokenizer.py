"""Incremental detokenization and stop strings against the tokenizer's own full decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from jllm.engine.detokenizer import IncrementalDetokenizer
from jllm.engine.output_processor import OutputProcessor
from jllm.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is a test.",
    "Emoji 🙂🚀 and accents: café, naïve, Zürich.",
    "中文字符和日本語のテキスト",
    "<|im_start|>assistant\nSpecial tokens in the middle<|im_end|> after",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def feed(tok, prompt_ids, ids, stream=True, **params):
    d = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params), stream=stream)
    assert (d._backend is not None) == stream  # the embedded tokenizer is a fast one
    stop = None
    for t in ids:
        stop = d.update(t)
        if stop is not None:
            break
    return d.text, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "window"])
def test_incremental_equals_full_decode(tok, text, skip, stream):
    ids = tok.encode(text)
    prompt = tok.encode("A prompt before it: ")
    got, _ = feed(tok, prompt, ids, stream=stream, skip_special_tokens=skip)
    assert got == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_across_tokens(tok):
    ids = tok.encode("The answer is forty-two. Then more text follows.")
    text, stop = feed(tok, [], ids, stop=["forty-two"])
    assert stop == "forty-two" and text == "The answer is "
    text, stop = feed(tok, [], ids, stop=["nothing", "two."], include_stop_str_in_output=True)
    assert stop == "two." and text == "The answer is forty-two."


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "window"])
def test_stop_strings_wait_for_min_tokens(tok, stream):
    """vLLM's rule: a stop string in the text of the first `min_tokens` tokens does not
    stop the sequence; one that ends after them does, even if it began before."""
    ids = tok.encode("one two one two three")
    n = len(tok.encode("one two"))
    text, stop = feed(tok, [], ids, stream=stream, stop=["two"], min_tokens=n)
    assert stop == "two" and text == "one two one "
    text, stop = feed(tok, [], ids, stream=stream, stop=["two one"], min_tokens=n)
    assert stop == "two one" and text == "one "
    text, stop = feed(tok, [], ids, stream=stream, stop=["two"], min_tokens=len(ids))
    assert stop is None and text == "one two one two three"


class SlowTokenizer:
    """A slow (Python) tokenizer's decoding surface: one character per token, two added
    tokens, one of them special."""

    is_fast = False
    vocab = ["a", "b", " ", "<s>", "<tool>"]

    def convert_ids_to_tokens(self, ids):
        return [self.vocab[i] for i in ids]

    def __len__(self):
        return len(self.vocab)

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def get_added_vocab(self):
        return {"<s>": 3, "<tool>": 4}

    @property
    def all_special_tokens(self):
        return ["<s>"]


@pytest.mark.parametrize(
    "spaces, skip, want",
    [
        (True, False, "<s> ab <tool> b a"),
        (False, False, "<s>ab<tool>b a"),
        (True, True, "ab <tool> b a"),
        (False, True, "ab<tool>b a"),
    ],
)
def test_spaces_between_special_tokens_with_a_slow_tokenizer(spaces, skip, want):
    """vLLM's rule for slow tokenizers: runs between added tokens decoded apart, special
    tokens dropped when skipped, the pieces joined by a space when
    spaces_between_special_tokens (fast tokenizers ignore it, in vLLM too)."""
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    d = IncrementalDetokenizer(SlowTokenizer(), [], params, stream=False)
    for t in [3, 0, 1, 4, 1, 2, 0]:
        d.update(t)
    assert d.text == want


@pytest.mark.parametrize("name", ["ByT5Tokenizer", "CanineTokenizer"])
def test_ids_past_a_slow_tokenizers_vocabulary_decode_to_nothing(name):
    """A model's vocabulary may be padded past its tokenizer's (the sampler can pick such an
    id, a prompt can hold one, a logprob can list one): with a slow (Python) tokenizer, whose
    own decode raises on them, they decode to nothing (vLLM's rule for the text)."""
    import transformers

    tok = getattr(transformers, name)()
    assert not tok.is_fast
    past = [len(tok) + 3, 4 * len(tok)]
    d = IncrementalDetokenizer(tok, [72, past[1], 105], SamplingParams(), stream=False)
    for t in [72, 105, past[0], 33, past[1], 33]:
        assert d.update(t) is None
    assert d.text == tok.decode([72, 105, 33, 33])
    # ... and in a logprob's decoded token
    outputs = OutputProcessor(tok)
    assert [outputs.decode_one(t) for t in (72, *past)] == [tok.decode([72]), "", ""]


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "window"])
def test_ids_past_a_fast_tokenizers_vocabulary_decode_to_nothing(tok, stream):
    past = len(tok) + 5
    ids = tok.encode("Hello world")
    text, _ = feed(tok, [past, *ids], [*ids[:1], past, *ids[1:]], stream=stream)
    assert text == tok.decode(ids)


def scan_by_every_stop(pieces: list[str], stops: list[str], include: bool):
    """The stop-string rule checked the plain way (vLLM's `check_stop_strings`): after each
    piece, every stop string searched from where one could end in the piece; the one that
    completes earliest wins, ties to the list's order; (the text, the stop found)."""
    text = ""
    for piece in pieces:
        text += piece
        if not piece:
            continue
        best = None  # (end, stop, begin)
        for stop in stops:
            idx = text.find(stop, max(0, len(text) + 1 - len(piece) - len(stop)))
            if idx != -1 and (best is None or idx + len(stop) < best[0]):
                best = (idx + len(stop), stop, idx)
        if best is not None:
            end, stop, begin = best
            return text[: end if include else begin], stop
    return text, None


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text("ab c", min_size=0, max_size=3), max_size=12),
    stops=st.lists(st.text("ab c", min_size=1, max_size=4), min_size=1, max_size=6),
    include=st.booleans(),
)
def test_indexed_stop_scan_equals_the_plain_one(pieces, stops, include):
    """The detokenizer finds stop strings by their last character at each new character; it
    must stop where (and with the string) a search of every stop string over the window
    would: the one that completes earliest, ties to the list's order."""
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    d = IncrementalDetokenizer(SlowTokenizer(), [], params, stream=False)
    found = None
    for piece in pieces:
        found = d._append(piece)
        if found is not None:
            break
    assert (d.text, found) == scan_by_every_stop(pieces, stops, include)

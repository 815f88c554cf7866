"""Incremental detokenization and stop strings against the tokenizer's own full decode."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jllm.engine.detokenizer import IncrementalDetokenizer
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

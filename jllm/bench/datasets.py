"""The bench commands' requests, as vLLM's benchmarks build them:

- `random`: `--input-len` / `--output-len` tokens per request (each drawn uniformly within
  `--random-range-ratio` of them), random ids outside the tokenizer's special tokens, after a
  shared `--prefix-len`-token prefix;
- `sharegpt`: a ShareGPT JSON file (`--dataset-path`: entries whose `conversations` have at
  least two turns; the first is the prompt, the second's length the output length, unless
  `--output-len` is given), pruned as vLLM prunes it (prompt and output of at least 4
  tokens, prompt at most 1024, both at most 2048); without a path, synthetic requests of
  ShareGPT's shape: log-normal prompt and output lengths with ShareGPT's medians (about 200
  and 180 tokens) and spread, within the same limits.

A request is (prompt token ids, output length). Host-side only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _allowed_ids(tokenizer, vocab_size: int | None) -> np.ndarray:
    size = vocab_size or (tokenizer.vocab_size if tokenizer is not None else 32000)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    return np.array([t for t in range(size) if t not in special], np.int64)


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    tokenizer=None,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be at least 1.")
    rng = np.random.default_rng(seed)
    ids = _allowed_ids(tokenizer, vocab_size)
    prefix = rng.choice(ids, prefix_len).tolist()

    def lens(mean: int) -> np.ndarray:
        low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
        return rng.integers(max(1, low), high + 1, num)

    ins, outs = lens(input_len), lens(output_len)
    return [
        SampleRequest(prefix + rng.choice(ids, int(n)).tolist(), int(o))
        for n, o in zip(ins, outs, strict=True)
    ]


def _valid(prompt_len: int, output_len: int, output_fixed: bool) -> bool:
    return (
        prompt_len >= 4
        and (output_fixed or output_len >= 4)
        and prompt_len <= 1024
        and prompt_len + output_len <= 2048
    )


def sharegpt_requests(
    num: int,
    tokenizer,
    path: str | None = None,
    output_len: int | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    if path is None:
        return _sharegpt_shaped(num, tokenizer, output_len, seed, vocab_size)
    if tokenizer is None:
        raise ValueError("A ShareGPT file needs a tokenizer.")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data = [e for e in data if len(e.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(data)
    out = []
    for entry in data:
        if len(out) == num:
            break
        prompt = tokenizer(entry["conversations"][0]["value"]).input_ids
        reply = len(tokenizer(entry["conversations"][1]["value"]).input_ids)
        n = reply if output_len is None else output_len
        if _valid(len(prompt), n, output_len is not None):
            out.append(SampleRequest(prompt, n))
    if not out:
        raise ValueError(f"{path} has no conversation that fits the limits.")
    while len(out) < num:  # vLLM oversamples a short dataset
        out.append(out[len(out) % max(1, len(out))])
    return out


def _sharegpt_shaped(num, tokenizer, output_len, seed, vocab_size) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    ids = _allowed_ids(tokenizer, vocab_size)
    out = []
    while len(out) < num:
        n = int(rng.lognormal(np.log(200), 1.0))
        o = output_len if output_len is not None else int(rng.lognormal(np.log(180), 1.0))
        if _valid(n, o, output_len is not None):
            out.append(SampleRequest(rng.choice(ids, n).tolist(), o))
    return out

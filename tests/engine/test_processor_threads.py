"""The server prepares requests on several threads at once (its processor pool): the shared
tokenizer's encode, chat template and decode give from eight threads at once what they give
from one (a fast tokenizer's methods borrow it shared; nothing the server calls reconfigures
it)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from jllm.engine.processor import Processor
from jllm.sampling_params import SamplingParams

TEXTS = [f"Request {i}: " + "café naïve 🙂 " * (i % 7) + "words " * (i % 13) for i in range(48)]


def test_the_tokenizer_from_several_threads(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    processor = Processor(tok, 4096, len(tok), 20)

    def prepare(text: str):
        conv = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        params = SamplingParams(max_tokens=4, bad_words=[text.split()[0]])
        ids = processor.process_prompt({"prompt": rendered}, params, False).prompt_token_ids
        return rendered, ids, tok.decode(ids), params.bad_words_token_ids

    want = [prepare(t) for t in TEXTS]
    start = threading.Barrier(8)

    def worker(offset: int):
        start.wait()  # all eight at once
        order = TEXTS[offset:] + TEXTS[:offset]
        got = [prepare(t) for t in order]
        return got[-offset:] + got[:-offset] if offset else got

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(worker, range(0, 48, 6)))
    assert all(r == want for r in results)

"""The agent routes' overhead against chat completions: time to first token and to the whole
answer of one streamed request, the same conversation through `/v1/chat/completions`,
`/v1/responses` and `/v1/messages`, on one server over the embedded SmolLM2-135M-Instruct.

The routes alternate request by request (chat, responses, messages, chat, ...) so that the
machine's drift lands on all three; each figure is the median over `--rounds` requests, and
the ratio is against chat in the same run. Every request asks for `--max-tokens` tokens
(`ignore_eos` where the route takes it; the question's answer is longer than that), so all
three generate the same count. The clients are the real ones
(`openai`, `anthropic`), so their parsing of the event streams is in the figures.

    python benchmarks/api_routes.py --rounds 20
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import anthropic
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from openai_server import RunningServer  # noqa: E402

from jllm.entrypoints.openai.api_server import build_app, build_engine  # noqa: E402
from jllm.entrypoints.openai.cli_args import make_arg_parser  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue."


def timed(stream, is_token) -> tuple[float, float]:
    """(seconds to the first generated text, seconds to the end) of an event iterator."""
    t0, first = time.perf_counter(), None
    for event in stream:
        if first is None and is_token(event):
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    opts = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "0")
    args = make_arg_parser().parse_args(["--max-model-len", "1024", "--max-num-seqs", "8"])
    engine, metrics = build_engine(args)
    server = RunningServer(build_app(args, engine, metrics), engine)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    model = oai.models.list().data[0].id
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    extra = {"ignore_eos": True}
    n = opts.max_tokens

    def chat():
        stream = oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=n,
            stream=True,
            extra_body=extra,
        )
        return timed(stream, lambda c: c.choices and c.choices[0].delta.content)

    def responses():
        stream = oai.responses.create(
            model=model, input=QUESTION, max_output_tokens=n, stream=True, extra_body=extra
        )
        return timed(stream, lambda e: e.type == "response.output_text.delta")

    def messages():
        with claude.messages.stream(
            model=model,
            max_tokens=n,
            messages=[{"role": "user", "content": QUESTION}],
        ) as stream:
            return timed(stream, lambda e: e.type == "content_block_delta")

    routes = {"chat": chat, "responses": responses, "messages": messages}
    for fn in routes.values():  # warm: the buckets are compiled, the clients connected
        fn()
    got = {name: [] for name in routes}
    for _ in range(opts.rounds):
        for name, fn in routes.items():
            got[name].append(fn())
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {model}, {opts.rounds} rounds, {n} tokens per request")
    print("| route | first token (ms) | whole answer (ms) | first token vs chat |")
    print("|---|---|---|---|")
    base = statistics.median(t for t, _ in got["chat"])
    for name, runs in got.items():
        first = statistics.median(t for t, _ in runs)
        whole = statistics.median(w for _, w in runs)
        print(f"| {name} | {first * 1e3:.1f} | {whole * 1e3:.1f} | {first / base:.2f}x |")
    server.stop()
    engine.shutdown()


if __name__ == "__main__":
    main()

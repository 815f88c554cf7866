"""Sliding windows that free what they no longer see: a Gemma-3-1B-shaped model (random
weights from `benchmarks/gpu/configs/gemma-3-1b`, 22 local layers with a 512-token window
and 4 global ones) beside the same shape with every window off, in one run.

For each: `--requests` requests of `--context` prompt tokens run together; the steps until
each has its first token are the prefill, the rest decode at that context. Reported: the KV
blocks a request holds once its prompt is in (every group, in tokens of one layer, and in
MiB), and prefill and decode tokens/s.

What to expect: KV per request at 4k context falls to (4 x 4096 + 22 x ~530) / (26 x 4096),
about a quarter; decode reads the weights (about 2 GB in bf16) plus each request's KV, so it
gains only what the skipped KV reads were worth at this batch (a tenth or so).

    python benchmarks/throughput.py --sliding-window            # 4 requests at 4k context
    python benchmarks/sliding_window.py --context 4096 --requests 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from jllm import LLM, SamplingParams

CONFIG = os.path.join(os.path.dirname(__file__), "gpu", "configs", "gemma-3-1b")


def config_dir(windows: bool) -> str:
    """The config-only folder, or a copy whose window covers every context (off)."""
    if windows:
        return CONFIG
    out = tempfile.mkdtemp(prefix="gemma3-no-window-")
    with open(os.path.join(CONFIG, "config.json")) as f:
        config = json.load(f)
    config["sliding_window"] = config["max_position_embeddings"]  # never binds
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def held_tokens(kv, layers: list[int], request_id: str) -> int:
    """Blocks a request holds, each weighted by its group's layers, in one layer's tokens."""
    held = kv.block_ids(request_id)
    return kv.block_size * sum(
        sum(b != 0 for b in blocks) * n for blocks, n in zip(held, layers, strict=True)
    )


def _generated(engine, request_id: str, max_tokens: int) -> int:
    req = engine.scheduler.requests.get(request_id)
    return max_tokens if req is None else req.num_output_tokens


def measure(windows: bool, args) -> dict:
    path = config_dir(windows)
    llm = LLM(
        path,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.context + args.max_tokens,
        max_num_seqs=args.requests,
        disable_log_stats=True,
    )
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache
    layers = [spec.num_layers for spec in engine.runner.kv_groups]
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, args.context).tolist()}
        for _ in range(args.requests)
    ]
    warm = {"prompt_token_ids": rng.integers(3, vocab, 64).tolist()}
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)  # first-step costs
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), *engine.prepare(prompt, params))
    start = time.perf_counter()
    # Prefill: until every request has its first token (the steps mix in a few decodes).
    while any(_generated(engine, str(i), args.max_tokens) == 0 for i in range(args.requests)):
        engine.step()
    prefill = time.perf_counter() - start
    held = held_tokens(kv, layers, "0")  # at full context, into decode
    before = sum(_generated(engine, str(i), args.max_tokens) for i in range(args.requests))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    decode = time.perf_counter() - start
    generated = args.requests * args.max_tokens - before
    spec = engine.runner.kv_groups[0]
    token_bytes = 2 * spec.num_kv_heads * spec.head_size * engine.dtype.itemsize
    if path != CONFIG:
        shutil.rmtree(path)
    return {
        "held": held,
        "mib": held * token_bytes / 2**20,
        "prefill_tok_s": args.requests * args.context / prefill,
        "decode_tok_s": generated / decode,
    }


def run(args) -> None:
    rows = {name: measure(windows, args) for name, windows in (("windows", True), ("off", False))}
    print(f"\n{args.requests} requests at {args.context} tokens of context, {args.dtype}")
    print(
        "| windows | KV per request (tokens x layers) | KV per request (MiB) | "
        "prefill tok/s | decode tok/s |\n|---|---|---|---|---|"
    )
    for name, r in rows.items():
        print(
            f"| {name} | {r['held']:,} | {r['mib']:.1f} | {r['prefill_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.1f} |"
        )
    on, off = rows["windows"], rows["off"]
    print(
        f"windows / off: KV per request {on['held'] / off['held']:.2f}x, decode "
        f"{on['decode_tok_s'] / off['decode_tok_s']:.2f}x"
    )


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(ap)
    ap.add_argument("--dtype", default="auto")
    run(ap.parse_args())

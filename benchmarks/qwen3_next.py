"""Long-context decode on a linear-attention hybrid: a Qwen3.5-shaped model (three gated
DeltaNet layers to one gated full-attention layer) beside its dense twin (the same
attention in every layer), in one run.

Both are scaled to this machine from Qwen3-Next-80B-A3B's layer shapes (attention: 16 heads
of 256, 2 kv heads, a quarter of each head rotated; DeltaNet: 16 key heads and 32 value heads
of 128, 4 conv taps): hidden 1024, 8 layers, a dense MLP of 3072 (Qwen3.5's dense form, so
that the attention kinds are all that differ), random weights (`load_format="dummy"`),
bf16 by default. Each model prefills `--requests` prompts of `--context` tokens (the cold
prefill time is printed), then runs them again from the prefix cache (the hybrid resumes
from the state snapshot at the last multiple of 64 tokens, the dense twin from the last full
block) twice: with 1 token and with 65; the decode rate is 64 tokens a request over the
difference (the small prefill they share cancels out). Also printed: the KV-cache bytes one
request holds at that context (the DeltaNet's state is fixed; attention grows with it).

    python benchmarks/qwen3_next.py --context 4096 --requests 4

`--chat`: the hybrid alone under a multi-turn chat load (`--requests` conversations of
`--turns` turns: a `--context`-token history, then each turn 64 new user tokens and a
32-token answer, the conversations of a turn submitted together), with state snapshots
(`mamba_cache_mode="align"`, the default) and without (`"none"`: no prefix hit on a hybrid,
as in vLLM before its align mode); printed per turn: the prompt tokens the prefix cache
served and the mean time to first token.

    python benchmarks/qwen3_next.py --chat --context 1024 --requests 4 --turns 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import time

import numpy as np

HIDDEN, LAYERS, MLP = 1024, 8, 3072
DECODE = 64


def config_dir(hybrid: bool, max_len: int) -> str:
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "layer_types": [
            "full_attention" if not hybrid or i % 4 == 3 else "linear_attention"
            for i in range(LAYERS)
        ],
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        "max_position_embeddings": max_len,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    out = tempfile.mkdtemp(prefix="qwen3-next-bench-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def make_engine(path: str, dtype: str, max_len: int, requests: int, **extra):
    """The model at `path` with random weights, 4 GiB of KV cache, `requests` at once."""
    from jllm import LLM

    return LLM(
        path,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_len,
        max_num_seqs=max(requests, 2),
        kv_cache_memory_bytes=(4 << 30),
        disable_log_stats=True,
        **extra,
    )


def _chat(mode: str, dtype: str, context: int, requests: int, turns: int) -> list:
    """Per turn: (prompt tokens, of which cached, mean time to first token in s)."""
    from jllm import SamplingParams

    max_len = context + turns * 96 + 16
    path = config_dir(True, max_len)
    llm = make_engine(path, dtype, max_len, requests, mamba_cache_mode=mode)
    rng = np.random.default_rng(0)
    histories = [rng.integers(3, 150000, context).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    rows = []
    for _ in range(turns):
        for h in histories:
            h.extend(rng.integers(3, 150000, 64).tolist())
        prompts = [{"prompt_token_ids": list(h)} for h in histories]
        outs = llm.generate(prompts, params, use_tqdm=False)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        rows.append((prompt, cached, sum(ttft) / len(ttft)))
        for h, out in zip(histories, outs, strict=True):
            h.extend(out.outputs[0].token_ids)
    shutil.rmtree(path)
    return rows


def chat(args, spawn) -> None:
    results = {}
    for mode in ("align", "none"):
        with spawn.Pool(1) as pool:
            argv = (mode, args.dtype, args.context, args.requests, args.turns)
            results[mode] = pool.apply(_chat, argv)
    print(
        f"\n{args.requests} conversations, {args.context}-token histories, {args.turns} turns "
        f"of 64 user + 32 answer tokens ({args.dtype})\n"
    )
    print(
        "| turn | prompt tokens | cached, snapshots | cached, none | TTFT snapshots | TTFT none |"
    )
    print("|---|---|---|---|---|---|")
    for t, (a, n) in enumerate(zip(results["align"], results["none"], strict=True)):
        print(f"| {t + 1} | {a[0]} | {a[1]} | {n[1]} | {a[2]:.2f} s | {n[2]:.2f} s |")


def _measure(hybrid: bool, dtype: str, context: int, requests: int) -> dict:
    from jllm import SamplingParams

    max_len = context + DECODE + 16
    path = config_dir(hybrid, max_len)
    llm = make_engine(path, dtype, max_len, requests)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, 150000, context).tolist()} for _ in range(requests)
    ]

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    cold = run(1)  # the prompts' prefill, cached for the runs below
    first = run(1)
    whole = run(DECODE + 1)
    engine = llm.llm_engine
    cache = engine.scheduler.kv_cache
    kv = 0
    for spec in cache.specs:
        blocks = spec.num_blocks(context + DECODE, cache.block_size)
        kv += blocks * spec.page_size_bytes(cache.block_size, engine.dtype)
    shutil.rmtree(path)
    return {
        "decode": requests * DECODE / (whole - first),
        "ttft": cold,
        "kv": kv,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chat", action="store_true", help="the multi-turn chat load")
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    spawn = multiprocessing.get_context("spawn")
    if args.chat:
        return chat(args, spawn)
    rows = {}
    for name, hybrid in (("hybrid (3 DeltaNet : 1 attention)", True), ("dense twin", False)):
        with spawn.Pool(1) as pool:  # one engine per process: their executables apart
            rows[name] = pool.apply(_measure, (hybrid, args.dtype, args.context, args.requests))
    print(
        f"\n{args.requests} requests x {args.context} tokens, then {DECODE} decode steps "
        f"({args.dtype})\n"
    )
    print("| model | decode tok/s | prefill (all prompts) s | KV bytes / request |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['decode']:.1f} | {r['ttft']:.1f} | {r['kv'] / 2**20:.1f} MiB |")
    hybrid, dense = rows.values()
    print(
        f"hybrid / dense: decode {hybrid['decode'] / dense['decode']:.2f}x, prefill time "
        f"{hybrid['ttft'] / dense['ttft']:.2f}x, KV per request {hybrid['kv'] / dense['kv']:.2f}x"
    )


if __name__ == "__main__":
    main()

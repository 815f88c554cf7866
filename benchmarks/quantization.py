"""Quantized weights against the float engine, in one run (`throughput.py --quantization`).

SmolLM2-135M-Instruct from the embedded GGUF. The float engine dequantizes the file on load;
"gguf" keeps its Q4_1 matrices and Q8_0 embedding as they are; "fp8" and "tpu_int8" quantize
a safetensors copy of the same dequantized weights (written to a temporary folder) on load;
"awq" and "gptq" read that copy written as a 4-bit AWQ / GPTQ checkpoint (min-max rounding
by tests/quantized_checkpoints.py, group size 64: SmolLM2's 576 inputs are not a multiple of
the usual 128).
Every engine runs in the same dtype (the float engine's `dtype="auto"`, or `--dtype`), on
W1 (64 x 128 in x 128 out) and S1 (one 128-token prompt, 128 out), and reports its weights'
bytes as stored and its KV-cache blocks (the CPU cache is a fixed 4 GiB).

    python benchmarks/throughput.py --quantization gguf tpu_int8 fp8 awq gptq
    python benchmarks/throughput.py --quantization --kv-cache-dtype fp8 fp8_e5m2

`--kv-cache-dtype` adds rows with the float weights and a float8 KV cache (the CPU cache's
fixed bytes then hold twice the blocks).

Run on its own, it times the decode kernel (`pallas_kernels/cpu/quantized_matmul.cc`) per code kind
on one [1536, 576] weight (SmolLM2's down projection), ms per call at 1, 8 and 16 bf16 rows,
with the float32 kernel on float32 weights of the same shape for scale:

    python benchmarks/quantization.py
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import jax
import numpy as np

from jllm import LLM

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
CHECKPOINT_CONFIGS = {  # quantization_config of the AWQ / GPTQ copies
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
             "sym": False},
}  # fmt: skip


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


def run(methods: list[str], dtype: str, workloads: dict, run_jllm, kv_dtypes=()) -> None:
    """`methods` (quantization=) each with the float KV cache, then the float weights with
    each of `kv_dtypes` (kv_cache_dtype=), against the float engine."""
    rows = []
    engines = [(None, "auto"), *((m, "auto") for m in methods)]
    engines += [(None, kv) for kv in kv_dtypes if kv != "auto"]
    with tempfile.TemporaryDirectory() as folder:
        hf_dir = None
        for method, kv_dtype in engines:
            model = None
            if method in ("fp8", "tpu_int8", "awq", "gptq"):
                hf_dir = hf_dir or float_checkpoint(os.path.join(folder, "float"))
                model = hf_dir
            if method in CHECKPOINT_CONFIGS:
                from quantized_checkpoints import quantize_checkpoint

                model = os.path.join(folder, method)
                quantize_checkpoint(hf_dir, model, CHECKPOINT_CONFIGS[method])
            llm = LLM(
                model,
                quantization=method,
                kv_cache_dtype=kv_dtype,
                dtype=dtype,
                disable_log_stats=True,
            )
            dtype = llm.llm_engine.dtype.name  # every engine in the float engine's dtype
            runner = llm.llm_engine.runner
            weight_bytes = sum(a.nbytes for a in jax.tree.leaves(runner.state))
            run_jllm(llm, workloads["W1"][:8], "warm-up")
            w1 = run_jllm(llm, workloads["W1"], "W1")
            s1 = run_jllm(llm, workloads["S1"], "S1")
            blocks = runner.layout.num_blocks
            name = method or "none (float)"
            if kv_dtype != "auto":
                name = f"kv_cache_dtype={kv_dtype}"
            rows.append((name, weight_bytes, blocks, w1, s1))
            print(f"{name}: W1 {w1['tok_s']:.1f} tok/s, S1 {s1['tok_s']:.1f} tok/s", flush=True)
            del llm, runner
            gc.collect()
            # Each engine compiles its own buckets: without this, six engines' executables
            # in one process ran out of the mappings LLVM's JIT allocates (vm.max_map_count)
            jax.clear_caches()
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


def kernel_table(rows=(1, 8, 16), out=576, width=1536, calls=200) -> None:
    """ms per call of the quantized decode kernel, one weight per code kind."""
    import jax.numpy as jnp
    from attention import timings

    from jllm.models import f32_matmul
    from jllm.quantization import cpu_kernel
    from jllm.quantization.checkpoints import _weight
    from jllm.quantization.formats import quantize_online

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((out, width), dtype=np.float32) * 0.05
    q4 = rng.integers(0, 16, (out, width), dtype=np.uint8)
    groups = (out, width // 32)
    weights = {
        "int8 (tpu_int8)": quantize_online(dense, "tpu_int8"),
        "uint4 (group 32)": _weight(q4, np.full(groups, 8.0), rng.random(groups) * 0.01, 4),
        "fp8 (e4m3)": quantize_online(dense, "fp8"),
    }
    weights = {name: jax.tree.map(jnp.asarray, w) for name, w in weights.items()}
    w32 = jnp.asarray(dense.T)
    quantized = jax.jit(lambda x, w: cpu_kernel.cpu_matmul(x, w, jnp.float32))
    f32 = jax.jit(f32_matmul.f32_matmul)

    def ms(fn, *args):  # median of `calls`, after one warm-up call
        return np.median(timings(lambda: fn(*args).block_until_ready(), calls)) * 1e3

    print(f"ms per call, one [{width}, {out}] weight, bf16 rows (median of {calls}):")
    print("| rows | " + " | ".join(weights) + " | float32 kernel, float32 weight |")
    print("|---|" + "---|" * (len(weights) + 1))
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, width)), jnp.bfloat16)
        cells = [ms(quantized, x, w) for w in weights.values()]
        cells.append(ms(f32, x.astype(jnp.float32), w32))
        print(f"| {t} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    kernel_table()

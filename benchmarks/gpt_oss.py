"""gpt-oss on the CPU: its experts as released (MXFP4, 4.25 bits a weight) beside the same
model with bf16 experts, in one run.

The model is gpt-oss-20b's layer shape (`benchmarks/gpu/configs/gpt-oss-20b`: hidden 2880, 64
query heads and 8 kv heads of 64 with sinks, 128-token windows every other layer, 32 experts
of 2880, 4 per token) with fewer layers to fit this machine (`--layers`, default 4), random
weights (`load_format="dummy"`): the MXFP4 folder keeps the release's `quantization_config`,
the bf16 one drops it. Printed per model: the experts' bytes as held (all of them, and what
one decode step reads at batch 64 when its tokens reach every expert), W1 and S1 tokens/s.

    python benchmarks/throughput.py --gpt-oss
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np

from jllm import LLM

CONFIG = os.path.join(os.path.dirname(__file__), "gpu", "configs", "gpt-oss-20b")


def config_dir(mxfp4: bool, layers: int) -> str:
    with open(os.path.join(CONFIG, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    config["layer_types"] = config["layer_types"][:layers]
    if not mxfp4:
        del config["quantization_config"]
    out = tempfile.mkdtemp(prefix="gpt-oss-bench-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def expert_bytes(llm) -> int:
    """Bytes of the experts' weights as the engine holds them (codes and scales)."""
    state = llm.llm_engine.runner.state
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return sum(
        a.nbytes for path, a in leaves if "experts" in jax.tree_util.keystr(path) and a.ndim >= 3
    )


def run(args, w1, s1, run_jllm) -> None:
    rng = np.random.default_rng(args.seed)
    loads = {"W1": w1(rng), "S1": s1(rng)}
    rows = {}
    for name, mxfp4 in (("mxfp4", True), ("bf16", False)):
        path = config_dir(mxfp4, args.gpt_oss_layers)
        llm = LLM(
            path,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=1024,
            disable_log_stats=True,
        )
        run_jllm(llm, w1(np.random.default_rng(99))[:8], "warm-up")
        rows[name] = {w: run_jllm(llm, reqs, w)["tok_s"] for w, reqs in loads.items()}
        rows[name]["bytes"] = expert_bytes(llm)
        del llm
        shutil.rmtree(path)
    layers = args.gpt_oss_layers
    print(f"\ngpt-oss-20b's layers x {layers}, bf16 activations")
    print("| experts | held (GiB) | W1 tok/s | S1 tok/s |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['bytes'] / 2**30:.2f} | {r['W1']:.1f} | {r['S1']:.1f} |")
    a, b = rows["mxfp4"], rows["bf16"]
    print(
        f"mxfp4 / bf16: bytes {a['bytes'] / b['bytes']:.2f}x, W1 {a['W1'] / b['W1']:.2f}x, "
        f"S1 {a['S1'] / b['S1']:.2f}x"
    )

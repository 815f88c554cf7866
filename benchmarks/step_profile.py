"""Where an engine step's time goes on the CPU: a JAX profiler trace of some steps of W1
(64 requests of 128 tokens in, decoding), W3 (the chat-like mix) or S1 (one stream), with
XLA's per-thunk trace events on, attributed by wall clock.

    python benchmarks/step_profile.py                 # W1 decode steps, the embedded SmolLM2
    python benchmarks/step_profile.py --workload W3 --skip 30 --steps 20
    python benchmarks/step_profile.py --skip 0 --steps 3 --dtype bfloat16   # W1's prefill
    python benchmarks/step_profile.py --workload S1 --deepseek moe   # benchmarks/deepseek.py's

Attribution: each instant of the traced steps is split evenly over the XLA thunks running
then (XLA runs independent thunks side by side on its worker threads, so summing their
durations overstates whichever overlap), and instants with none running count as idle (the
host's part of the step, or a thunk waiting on its pool). Thunks are named from the step
executable's HLO: the C++ kernels by custom-call target (`jllm_f32_matmul_cpu`, ...), XLA's
products (YNNPACK fusions and dots) and the per-layer weight copies (dynamic slices and
copies of the stacked weights the layer scan makes) by kind, the rest as XLA's own fusions
(norms, RoPE, the sampler's passes, the KV write). The traced steps should share one bucket
(the buckets seen are printed): names are read from the last step's executable. The trace
adds its own overhead (compare the traced step with the untraced one printed first).
"""

from __future__ import annotations

import argparse
import collections
import glob
import logging
import os
import re
import sys
import tempfile
import time

# XLA's CPU thunks emit trace events only with this flag; set before JAX starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.lib import _profile_data  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from throughput import s1, w1, w3  # noqa: E402

from jllm import LLM, SamplingParams  # noqa: E402

# Thunk trace events that are not thunks: the executor, the pool, Python, the scan's loop.
NOT_THUNKS = re.compile(r"^(ThunkExecutor|SlinkyThreadPool|\$|Pjit|Thunk|while|ThreadpoolListener)")


def label(name: str, hlo: str) -> str:
    """What the thunk `name` is, from the executable's HLO text."""
    call = re.search(
        r"%" + re.escape(name) + r" = \S+ custom-call\(.*?custom_call_target=\"(\w+)\"", hlo
    )
    if call:
        return "C++ " + call.group(1).removeprefix("jllm_").removesuffix("_cpu")
    if re.match(r"(ynn_fusion|xnn_fusion|dot|.*convolution)", name):
        return "XLA's matrix products"
    if re.match(r"(dynamic-slice|copy)", name):
        return "per-layer weight copies"
    return "XLA's other fusions"


def attribute(events, steps: int) -> tuple[collections.Counter, float]:
    """events: (start ns, end ns, thunk name). Per thunk name, ms per step of wall clock,
    each instant split evenly over the thunks running then; and the idle ms per step
    between the first event and the last."""
    edges = sorted([(a, 1, n) for a, _, n in events] + [(b, -1, n) for _, b, n in events])
    share: collections.Counter = collections.Counter()
    running: collections.Counter = collections.Counter()
    idle, last = 0, None
    for t, change, name in edges:
        if last is not None and t > last:
            count = sum(running.values())
            if count == 0:
                idle += t - last
            for n, k in running.items():
                if k:
                    share[n] += (t - last) * k / count
        running[name] += change
        last = t
    per_step = collections.Counter({n: ns / 1e6 / steps for n, ns in share.items()})
    return per_step, idle / 1e6 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=["W1", "W3", "S1"], default="W1")
    ap.add_argument("--skip", type=int, default=20, help="steps run before the trace")
    ap.add_argument("--steps", type=int, default=10, help="steps traced")
    ap.add_argument("--top", type=int, default=12, help="thunks listed by name")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--deepseek",
        choices=["moe", "mla", "twin"],
        help="benchmarks/deepseek.py's DeepSeek-V2-Lite shape (moe), MLA with the twin's MLP "
        "(mla) or the dense twin, random weights, instead of SmolLM2",
    )
    args = ap.parse_args()
    logging.disable(logging.INFO)
    if args.deepseek:
        import deepseek

        path = deepseek.config_dir(dense=args.deepseek == "twin", experts=args.deepseek == "moe")
        llm = deepseek.engine(path, args.dtype)
    else:
        llm = LLM(dtype=args.dtype, disable_log_stats=True)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    reqs = {"W1": w1, "W3": w3, "S1": s1}[args.workload](rng)
    for i, (prompt, n) in enumerate(reqs):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(str(i), *engine.prepare({"prompt_token_ids": prompt}, params))
    for _ in range(args.skip):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    untraced = (time.perf_counter() - t0) / args.steps
    running = len(engine.scheduler.running)
    runner = engine.runner
    seen, forward = [], runner.forward_for

    def traced_forward(key):  # the buckets the traced steps run
        seen.append(key)
        return forward(key)

    runner.forward_for = traced_forward
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                engine.step()
        traced = (time.perf_counter() - t0) / args.steps
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        profile = _profile_data.ProfileData.from_file(path)
        events = [
            (ev.start_ns, ev.start_ns + ev.duration_ns, ev.name)
            for plane in profile.planes
            for line in plane.lines
            if line.name.startswith("tf_XLA")  # XLA's threads run the thunks
            for ev in line.events
            if not NOT_THUNKS.match(ev.name)
        ]
    del runner.forward_for  # the method again
    hlo = runner.forward_for(seen[-1]).as_text() if seen else ""
    while engine.has_unfinished_requests():
        engine.step()

    per_thunk, idle = attribute(events, args.steps)
    print(f"\n{args.workload}, {running} requests running; dtype {engine.dtype.name}")
    print(f"buckets traced (decode rows, prefill tiles): {sorted(set(seen))}")
    print(f"step: {untraced * 1e3:.1f} ms untraced, {traced * 1e3:.1f} ms traced")
    totals = collections.Counter()
    for name, ms in per_thunk.items():
        totals[label(name, hlo)] += ms
    totals["idle (no thunk running)"] = idle
    span = sum(totals.values())
    print("| part | wall ms per step | share |")
    print("|---|---|---|")
    for part, ms in totals.most_common():
        print(f"| {part} | {ms:.1f} | {ms / span:.0%} |")
    print(f"| traced span | {span:.1f} | |")
    print("\nlargest thunks (wall ms per step): ", end="")
    top = per_thunk.most_common(args.top)
    print(", ".join(f"{name} ({label(name, hlo)}) {ms:.1f}" for name, ms in top))


if __name__ == "__main__":
    main()

"""Where an engine step's time goes on the CPU: a JAX profiler trace of some steps of W1
(64 requests of 128 tokens in, decoding) or W3 (the chat-like mix), with XLA's per-thunk
trace events on, summed per category per step.

    python benchmarks/step_profile.py                 # W1 decode steps, the embedded SmolLM2
    python benchmarks/step_profile.py --workload W3 --skip 30 --steps 20

Categories, by the XLA CPU thunk names of this JAX (0.12): `ynn_fusion*`/`xnn_fusion*` and
`dot*` are matrix products (XLA hands them to YNNPACK); `ffi_call*` the C++ attention kernel
(and the quantized-matmul kernel, when on); `dynamic-slice*`/`copy*` the per-layer copies of
the stacked weights that the layer scan makes; the rest, XLA's own fusions (norms, RoPE,
the sampler's passes, the KV write). Times are summed over the worker threads' events, so
they are the wall time of the thunks that ran one after another in a step; the trace adds
its own overhead (compare the traced step with the untraced one printed first).
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

CATEGORIES = [
    ("matrix products (YNNPACK)", re.compile(r"^(ynn_fusion|xnn_fusion|dot|.*convolution)")),
    ("attention / C++ kernels (FFI)", re.compile(r"^(ffi_call|custom-call)")),
    ("per-layer weight copies", re.compile(r"^(dynamic-slice|copy)")),
    ("other XLA fusions", re.compile(r".")),
]
NOT_THUNKS = re.compile(r"^(ThunkExecutor|SlinkyThreadPool|\$|Pjit|Thunk)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=["W1", "W3", "S1"], default="W1")
    ap.add_argument("--skip", type=int, default=20, help="steps run before the trace")
    ap.add_argument("--steps", type=int, default=10, help="steps traced")
    ap.add_argument("--top", type=int, default=12, help="thunks listed by name")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    logging.disable(logging.INFO)
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
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                engine.step()
        traced = (time.perf_counter() - t0) / args.steps
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        profile = _profile_data.ProfileData.from_file(path)
        by_name: dict[str, float] = collections.defaultdict(float)
        for plane in profile.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLAEigen"):
                    continue  # XLA's worker threads run the thunks
                for ev in line.events:
                    if not NOT_THUNKS.match(ev.name):
                        by_name[ev.name] += ev.duration_ns / 1e6 / args.steps
    while engine.has_unfinished_requests():
        engine.step()

    print(f"\n{args.workload}, {running} requests running; dtype {engine.dtype.name}")
    print(f"step: {untraced * 1e3:.1f} ms untraced, {traced * 1e3:.1f} ms traced")
    totals = collections.Counter()
    for name, ms in by_name.items():
        cat = next(c for c, pattern in CATEGORIES if pattern.match(name))
        totals[cat] += ms
    thunks = sum(totals.values())
    print("| category | ms per step | share of the thunks |")
    print("|---|---|---|")
    for cat, _ in CATEGORIES:
        print(f"| {cat} | {totals[cat]:.1f} | {totals[cat] / thunks:.0%} |")
    print(f"| all thunks | {thunks:.1f} | |")
    print("\nlargest thunks (ms per step): ", end="")
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]
    print(", ".join(f"{name} {ms:.1f}" for name, ms in top))


if __name__ == "__main__":
    main()

"""The device sampler alone: ms per call at SmolLM2's vocabulary (49152) by batch mix.

    python benchmarks/sampler.py              # R = 1, 64, 256
    python benchmarks/sampler.py --rows 64

Mixes: greedy (the throughput benchmarks' case), plain temperature, peaked top-p (kept set
inside the 256 candidates), flat top-p (kept set beyond them: the vocabulary path with its
bisection), and a batch of mixed rows. Logits are random normal with a scale per mix.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jllm.runner.sampler import SamplingMetadata, sample

V = 49152
MIXES = {  # (logit scale, temperature, top_k, top_p, min_p)
    "greedy": (3.0, 0.0, 0, 1.0, 0.0),
    "temperature": (3.0, 0.8, 0, 1.0, 0.0),
    "top-p peaked": (8.0, 0.8, 0, 0.9, 0.0),
    "top-p flat": (0.3, 1.0, 0, 0.9, 0.0),
    "top-k 50 + min-p": (3.0, 1.0, 50, 1.0, 0.05),
}


def metadata(R, temperature, top_k, top_p, min_p):
    f = lambda v, dt: jnp.full((R,), v, dt)  # noqa: E731
    return SamplingMetadata(
        temperature=f(temperature, jnp.float32),
        top_p=f(top_p, jnp.float32),
        top_k=f(top_k, jnp.int32),
        min_p=f(min_p, jnp.float32),
        seed_lo=jnp.arange(R, dtype=jnp.uint32),
        seed_hi=f(0, jnp.uint32),
        counter=f(3, jnp.int32),
        presence=f(0, jnp.float32),
        frequency=f(0, jnp.float32),
        repetition=f(1, jnp.float32),
        penalty_rows=f(0, jnp.int32),
        suppress=jnp.full((R, 16), V, jnp.int32),
        want_logprobs=f(False, jnp.bool_),
        want_top=f(False, jnp.bool_),
        bias_rows=f(0, jnp.int32),
        masked=f(False, jnp.bool_),
        processors=(),
        batch_row=jnp.arange(R, dtype=jnp.int32),
        draft=f(-1, jnp.int32),
        group_first=jnp.arange(R, dtype=jnp.int32),
        spec_prev=jnp.full((R, 1), V, jnp.int32),
    )


def time_call(logits, md, counts, mask, repeats=20):
    last = jnp.zeros(logits.shape[0] + 1, jnp.int32)
    bias = jnp.zeros(counts.shape, jnp.float32)
    bitmask = jnp.zeros((logits.shape[0], (logits.shape[1] + 31) // 32), jnp.int32)
    args = (bias, last, bitmask)
    out, counts, last = sample(logits, md, counts, mask, *args, num_logprobs=20)  # donated
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out, counts, last = sample(logits, md, counts, mask, bias, last, bitmask, num_logprobs=20)
        jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    args = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, V={V}")
    print(f"{'mix':<20}" + "".join(f"{f'R={r} ms':>12}" for r in args.rows))
    rng = np.random.default_rng(0)
    for name, (scale, *params) in MIXES.items():
        row = [name]
        for R in args.rows:
            logits = jnp.asarray(rng.normal(0, scale, (R, V)).astype(np.float32))
            counts = jnp.zeros((2, V), jnp.int32)
            mask = jnp.zeros((2, V), bool)
            row.append(time_call(logits, metadata(R, *params), counts, mask))
        print(f"{row[0]:<20}" + "".join(f"{x:>12.2f}" for x in row[1:]))


if __name__ == "__main__":
    main()

"""The CPU attention kernel against torch's attention, side by side in one run.

SmolLM2-135M's heads (9 query heads over 3 kv heads, head dim 64), 30 layers of one stacked
paged cache (block size 16, block tables randomly permuted), as the engine's steps call it:
- `prefill`: a chat-like 2048-token prefill step, 18 prompts of 18-340 tokens (lengths drawn
  as in W3), each causal over itself;
- `decode`: 64 decode rows at 129-192-token contexts.
Engines:
- `kernel`: pallas_kernels/ragged_paged_attention/cpu_kernel.cc, one call per layer;
- `torch`: torch.nn.functional.scaled_dot_product_attention over contiguous K/V (no pages:
  an easier layout than the kernel's), per prompt for prefill (causal), one masked batch for
  decode, with torch's threads set to this machine's cores. A reference point for the
  arithmetic, not vLLM's own CPU attention.
`--kv-cache-dtype fp8_e4m3 fp8_e5m2` adds the same cases over a float8 cache (the kernel
decodes its bytes as it reads them; torch gets the decoded values in the query's dtype).
`--sliding-window W` and `--soft-cap C` time the kernel with a layer's window and score cap
(torch is then not run: its timing would be of other work); `--decode-context` sets the
decode rows' context range, e.g. 2048 2049 to see what a window saves.
Per case: the median and best of `--repeats` timings of all 30 layers, the kernel's rate in
GFLOP/s of the causal work (2 x 2 x pairs x heads x head dim), torch / kernel at the best,
and the kernel's largest difference from the float32 jnp reference on one layer.

    python benchmarks/attention.py                      # float32 and bfloat16
    python benchmarks/attention.py --dtype float32 --cases prefill
    python benchmarks/attention.py --cases decode --kv-cache-dtype auto fp8_e4m3 fp8_e5m2
    python benchmarks/attention.py --cases decode --decode-context 2048 2049 --sliding-window 128
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention_cpu,
    ragged_paged_attention_reference,
)

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 30, 3, 3, 64, 16
KV_DTYPES = {"auto": None, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
HEADS = KV_HEADS * GROUP


def prefill_lengths(rng, total=2048) -> list[int]:
    """Prompt lengths as W3 draws them (log-normal around 120, 16-512), filling `total`."""
    lens: list[int] = []
    while sum(lens) < total:
        n = int(np.clip(rng.lognormal(np.log(120), 0.8), 16, 512))
        lens.append(min(n, total - sum(lens)))
    return lens


def build(case: str, dtype, rng, kv_dtype=None, decode_context=(129, 193)):
    """The kernel's arguments and the per-request (query count, context length) pairs; the
    cache in `kv_dtype` (a float8 dtype) or, by default, the queries' dtype."""
    if case == "prefill":
        kv_lens = prefill_lengths(rng)
        q_lens = kv_lens
    else:
        kv_lens = [int(n) for n in rng.integers(*decode_context, 64)]
        q_lens = [1] * len(kv_lens)
    r = len(kv_lens)
    pages = max(-(-n // BLOCK) for n in kv_lens)
    blocks = r * pages + 8
    tables = rng.permutation(blocks)[: r * pages].reshape(r, pages).astype(np.int32)
    shape = (LAYERS, blocks, BLOCK, 2 * KV_HEADS, HEAD_DIM)
    cache = jnp.asarray(rng.standard_normal(shape), kv_dtype or dtype)
    q = jnp.asarray(rng.standard_normal((sum(q_lens), HEADS, HEAD_DIM)), dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    meta = (
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(starts),
        jnp.asarray(q_lens, jnp.int32),
        r,
    )
    return q, cache, meta, list(zip(q_lens, kv_lens, strict=True)), tables


def causal_flops(requests) -> float:
    pairs = sum(q * (kv - q) + q * (q + 1) / 2 for q, kv in requests)
    return 4.0 * pairs * HEADS * HEAD_DIM * LAYERS


def timings(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def kernel_runner(q, cache, meta, **options):
    """`options`: the layer's sliding_window and soft_cap (None: off)."""
    kv_lens, tables, starts, q_lens, r = meta
    call = jax.jit(
        lambda q, cache, layer: ragged_paged_attention_cpu(
            q, cache, kv_lens, tables, starts, q_lens, r, layer=layer, **options
        )
    )

    def run():
        for layer in range(LAYERS):
            out = call(q, cache, layer)
        out.block_until_ready()

    def error() -> float:
        out = call(q, cache, 3).astype(jnp.float32)
        ref = ragged_paged_attention_reference(
            q.astype(jnp.float32),
            cache[3].astype(jnp.float32),
            kv_lens,
            tables,
            starts,
            q_lens,
            r,
            **options,
        )
        return float(jnp.max(jnp.abs(out - ref)))

    return run, error


def torch_runner(case, q, cache, requests, tables):
    """Contiguous per-request K/V gathered from the paged cache once, up front."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    tdtype = torch.float32 if q.dtype == jnp.float32 else torch.bfloat16
    as_torch = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32))).to(tdtype)  # noqa: E731
    cache_np = np.asarray(cache.astype(jnp.float32))
    qs = as_torch(q)
    layers = []
    for layer in range(LAYERS):
        ks, vs = [], []
        for r, (_, kv) in enumerate(requests):
            rows = cache_np[layer, tables[r]].reshape(-1, 2 * KV_HEADS, HEAD_DIM)[:kv]
            ks.append(torch.from_numpy(np.ascontiguousarray(rows[:, 0::2].transpose(1, 0, 2))))
            vs.append(torch.from_numpy(np.ascontiguousarray(rows[:, 1::2].transpose(1, 0, 2))))
        layers.append(([k.to(tdtype) for k in ks], [v.to(tdtype) for v in vs]))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    if case == "prefill":
        starts = np.concatenate([[0], np.cumsum([n for n, _ in requests])[:-1]])
        queries = [
            qs[s : s + n].transpose(0, 1).unsqueeze(0)
            for s, (n, _) in zip(starts, requests, strict=True)
        ]

        def run():
            with torch.inference_mode():
                for ks, vs in layers:
                    for qr, k, v in zip(queries, ks, vs, strict=True):
                        sdpa(qr, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=True)

        return run

    width = max(kv for _, kv in requests)
    mask = torch.zeros(len(requests), 1, 1, width, dtype=torch.bool)
    for r, (_, kv) in enumerate(requests):
        mask[r, ..., :kv] = True
    padded = []
    for ks, vs in layers:
        k = torch.zeros(len(requests), KV_HEADS, width, HEAD_DIM, dtype=tdtype)
        v = torch.zeros_like(k)
        for r, (_, kv) in enumerate(requests):
            k[r, :, :kv], v[r, :, :kv] = ks[r], vs[r]
        padded.append((k, v))
    qd = qs.unsqueeze(2)  # [R, heads, 1, head dim]

    def run():
        with torch.inference_mode():
            for k, v in padded:
                sdpa(qd, k, v, attn_mask=mask, enable_gqa=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cases", nargs="+", default=["prefill", "decode"])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(KV_DTYPES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--soft-cap", type=float, default=None)
    parser.add_argument("--decode-context", type=int, nargs=2, default=[129, 193])
    args = parser.parse_args()
    options = dict(sliding_window=args.sliding_window, soft_cap=args.soft_cap)
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    print(f"jax {jax.__version__}, {os.cpu_count()} cores; 30 layers per timing, ms")
    if args.sliding_window or args.soft_cap:
        have_torch = False
        print(f"sliding window {args.sliding_window}, soft cap {args.soft_cap}")
    print(
        "| case | dtype | kernel median / best | GFLOP/s | torch median / best | torch / kernel |"
    )
    print("|---|---|---|---|---|---|")
    for case in args.cases:
        for name, kv in ((n, kv) for n in args.dtype for kv in args.kv_cache_dtype):
            dtype = jnp.dtype(name)
            rng = np.random.default_rng(0)
            q, cache, meta, requests, tables = build(
                case, dtype, rng, KV_DTYPES[kv], tuple(args.decode_context)
            )
            if kv != "auto":
                name = f"{name}, kv {kv}"
            run, error = kernel_runner(q, cache, meta, **options)
            err = error()
            ts = timings(run, args.repeats)
            flops = causal_flops(requests)
            row = f"| {case} | {name} | {np.median(ts) * 1e3:.1f} / {min(ts) * 1e3:.1f} | "
            # (a window skips most of the causal work the rate counts)
            row += "- | " if args.sliding_window else f"{flops / min(ts) / 1e9:.1f} | "
            if have_torch:
                tt = timings(torch_runner(case, q, cache, requests, tables), args.repeats)
                row += (
                    f"{np.median(tt) * 1e3:.1f} / {min(tt) * 1e3:.1f} | {min(tt) / min(ts):.2f}x |"
                )
            else:
                row += "- | - |"
            print(row + f"  (max error {err:.2g})", flush=True)


if __name__ == "__main__":
    main()

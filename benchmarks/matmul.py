"""The CPU matmul kernels against XLA's product and torch's, side by side in one run.

SmolLM2-135M's layer products (30 layers stacked, as the model holds them) at 1, 64 and
2048 rows (`--rows`), in the model's dtype (`--dtype`):
- `kernel`: the C++ kernel reading one layer of the stack in place. bfloat16:
  pallas_kernels/cpu/bf16_matmul.cc (float32 accumulation; the gated row: silu(x @ gate) * (x @ up)
  in one pass) on CPUs with AVX512-BF16, else pallas_kernels/cpu/f32_matmul.cc widening the bf16
  operands. float32: pallas_kernels/cpu/f32_matmul.cc (its gated form likewise), on x86 CPUs with
  FMA;
- `vector` (CPUs with AMX only): the bf16 kernel built without the tile instructions, its
  AVX512-BF16 loop at every row count (what the batch-invariant mode runs there);
- `xla`: jnp.dot on the same layer inside a jitted function, as the layer scan runs it
  without the kernel (the layer's dynamic slice, then the product; the gated row adds XLA's
  SiLU pass);
- `torch`: torch.nn.functional.linear on the layer's own [Out, In] tensor (oneDNN, what
  vLLM's CPU backend multiplies with), where torch is installed.

    python benchmarks/matmul.py                  # bf16: GFLOP/s per shape, and kernel / xla
    python benchmarks/matmul.py --dtype float32 --rows 1 8 64 128 256 512 2048
    python benchmarks/matmul.py --head --rows 1 8 32 64   # the tied LM head, bf16

`--head`: SmolLM2's tied LM head instead (x [rows, 576] @ table[49152, 576]^T, float32
out): the transposed kernel (the AMX tiles, or without AMX the vector loop) against XLA's
einsum, in ms per call; `--live-share 0.55` computes only the first 55% of each case's rows
on the kernel (a step's sample rows padded to a bucket), as the engine's head does.
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

from jllm import cpu_heap  # noqa: E402
from jllm.config import batch_invariant  # noqa: E402
from jllm.models import bf16_matmul, f32_matmul  # noqa: E402

D, F, N_HEADS, KV = 576, 1536, 9, 3
LAYERS = 30
SHAPES = {  # name: (In, Out)
    "q_proj / o_proj": (D, D),
    "k_proj / v_proj": (D, KV * 64),
    "gate_proj / up_proj": (D, F),
    "down_proj": (F, D),
}


def timed(seconds: float, fn, *args) -> float:
    """Best of three windows of repeated fn(*args), seconds per call."""

    def call():
        out = fn(*args)
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()

    call()
    best = float("inf")
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            call()
            n += 1
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def xla_product(x, stack, layer):
    return x @ stack[layer]


def xla_gated(x, gate, up, layer):
    return jax.nn.silu(x @ gate[layer]) * (x @ up[layer])


def vector(fn):
    """fn traced in the batch-invariant mode: on an AMX CPU, the kernel's build without the
    tiles."""

    def run(*args):
        with batch_invariant.scope(True):
            return fn(*args)

    return run


def head(args):
    """The tied LM head: the transposed kernel against XLA's einsum."""
    if not bf16_matmul.supported():
        sys.exit("the transposed bf16 kernel needs AVX512-BF16")
    rng = np.random.default_rng(0)
    vocab = 49152
    table = jnp.asarray(rng.normal(0, 0.02, (vocab, D)), jnp.bfloat16)
    kern = jax.jit(
        lambda x, t, live: bf16_matmul.bf16_matmul(
            x, t, transposed=True, out_dtype=jnp.float32, live=live
        )
    )
    xla = jax.jit(lambda x, t: jnp.einsum("RD,VD->RV", x, t, preferred_element_type=jnp.float32))
    print(f"host: {os.cpu_count()} cores; jax {jax.__version__}; tied LM head [{vocab}, {D}]")
    print("| rows | live rows | kernel ms | xla ms | xla / kernel |")
    print("|---|---|---|---|---|")
    for m in args.rows:
        x = jnp.asarray(rng.normal(0, 1, (m, D)), jnp.bfloat16)
        n_live = max(1, round(m * args.live_share))
        live = jnp.arange(m) < n_live
        t_k = timed(args.seconds, kern, x, table, live)
        t_x = timed(args.seconds, xla, x, table)
        print(
            f"| {m} | {n_live} | {t_k * 1e3:.2f} | {t_x * 1e3:.2f} | {t_x / t_k:.2f}x |",
            flush=True,
        )


def torch_gated(x, gate, up):
    import torch

    lin = torch.nn.functional.linear
    return torch.nn.functional.silu(lin(x, gate)) * lin(x, up)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 2048])
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--head", action="store_true", help="the tied LM head (bf16)")
    ap.add_argument(
        "--live-share", type=float, default=1.0, help="--head: the share of rows computed"
    )
    args = ap.parse_args()
    # The engine's heap: large outputs' pages reused from call to call, not mapped anew.
    cpu_heap.keep(jax.default_backend())
    if args.head:
        return head(args)
    f32 = args.dtype == "float32"
    if f32 and not f32_matmul.supported():
        sys.exit("this CPU has no FMA with AVX2: the float32 kernel does not run here")
    widened = not f32 and not bf16_matmul.supported()
    if widened and not f32_matmul.supported():
        sys.exit("this CPU has neither AVX512-BF16 nor FMA with AVX2: no bf16 kernel runs here")
    dtype = jnp.float32 if f32 else jnp.bfloat16
    try:
        import torch

        torch.set_num_threads(os.cpu_count())
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print(
        f"host: {os.cpu_count()} cores; jax {jax.__version__}; {args.dtype}"
        f"{' (f32_matmul widening bf16)' if widened else ''}; GFLOP/s (higher is better)"
    )
    amx = not f32 and not widened and "amx_bf16" in bf16_matmul.cpu_flags()
    print(f"| rows | product | kernel |{' vector |' if amx else ''} xla | torch | kernel / xla |")
    print(f"|---|---|---|{'---|' if amx else ''}---|---|---|")
    for m in args.rows:
        x_np = rng.normal(0, 1, (m, D)).astype(np.float32)
        rows = list(SHAPES.items()) + [("gated gate/up (2 products)", (D, F))]
        for name, (k, n) in rows:
            gated = name.startswith("gated")
            x = jnp.asarray(rng.normal(0, 1, (m, k)) if k != D else x_np, dtype)
            stack = jnp.asarray(rng.normal(0, 0.02, (LAYERS, k, n)), dtype)
            up = stack[::-1] if gated else None
            layer = jnp.int32(LAYERS // 2)
            if gated:
                up = stack[::-1]
                f32_kernel = f32 or widened
                pair = f32_matmul.f32_gated_matmul if f32_kernel else bf16_matmul.bf16_gated_matmul
                kern = jax.jit(pair)
                t_k = timed(args.seconds, kern, x, stack, up, layer)
                t_v = amx and timed(args.seconds, jax.jit(vector(pair)), x, stack, up, layer)
                t_x = timed(args.seconds, jax.jit(xla_gated), x, stack, up, layer)
            else:
                f32_kernel = f32 or widened
                one = f32_matmul.f32_matmul if f32_kernel else bf16_matmul.bf16_matmul
                t_k = timed(args.seconds, jax.jit(one), x, stack, layer)
                t_v = amx and timed(args.seconds, jax.jit(vector(one)), x, stack, layer)
                t_x = timed(args.seconds, jax.jit(xla_product), x, stack, layer)
            flops = 2 * m * k * n * (2 if gated else 1)
            t_t = None
            if torch is not None:
                tdtype = torch.float32 if f32 else torch.bfloat16
                xt = torch.from_numpy(np.array(x, np.float32)).to(tdtype)
                wt = torch.from_numpy(np.asarray(stack[LAYERS // 2], np.float32).T.copy())
                wt = wt.to(tdtype)
                with torch.inference_mode():
                    if gated:
                        t_t = timed(args.seconds, torch_gated, xt, wt, wt.flip(0))
                    else:
                        t_t = timed(args.seconds, torch.nn.functional.linear, xt, wt)
            torch_col = f"{flops / t_t / 1e9:.0f}" if t_t else "-"
            print(
                f"| {m} | {name} | {flops / t_k / 1e9:.0f} |"
                f"{f' {flops / t_v / 1e9:.0f} |' if amx else ''} {flops / t_x / 1e9:.0f} | "
                f"{torch_col} | {t_x / t_k:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()

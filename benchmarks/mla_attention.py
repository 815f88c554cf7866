"""MLA's latent attention on the CPU, per layer: the C++ kernel against the XLA attention on
the latent cache, beside the C++ kernel on the cache the latent compresses. One run.

DeepSeek-V2-Lite's attention shape: 16 query heads reading one latent per token of 512 + 64
lanes (`kv_lora_rank` + `qk_rope_head_dim`; its first 512 are the value), block size 16,
the queries already absorbed (as `models/deepseek.py` hands them to the backend). The dense
twin is multi-head attention of 16 heads of 128 with keys and values per head (what
transformers' expanded form would cache), on the C++ kernel. Each engine runs one layer
through its backend's `attend` (the step's latents written, then read), jitted, over a step
as the engine builds it (`FlatBatch`: decode rows, then prefill tiles):

- `decode-1`: one decode row at a 512-token context (S1's step);
- `decode-64`: 64 decode rows at 300-token contexts;
- `prefill`: one fresh 512-token prompt;
- `chunk`: 256 new tokens after 768 cached (a chunked prefill's later chunk, or a prefix hit).

Printed per case and engine: the median of `--repeats` timings in ms, and the latent
engines' ratio to the XLA attention.

    python benchmarks/mla_attention.py
    python benchmarks/mla_attention.py --dtype float32 --cases prefill chunk
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

from jllm.attention import AttentionOptions, get_backend  # noqa: E402
from jllm.attention.metadata import FlatBatch  # noqa: E402
from jllm.attention.xla import TILE, max_kv_chunk_pages  # noqa: E402

HEADS, LATENT, ROPE, DENSE_HEAD, BLOCK = 16, 512, 64, 128, 16
# The block tables' width, as the engine sizes them for benchmarks/deepseek.py's
# max_model_len (the XLA attention's gathers depend on it).
MAX_MODEL_LEN = 1024
H = LATENT + ROPE
# (context lengths of the decode rows, (cached, new) tokens of the prefill rows)
CASES = {
    "decode-1": ([512], []),
    "decode-64": ([300] * 64, []),
    "prefill": ([], [(0, 512)]),
    "chunk": ([], [(768, 256)]),
}
ENGINES = {  # name: (backend, latent)
    "cpu_kernel latent": ("cpu_kernel", True),
    "xla latent": ("xla", True),
    "cpu_kernel dense twin": ("cpu_kernel", False),
}


def flat_batch(rng, decodes, prefills, token_bytes) -> tuple[FlatBatch, int]:
    """The step: decode rows (one token each), then each prefill row on tiles of its own,
    every request's blocks drawn from a shuffled pool. -> (the batch, the blocks)."""
    rows = [(kv - 1, 1) for kv in decodes] + list(prefills)
    Rd = len(decodes)
    width = max_kv_chunk_pages(BLOCK)
    P = -(-MAX_MODEL_LEN // BLOCK // width) * width
    B = 1 + sum(-(-(d + n) // BLOCK) for d, n in rows)
    pool = iter(rng.permutation(np.arange(1, B)))
    tiles = sum(-(-n // TILE) for _, n in prefills)
    T = Rd + tiles * TILE
    R = len(rows)
    flat = FlatBatch(
        slot_mapping=np.full(T, B * BLOCK, np.int32),
        query_start=np.zeros(R, np.int32),
        query_lens=np.zeros(R, np.int32),
        kv_lens=np.zeros(R, np.int32),
        block_tables=np.zeros((R, P), np.int32),
        tile_row=np.zeros(tiles, np.int32),
        tile_q_pos=np.full((tiles, TILE), -1, np.int32),
        num_decode_rows=Rd,
        block_size=BLOCK,
        kv_token_bytes=token_bytes,
    )
    q0, tile = Rd, 0
    for r, (done, new) in enumerate(rows):
        pages = -(-(done + new) // BLOCK)
        flat.block_tables[r, :pages] = [next(pool) for _ in range(pages)]
        start = r if r < Rd else q0
        pos = np.arange(done, done + new)
        flat.query_start[r], flat.query_lens[r], flat.kv_lens[r] = start, new, done + new
        flat.slot_mapping[start : start + new] = flat.block_tables[r, pos // BLOCK] * BLOCK + (
            pos % BLOCK
        )
        if r >= Rd:
            n = -(-new // TILE)
            flat.tile_row[tile : tile + n] = r
            flat.tile_q_pos[tile : tile + n].reshape(-1)[:new] = pos
            q0, tile = q0 + n * TILE, tile + n
    return flat, B


def time_case(case: str, engine: str, dtype, repeats: int) -> float:
    """The median ms of one layer's attention."""
    backend, latent = ENGINES[engine]
    rng = np.random.default_rng(0)
    itemsize = jnp.dtype(dtype).itemsize
    token_bytes = (H if latent else 2 * HEADS * DENSE_HEAD) * itemsize
    flat, B = flat_batch(rng, *CASES[case], token_bytes)
    T = len(flat.slot_mapping)
    impl = get_backend(backend)
    md = impl.build_metadata(flat)
    if latent:
        cache = jnp.asarray(rng.normal(size=(1, B, BLOCK, H)), dtype)
        q = jnp.asarray(rng.normal(size=(T, HEADS, H)), dtype)
        k, v = jnp.asarray(rng.normal(size=(T, H)), dtype), None
        options = AttentionOptions(scale=(128 + ROPE) ** -0.5, latent=True, v_head_dim=LATENT)
    else:
        cache = jnp.asarray(rng.normal(size=(1, B, BLOCK, 2 * HEADS, DENSE_HEAD)), dtype)
        q = jnp.asarray(rng.normal(size=(T, HEADS, DENSE_HEAD)), dtype)
        k = v = jnp.asarray(rng.normal(size=(T, HEADS, DENSE_HEAD)), dtype)
        options = AttentionOptions(scale=DENSE_HEAD**-0.5)
    attend = jax.jit(lambda q, k, v, c, md: impl.attend(q, k, v, c, 0, md, options)[0])
    jax.block_until_ready(attend(q, k, v, cache, md))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(attend(q, k, v, cache, md))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    print(f"MLA attention per layer, {args.dtype}, {HEADS} heads, latent {LATENT} + {ROPE}")
    print("| case | " + " | ".join(f"{e} ms" for e in ENGINES) + " | C++ / XLA on the latent |")
    print("|---|" + "---|" * (len(ENGINES) + 1))
    for case in args.cases:
        ms = {e: time_case(case, e, dtype, args.repeats) for e in ENGINES}
        ratio = ms["xla latent"] / ms["cpu_kernel latent"]
        cells = " | ".join(f"{ms[e]:.2f}" for e in ENGINES)
        print(f"| {case} | {cells} | {ratio:.1f}x faster |", flush=True)


if __name__ == "__main__":
    main()

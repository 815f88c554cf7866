"""The kernels in the batch-invariant mode: a row's result is the same bits whatever rows
share the call. Attention: one query's output is the same as a decode row alone, as the last
or a middle row of a prefill chunk, and beside other requests, on the C++ kernel's scalar
(head dim 16) and vector (64) routines and on the Pallas TPU and GPU kernels in interpret
mode (the GPU kernel compiled for the device too, `gpu`-marked), float32 and bf16, with
and without a window; the layer products (float32, its gated form and its transposed LM
head; bf16): row 0 of 1..M rows. The engine-level property is
tests/engine/test_batch_invariant.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jllm.config import batch_invariant
from jllm.models import bf16_matmul, f32_matmul
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_gpu,
)

F32, BF16 = jnp.float32, jnp.bfloat16
S, K, N, L = 16, 2, 4, 45  # block size, kv heads, query heads, the sequence's length


# Each flavour as the property is claimed: the C++ and GPU kernels in their batch-invariant
# mode (the GPU's: one tiling, no KV split), the Pallas TPU kernel (interpret mode) as it is,
# whose query tiles and KV chunks are static shapes.
FLAVOURS = {
    "cpu": lambda *a, **kw: ragged_paged_attention_cpu(*a, **kw, batch_invariant=True),
    "tpu": lambda *a, **kw: ragged_paged_attention(
        *a, **kw, block_q=8, pages_per_chunk=2, interpret=True
    ),
    "gpu": lambda *a, **kw: ragged_paged_attention_gpu(
        *a, **kw, interpret=True, batch_invariant=True
    ),
    "gpu-device": lambda *a, **kw: jax.jit(
        functools.partial(ragged_paged_attention_gpu, batch_invariant=True, **kw)
    )(*a),
}


def _attend(flavour, h, dtype, q_rows, layouts, window):
    """Each layout: a list of requests (first position, query count); request 0 of every
    layout is the probed sequence, the others its neighbours. Returns, per layout, the
    output rows of request 0, by position."""
    rng = np.random.default_rng(h)
    pages = -(-L // S)
    cache = rng.standard_normal((1 + 3 * pages, S, 2 * K, h)).astype(np.float32)
    tables = np.array([[1 + i * pages + j for j in range(pages)] for i in range(3)], np.int32)
    out = []
    for requests in layouts:
        starts = np.cumsum([0] + [n for _, n in requests])[:-1]
        q = np.concatenate([q_rows[i][p : p + n] for i, (p, n) in enumerate(requests)])
        got = FLAVOURS[flavour](
            jnp.asarray(q, dtype),
            jnp.asarray(cache, dtype),
            jnp.asarray([p + n for p, n in requests], jnp.int32),
            jnp.asarray(tables[: len(requests)]),
            jnp.asarray(starts, jnp.int32),
            jnp.asarray([n for _, n in requests], jnp.int32),
            jnp.asarray([len(requests)], jnp.int32),
            sliding_window=window,
        )
        first, count = requests[0]
        rows = np.asarray(got.astype(jnp.float32))[:count]
        out.append({first + i: rows[i].view(np.int32) for i in range(count)})
    return out


# The interpreted Pallas kernels are slow on the CPU: each in one dtype, the window on the
# C++ kernel's two routines.
CASES = [
    *[
        ("cpu", h, dtype, window)
        for h in (16, 64)
        for dtype in (F32, BF16)
        for window in (None, 20)
    ],
    ("tpu", 64, F32, 20),
    ("gpu", 64, BF16, None),
]


# On the device (each layout a compile, minutes of a short device lease): bf16 at 128 with
# and without a window, float32 at 64.
ON_GPU = [
    pytest.param("gpu-device", h, dtype, window, marks=pytest.mark.gpu)
    for h, dtype, window in ((128, BF16, None), (128, BF16, 20), (64, F32, None))
]


@pytest.mark.parametrize("flavour,h,dtype,window", CASES + ON_GPU)
def test_attention_row_is_the_same_in_any_layout(flavour, h, dtype, window):
    if flavour == "gpu-device" and jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU (benchmarks/gpu/run.sh runs it)")
    rng = np.random.default_rng(7)
    q_rows = [rng.standard_normal((L, N, h)).astype(np.float32) for _ in range(3)]
    probe = L - 1
    layouts = [
        [(probe, 1)],  # a decode row alone
        [(probe, 1), (10, 1), (3, 30)],  # beside a decode and a prefill chunk
        [(L - 7, 7)],  # the last of a 7-query chunk
        [(0, L), (40, 5)],  # the last of the whole prompt, with a neighbour
        [(30, 15), (0, 20)],  # the last of a chunk starting mid-block
    ]
    results = _attend(flavour, h, dtype, q_rows, layouts, window)
    for got in results[1:]:
        assert np.array_equal(got[probe], results[0][probe])
    # A middle row: inside a chunk, and as the chunk's last row.
    middle = _attend(flavour, h, dtype, q_rows, [[(33, 1)], [(20, 25)], [(0, 34)]], window)
    assert np.array_equal(middle[1][33], middle[0][33])
    assert np.array_equal(middle[2][33], middle[0][33])


def _rows_agree(fn, x) -> bool:
    base = np.asarray(fn(x[:1]).astype(jnp.float32))[0].view(np.int32)
    return all(
        np.array_equal(np.asarray(fn(x[:m]).astype(jnp.float32))[0].view(np.int32), base)
        for m in (2, 3, 5, 7, 16, 64, 200)
    )


@pytest.mark.skipif(not f32_matmul.supported(), reason="needs x86 with FMA (AVX2 or AVX-512)")
@pytest.mark.parametrize("k,n", [(64, 128), (96, 200), (576, 1536)])
def test_float32_products_row_is_the_same_for_any_row_count(k, n):
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((200, k)), jnp.float32)
    w, up = (jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in "wu")
    table = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)  # a tied head's [V, D]
    with batch_invariant.scope(True):
        assert _rows_agree(lambda a: f32_matmul.f32_matmul(a, w), x)
        assert _rows_agree(lambda a: f32_matmul.f32_gated_matmul(a, w, up), x)
        assert _rows_agree(lambda a: f32_matmul.f32_matmul(a, table, transposed=True), x)


@pytest.mark.skipif(not bf16_matmul.supported(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("k,n", [(64, 128), (576, 1536)])
def test_bf16_products_row_is_the_same_for_any_row_count(k, n):
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((200, k)), jnp.bfloat16)
    w, up = (jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16) for _ in "wu")
    with batch_invariant.scope(True):  # on an AMX CPU: the build without the tiles
        assert _rows_agree(lambda a: bf16_matmul.bf16_matmul(a, w), x)
        assert _rows_agree(lambda a: bf16_matmul.bf16_gated_matmul(a, w, up), x)

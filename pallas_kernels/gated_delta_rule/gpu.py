"""The gated delta rule for GPUs: the kit's contract as Pallas kernels on Triton
(``interpret=True`` runs them on the CPU), the same per-chunk and per-token math as the TPU
kernels (kernel.py: `chunk_step`, `decode_step`) in Triton's grid.

Triton's programs run in no set order, so the chunk kernel's grid is (Hv heads, R rows,
value blocks): one program walks its row's chunks in order (a loop from the row's first
chunk, `chunk_inputs`' head-major layout) with its slice of the state [K, BV] in registers;
rows without tokens write their state back unchanged. Chunks are 16 tokens (the smallest
matrix product Triton takes, and the register budget of a [C, C] inverse beside a [K, BV]
state). The recurrent kernel's grid is (R, Hv, value blocks). Triton's tiles are powers of
two: K and V must be (`unsupported_shape`).

Glossary: T tokens, R request rows, NC chunks, C chunk tokens, Hv value heads, K key dim,
V value dim, BV a value block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .chunked import chunk_inputs, scatter_chunks
from .kernel import _decode_kernel, chunk_step, decode_operands
from .recurrent import by_row_kind, scatter_rows
from .validation import prepare, validate_inputs

CHUNK = 16
f32 = jnp.float32


def unsupported_shape(key_dim: int, value_dim: int) -> str | None:
    """Why Triton cannot take these head dims, or None."""
    for name, d in (("key", key_dim), ("value", value_dim)):
        if d < 16 or d & (d - 1):
            return f"the {name} head dim ({d}) must be a power of two of at least 16"
    return None


def _check(q, v):
    reason = unsupported_shape(q.shape[-1], v.shape[-1])
    if reason:
        raise ValueError(f"gated_delta_rule_gpu: {reason}")


def _decode(q, k, v, g, beta, state, query_start, query_lens, *, use_qk_l2norm, scale, **kw):
    T = q.shape[0]
    prepared = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    operands = decode_operands(prepared, state, query_start, query_lens)
    R, Hv, K, V = operands[-1].shape
    BV = min(V, kw["block_v"])

    def whole(*shape):
        return pl.BlockSpec((1, 1, *shape), lambda r, h, j: (r, h, 0, 0))

    def split(rows):
        return pl.BlockSpec((1, 1, rows, BV), lambda r, h, j: (r, h, 0, j))

    o, S = pl.pallas_call(
        _decode_kernel,
        grid=(R, Hv, V // BV),
        in_specs=[whole(K, 1), whole(K, 1), split(1), whole(1, 1), whole(1, 1), split(K)],
        out_specs=[split(1), split(K)],
        out_shape=[
            jax.ShapeDtypeStruct((R, Hv, 1, V), f32),
            jax.ShapeDtypeStruct(state.shape, f32),
        ],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=kw["num_warps"]),
        interpret=kw["interpret"],
        name="gated_delta_rule_decode_gpu",
    )(*operands)
    return scatter_rows(o[:, :, 0], query_start, query_lens, T), S


def _chunk_kernel(
    first_ref,
    count_ref,
    q_ref,
    k_ref,
    kT_ref,
    v_ref,
    gc_ref,
    gr_ref,
    b_ref,
    gl_ref,
    s_ref,
    *out,
    BV,
):
    o_ref, s_out_ref = out
    h, r, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lanes = pl.ds(j * BV, BV)
    c0 = first_ref[r]

    def chunk(i, S):
        c = c0 + i
        at = (h, c)
        o, S = chunk_step(
            q_ref[at],
            k_ref[at],
            kT_ref[at],
            v_ref[h, c, :, lanes],
            gc_ref[at],
            gr_ref[at],
            b_ref[at],
            gl_ref[at],
            S,
        )
        o_ref[h, c, :, lanes] = o
        return S

    S = jax.lax.fori_loop(0, count_ref[r], chunk, s_ref[r, h, :, lanes])
    s_out_ref[r, h, :, lanes] = S


def _chunks(q, k, v, g, beta, state, query_start, query_lens, *, use_qk_l2norm, scale, **kw):
    T, R = q.shape[0], query_start.shape[0]
    prepared = prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    _, _, tokens, *inputs = chunk_inputs(*prepared, query_start, query_lens, CHUNK)
    count = (jnp.maximum(query_lens, 0).astype(jnp.int32) + CHUNK - 1) // CHUNK
    first = jnp.cumsum(count) - count
    Hv, NC, C, _ = inputs[0].shape
    V = inputs[3].shape[-1]
    BV = min(V, kw["block_v"])
    o, S = pl.pallas_call(
        functools.partial(_chunk_kernel, BV=BV),
        grid=(Hv, R, V // BV),
        out_shape=[
            jax.ShapeDtypeStruct((Hv, NC, C, V), f32),
            jax.ShapeDtypeStruct(state.shape, f32),
        ],
        input_output_aliases={2 + 8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=kw["num_warps"]),
        interpret=kw["interpret"],
        name="gated_delta_rule_chunks_gpu",
    )(first, count, *inputs, state.astype(f32))
    return scatter_chunks(o, tokens, T), S


def gated_delta_rule_gpu(
    q,
    k,
    v,
    g,
    beta,
    state,
    query_start,
    query_lens,
    *,
    use_qk_l2norm=True,
    scale=None,
    block_v: int = 32,
    num_warps: int = 4,
    interpret: bool = False,
):
    """The reference's contract (reference.py) on a GPU. `block_v`: the value lanes of the
    state one program holds."""
    validate_inputs(q, k, v, g, beta, state, query_start, query_lens)
    _check(q, v)
    kw = dict(
        use_qk_l2norm=use_qk_l2norm,
        scale=scale,
        interpret=interpret,
        block_v=block_v,
        num_warps=num_warps,
    )
    return by_row_kind(_decode, _chunks, q, k, v, g, beta, state, query_start, query_lens, **kw)

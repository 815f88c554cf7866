"""The gated delta rule kit (pallas_kernels/gated_delta_rule): the chunked XLA path against
the token-by-token reference over flat ragged batches (rows of every length, rows without
tokens, padding tokens past the rows, every chunk size), both against transformers' torch
functions on one sequence; every path (XLA's switch, the TPU and GPU kernels interpreted)
on mixed and decode-only steps, and under a head split over two devices; the kernels
lowered for TPU and CUDA at Qwen3-Next-80B-A3B's shapes; and the causal convolution against
its own reference."""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pallas_kernels.gated_delta_rule import (
    causal_conv,
    causal_conv_reference,
    chunk_plan,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_gpu,
    gated_delta_rule_reference,
    gated_delta_rule_sharded,
    gated_delta_rule_xla,
    unsupported_shape,
)

# Rows: a decode, a long prefill chunk, an empty (padding) row, a mid-sized one; the batch
# runs past the rows (padding tokens).
LENS = np.array([1, 37, 0, 9, 5, 1], np.int32)
T = 64


def _batch(rng, Hk=2, Hv=4, K=8, V=6):
    starts = np.concatenate([[0], np.cumsum(LENS)[:-1]]).astype(np.int32)
    R = len(LENS)
    q, k = (rng.normal(size=(T, Hk, K)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(T, Hv, V)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, (T, Hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, Hv)).astype(np.float32)
    state = rng.normal(size=(R, Hv, K, V)).astype(np.float32)
    return q, k, v, g, beta, state, starts, LENS


@pytest.mark.parametrize("chunk", [1, 4, 16, 64, None])
def test_chunked_matches_the_reference(chunk):
    args = _batch(np.random.default_rng(0))
    o_ref, s_ref = gated_delta_rule_reference(*args)
    chunked = jax.jit(lambda *a: gated_delta_rule_chunked(*a, chunk_size=chunk))
    o, s = chunked(*args)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, atol=2e-5)
    end = int(LENS.sum())
    assert not np.asarray(o[end:]).any()  # padding tokens
    np.testing.assert_array_equal(s[2], args[5][2])  # the empty row keeps its state


def test_chunk_plan_covers_each_row_in_order():
    starts = np.concatenate([[0], np.cumsum(LENS)[:-1]]).astype(np.int32)
    row, start, size = (np.asarray(a) for a in chunk_plan(starts, LENS, T, 8))
    live = size > 0
    assert len(row) == T // 8 + len(LENS)
    for r, n in enumerate(LENS):
        mine = live & (row == r)
        assert size[mine].sum() == n
        np.testing.assert_array_equal(start[mine], starts[r] + 8 * np.arange(mine.sum()))
    assert list(row[live]) == sorted(row[live])  # a row's chunks are consecutive, in order


@pytest.mark.parametrize("path", ["reference", "chunked"])
def test_matches_transformers_on_one_sequence(path):
    q, k, v, g, beta, state, starts, lens = _batch(np.random.default_rng(1))
    r = 1
    span = slice(starts[r], starts[r] + lens[r])
    one = lambda a: torch.tensor(a[span])[None]  # noqa: E731
    want, want_state = hf.torch_chunk_gated_delta_rule(
        one(q), one(k), one(v), one(g), one(beta),
        chunk_size=8,
        initial_state=torch.tensor(state[r : r + 1]),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    rule = gated_delta_rule_reference if path == "reference" else gated_delta_rule_chunked
    o, s = rule(q, k, v, g, beta, state, starts, lens)
    np.testing.assert_allclose(o[span], want[0].numpy(), atol=2e-5)
    np.testing.assert_allclose(s[r], want_state[0].numpy(), atol=2e-5)


def test_causal_conv_matches_its_reference():
    rng = np.random.default_rng(2)
    starts = np.concatenate([[0], np.cumsum(LENS)[:-1]]).astype(np.int32)
    C, J = 5, 4
    x = rng.normal(size=(T, C)).astype(np.float32)
    w = rng.normal(size=(J, C)).astype(np.float32)
    window = rng.normal(size=(len(LENS), J - 1, C)).astype(np.float32)
    y, new = causal_conv(x, w, window, starts, LENS)
    y_ref, new_ref = causal_conv_reference(x, w, window, starts, LENS)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    np.testing.assert_array_equal(new, new_ref)
    # One whole sequence from an empty window equals transformers' convolution (no activation).
    r = 1
    span = slice(starts[r], starts[r] + LENS[r])
    torch_w = torch.tensor(w.T.copy())  # [C, J]
    want = hf.causal_conv1d_fn(torch.tensor(x[span].T.copy())[None], torch_w, None, None)
    zero = np.zeros_like(window)
    got, _ = causal_conv(x, w, zero, starts, LENS)
    np.testing.assert_allclose(got[span], want[0].numpy().T, atol=1e-5)


PATHS = {
    "xla": gated_delta_rule_xla,
    "tpu": functools.partial(gated_delta_rule, interpret=True),  # chunks of 64 on one row
    "gpu": functools.partial(gated_delta_rule_gpu, interpret=True, block_v=16),
}
# A decode-only step: every row one token or none (the recurrent kernels' case).
DECODE_STARTS = np.array([0, 1, 2, 2, 3, 4], np.int32)
DECODE_LENS = np.array([1, 1, 0, 1, 1, 0], np.int32)


@pytest.mark.parametrize("step", ["mixed", "decode", "repeated"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_matches_the_reference(path, step):
    """Triton's shapes: head dims powers of two of at least 16. "repeated": one 64-token
    row whose keys are all alike (a run of one token), chunks of 64 on the TPU kernel: the
    triangular solve's worst case (every key fully correlated)."""
    _check_path(PATHS[path], step, K=16, V=32, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU (benchmarks/gpu/run.sh runs it)"
)
@pytest.mark.parametrize("step", ["mixed", "decode", "repeated"])
def test_gpu_kernel_on_device_matches_the_reference(step):
    """The Triton kernels compiled for the device at Qwen3-Next's head dims (128, 128), with
    full float32 products (a GPU's default float32 dot is TF32)."""
    with jax.default_matmul_precision("highest"):
        _check_path(gated_delta_rule_gpu, step, K=128, V=128, atol=1e-4, rtol=1e-4)


def _check_path(kernel, step, K, V, atol, rtol=1e-7):
    args = list(_batch(np.random.default_rng(3), K=K, V=V))
    if step == "decode":
        args[6:] = DECODE_STARTS, DECODE_LENS
    if step == "repeated":  # hardly any decay, strong writes: A's entries near 1
        args[1] = np.broadcast_to(args[1][:1], args[1].shape).copy()
        args[3], args[4] = np.full_like(args[3], -1e-3), np.full_like(args[4], 0.9)
        args[5:] = args[5][:1], np.array([0], np.int32), np.array([T], np.int32)
    o_ref, s_ref = gated_delta_rule_reference(*args)
    o, s = jax.jit(kernel)(*args)
    np.testing.assert_allclose(o, o_ref, atol=atol, rtol=rtol)
    np.testing.assert_allclose(s, s_ref, atol=atol, rtol=rtol)
    empty = np.flatnonzero(args[7] == 0)
    np.testing.assert_array_equal(np.asarray(s)[empty], args[5][empty])  # kept bit for bit
    assert not np.asarray(o[int(args[6][-1] + args[7][-1]) :]).any()  # padding tokens


@pytest.mark.parametrize("path", ["xla", "tpu"])
def test_heads_split_over_two_devices(path):
    """Two key heads, four value heads: each device holds one key head and its two."""
    args = _batch(np.random.default_rng(4), K=16, V=32)
    auto = (jax.sharding.AxisType.Auto,)  # as the engine's mesh
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2], axis_types=auto)
    o_ref, s_ref = gated_delta_rule_reference(*args)
    run = jax.jit(lambda *a: gated_delta_rule_sharded(mesh, "model", *a, kernel=PATHS[path]))
    o, s = run(*args)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, atol=2e-5)


def test_gpu_refuses_head_dims_triton_cannot_tile():
    assert unsupported_shape(128, 128) is None
    assert "power of two" in unsupported_shape(8, 128)
    with pytest.raises(ValueError, match="value head dim"):
        gated_delta_rule_gpu(*_batch(np.random.default_rng(0), K=16, V=24), interpret=True)


QWEN3_NEXT = Path(__file__).parents[2] / "benchmarks/gpu/configs/qwen3-next-80b-a3b/config.json"
TARGETS = {
    "tpu": (("TPU v5 lite", 1, "tpu"), gated_delta_rule, "tpu_custom_call"),
    "cuda": (("NVIDIA H100 80GB HBM3", 132, "gpu"), gated_delta_rule_gpu, "__gpu$xla.gpu.triton"),
}


@pytest.mark.parametrize("platform", list(TARGETS))
@pytest.mark.parametrize("T,R", [(64, 64), (512, 8), (8192, 256)])
def test_lowers_at_qwen3_next_shapes(platform, T, R):
    """Lowering (no accelerator needed) at Qwen3-Next-80B-A3B's linear-attention shapes in
    bf16, for a decode bucket, a mixed one and the largest: each path lowers to one call
    (the recurrent kernel and the chunk kernel, one of which a step runs)."""
    cfg = json.loads(QWEN3_NEXT.read_text())
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    K, V = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    device, kernel, call = TARGETS[platform]
    S = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    shapes = (
        *(S((T, Hk, K), bf16), S((T, Hk, K), bf16), S((T, Hv, V), bf16)),
        *(S((T, Hv), f32), S((T, Hv), f32), S((R, Hv, K, V), f32), S((R,), i32), S((R,), i32)),
    )
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(*device)
    )
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        text = jax.jit(kernel).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == [call, call]

"""A model's stacked bfloat16 projections packed once for the CPU kernel (bf16_matmul.py).

The kernel multiplies a [K, N] weight panel by panel of 32 columns, each as pairs of rows
interleaved (what the AMX tiles' B operand and the vector loop's dot instruction take). Read
as [K, N], every call packs each panel it uses at 16 rows and more (a decode step at batch 64
packed all 30 layers' weights again, at 3.5-4 GB/s a core where the tiles then read them at
their own rate), and interleaves the pairs in its loop below. Packed once at start-up, the
calls read the panels where they lie, one contiguous run per half panel.

Which weights: each Linear whose weight is a bfloat16 layer stack [L, In..., Out...] (the
decoder's projections; `Linear.packable`: not one a module reads itself), on an engine of
one device whose layer products are the kernel's (`packs_here`). The engine packs them
before anything else takes its state (LLMEngine); `WeightSync` hands weight updates and
`get_weights` the declared [L, In..., Out...] view and packs what an update writes
(`unpacked`, `repacked`); sleep keeps the arrays as they are held. Nothing else changes: the
parameters' paths, the LoRA slots, the KV-cache scales.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.models import bf16_matmul
from jllm.models.layers import Linear

logger = logging.getLogger("jllm")


def packs_here(mesh, dtype, invariant: bool) -> bool:
    """Whether an engine of `mesh` and activation `dtype` packs its projections: bfloat16, one
    device, and the bf16 kernel running the layer products in its mode (`invariant`: the
    batch-invariant mode's build)."""
    if jnp.dtype(dtype) != jnp.bfloat16 or mesh.size != 1:
        return False
    return bf16_matmul.enabled(invariant)


def _stacked_bf16(linear: Linear) -> bool:
    value = linear.weight.get_value()
    shape = (*linear.in_shape, *linear.out_shape)
    return (
        isinstance(value, jax.Array)
        and value.dtype == jnp.bfloat16
        and value.ndim == len(shape) + 1
        and tuple(value.shape[1:]) == shape
    )


@jax.jit
def _pack(value):
    return bf16_matmul.pack(value)


@partial(jax.jit, static_argnums=(1, 2))
def _unpack(value, k: int, n: int):
    return bf16_matmul.unpack(value, k, n)


def pack_stacked_weights(graphdef, state) -> tuple[object, object, dict]:
    """(graphdef, state, {parameter path: (In, Out, the weight's declared shape)}) with every
    packable stacked bf16 Linear weight packed (`Linear.packed`); In and Out: its weight's
    flattened input and output sizes, the shape [In..., Out...] without the layers."""
    start = time.perf_counter()
    model = nnx.merge(graphdef, state)
    packed = {}
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Linear) or not module.packable or module.packed:
            continue
        if not _stacked_bf16(module):
            continue
        value = module.weight.get_value()
        k, n = math.prod(module.in_shape), math.prod(module.out_shape)
        module.weight.set_value(_pack(value.reshape(value.shape[0], k, n)))
        module.packed = True
        packed[(*path, "weight")] = (k, n, (*module.in_shape, *module.out_shape))
    if not packed:
        return graphdef, state, packed
    graphdef, state = nnx.split(model)
    logger.info(
        "bf16 projections packed for the CPU kernel: %d stacked weights in %.2f s.",
        len(packed),
        time.perf_counter() - start,
    )
    return graphdef, state, packed


def unpacked(value, layout):
    """A packed stacked weight as declared, [L, In..., Out...]; `layout`: its entry of
    `pack_stacked_weights`'s map."""
    k, n, shape = layout
    return _unpack(value, k, n).reshape(value.shape[0], *shape)


def repacked(value, layout):
    """A stacked weight [L, In..., Out...] packed as `pack_stacked_weights` holds it."""
    k, n, _ = layout
    return _pack(value.reshape(value.shape[0], k, n))


def declared(state, layouts: dict):
    """`state` (an nnx.State) with its packed projections unpacked: a new State, the other
    Variables as they are; `layouts`: `pack_stacked_weights`'s map."""
    if not layouts:
        return state
    flat = {
        path: var.replace(unpacked(var.get_value(), layouts[path])) if path in layouts else var
        for path, var in nnx.to_flat_state(state)
    }
    return nnx.from_flat_state(flat)

"""One host-to-device transfer per executable input: a pytree of 32-bit (or bool) numpy arrays
packed into one int32 buffer on the host, unpacked by slicing and bitcasting inside the
jitted step. A step sends two, its inputs (the forward's) and its sampling metadata (the
sampler's), in one `device_put`. (The way back is one array: see `runner/sampler.py`'s
packed result.)

`pack` returns the buffer and its `Layout` (tree structure, shapes, dtypes), which is static:
it depends only on the step's bucket, so it is part of the executable's key, never traced.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Layout(NamedTuple):
    treedef: object
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) per leaf


def _as_int32(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x.astype(np.int32)
    if x.dtype.itemsize != 4:
        raise TypeError(f"only 32-bit and bool leaves are packed, got {x.dtype}")
    return np.ascontiguousarray(x).view(np.int32)


def pack(tree) -> tuple[np.ndarray, Layout]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [np.asarray(x) for x in leaves]
    layout = Layout(treedef, tuple((x.shape, x.dtype.name) for x in leaves))
    parts = [_as_int32(x).reshape(-1) for x in leaves]
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, layout


def _slices(buf, layout: Layout):
    """(each leaf's int32 words in its shape, its dtype name), in order."""
    offset = 0
    for shape, dtype in layout.leaves:
        n = math.prod(shape)
        yield buf[offset : offset + n].reshape(shape), dtype
        offset += n


def unpack(buf: jax.Array, layout: Layout):
    """Inside jit: the pytree `pack` flattened, as device arrays."""
    leaves = []
    for x, dtype in _slices(buf, layout):
        if dtype == "bool":
            x = x != 0
        elif dtype != "int32":
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        leaves.append(x)
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def unpack_host(buf: np.ndarray, layout: Layout):
    """`unpack` on the host, in numpy (for tools that read a packed step back)."""
    leaves = [x != 0 if d == "bool" else x.view(np.dtype(d)) for x, d in _slices(buf, layout)]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)

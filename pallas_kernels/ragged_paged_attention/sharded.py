"""The kernel under tensor parallelism: `shard_map` over the head axes.

Each device runs the kernel on its own query heads and the kv heads they read: q
[T, N, H] is split on N and the cache [B, S, 2K, H] (or stacked, [L, B, S, 2K, H]) on 2K
(K/V interleaved, so a device's slice holds whole kv heads), with the ragged metadata
replicated. Heads never talk to each other in attention, so no collective is needed; GQA
groups stay intact as long as N and K divide by the axis size (what
`sharding.kv_head_replicas` enforces).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .kernel import ragged_paged_attention


def ragged_paged_attention_sharded(
    mesh,
    axis: str,
    q,
    kv_cache,
    kv_lens,
    block_tables,
    query_start,
    query_lens,
    num_seqs,
    layer=None,
    **kernel_options,
):
    """`ragged_paged_attention` with heads split over `mesh` axis `axis`; same arguments."""
    heads = P(None, axis, None)
    cache = P(*[None] * (kv_cache.ndim - 2), axis, None)
    args = (q, kv_cache, kv_lens, block_tables, query_start, query_lens, num_seqs)
    if layer is None:
        kernel = functools.partial(ragged_paged_attention, **kernel_options)
    else:  # the layer travels as an argument: it is traced inside the model's scan
        args = (*args, jnp.asarray(layer, jnp.int32))

        def kernel(*a):
            return ragged_paged_attention(*a[:-1], layer=a[-1], **kernel_options)

    specs = (heads, cache, P(), P(), P(), P(), P()) + ((P(),) if layer is not None else ())
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)

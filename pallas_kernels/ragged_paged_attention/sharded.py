"""The kernel under tensor parallelism: `shard_map` over the head axes.

Each device runs the kernel on its own query heads and the kv heads they read: q
[T, N, H] is split on N and the cache [B, S, 2K, H] (or stacked, [L, B, S, 2K, H]) on 2K
(K/V interleaved, so a device's slice holds whole kv heads), with the ragged metadata
(and ``q_horizon``, when given) replicated; ``sinks`` (gpt-oss's, [N]) are split as q's
heads. Heads never talk to each other in attention, so no collective is needed; GQA groups
stay intact as long as N and K divide by the axis size (what `sharding.kv_head_replicas`
enforces). A latent cache (``latent=True``, MLA) has
no head axis and is replicated: each device reads the whole of it for its own query heads.
``kernel`` picks the flavour: the TPU kernel by default, or `ragged_paged_attention_gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .kernel import ragged_paged_attention
from .validation import as_stacked


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
    kernel=ragged_paged_attention,
    q_horizon=None,
    sinks=None,
    **kernel_options,
):
    """`kernel` (a ragged paged attention flavour) with heads split over `mesh` axis `axis`;
    same arguments (`sinks` [N] split as q's heads)."""
    latent = kernel_options.get("latent", False)
    kv_cache, layer, _ = as_stacked(kv_cache, layer, latent)
    heads = P(None, axis, None)
    cache = P() if latent else P(None, None, None, axis, None)
    metadata = [kv_lens, block_tables, query_start, query_lens, num_seqs]
    # The layer and the horizon travel as arguments: they are traced in the model's scan.
    metadata.append(jnp.asarray(layer, jnp.int32))
    if q_horizon is not None:
        metadata.append(q_horizon)

    def per_device(q, kv_cache, sinks, *metadata):
        options = dict(kernel_options, layer=metadata[5])
        if q_horizon is not None:
            options["q_horizon"] = metadata[6]
        if sinks is not None:
            options["sinks"] = sinks
        return kernel(q, kv_cache, *metadata[:5], **options)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(heads, cache, None if sinks is None else P(axis), *[P()] * len(metadata)),
        out_specs=heads,
        check_vma=False,
    )(q, kv_cache, sinks, *metadata)

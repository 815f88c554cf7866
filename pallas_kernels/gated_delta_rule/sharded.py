"""The gated delta rule under tensor parallelism: `shard_map` over the head axes.

Value heads never talk to each other, and the Hv / Hk value heads of a key head are
consecutive, so splitting the key heads and the value heads into the same number of
contiguous parts gives every device whole groups: q and k [T, Hk, K] are split on Hk, v
[T, Hv, V], g and beta [T, Hv] and the state [R, Hv, K, V] on Hv, the row metadata
replicated. No collective is needed. ``kernel`` is any of the kit's paths.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from .kernel import gated_delta_rule


def gated_delta_rule_sharded(
    mesh, axis: str, q, k, v, g, beta, state, query_start, query_lens, kernel=gated_delta_rule, **kw
):
    """`kernel` with heads split over `mesh` axis `axis`; same arguments and results."""
    heads3, heads2 = P(None, axis, None), P(None, axis)
    rows = P(None, axis, None, None)

    def per_device(*args):
        return kernel(*args, **kw)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(heads3, heads3, heads3, heads2, heads2, rows, P(), P()),
        out_specs=(heads3, rows),
        check_vma=False,
    )(q, k, v, g, beta, state, query_start, query_lens)

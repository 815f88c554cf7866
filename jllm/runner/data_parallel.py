"""Data parallelism's device half: each data shard runs the step on its own requests.

With `data_parallel_size` D the mesh's `data` axis has D shards (sharding/). A step is one
SPMD program over the whole mesh: `over_data` runs a step function under `shard_map`,
manual over `data` only, so each shard's devices see their own slice of every per-shard
array and the model's `model` (tensor-parallel) axis stays with XLA's partitioner and the
kernels' own `shard_map`s, as with one shard. What a shard sees is exactly what a
one-replica engine's step sees:

- the packed step inputs and sampling metadata, [D, n] on the host, row d shard d's, built
  by the same code (runner/inputs.py) from its own input batch, in one forward key and one
  sample-row bucket for all (the largest shard's);
- the KV cache, whose block axis (`cache_blocks`) is split over `data`: shard d's block ids
  index its own B blocks, which its own `KVCacheManager` hands out (engine/data_parallel.py);
- the per-row state (the last sampled tokens, penalty counts and prompt masks, the
  logit-bias table, the grammar bitmask), D times one shard's rows, split over `data`;
- the weights, whole (replicated over `data`; split over `model` as tensor parallelism
  places them).

Nothing crosses between shards in a dense model's step: no collective over `data`.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding import DATA_AXIS

SPLIT = PartitionSpec(DATA_AXIS)


def rows_sharding(mesh) -> NamedSharding:
    """Per-shard rows side by side on the leading axis, shard d's on its devices."""
    return NamedSharding(mesh, SPLIT)


def whole(tree):
    """Specs for a tree whose every leaf each shard holds whole (the weights)."""
    return jax.tree.map(lambda _: PartitionSpec(), tree)


def blocks(tree):
    """Specs for KV-cache pools: every array's axis 1 (blocks, or state slots) split."""
    return jax.tree.map(lambda _: PartitionSpec(None, DATA_AXIS), tree)


def over_data(fn, in_specs, out_specs):
    """`fn` run per data shard (manual over `data` only), under the caller's mesh."""
    return jax.shard_map(
        fn, in_specs=in_specs, out_specs=out_specs, axis_names={DATA_AXIS}, check_vma=False
    )


def data_splits(state):
    """Which dimension of each weight is split over `data` (the experts under expert
    parallelism: sharding/), as a hashable static argument of the steps: (treedef, a spec per
    leaf), or None when every weight is whole on every shard."""
    leaves, treedef = jax.tree.flatten(state)
    specs = tuple(_data_only(leaf.sharding.spec) for leaf in leaves)
    if all(spec == PartitionSpec() for spec in specs):
        return None
    return treedef, specs


def _data_only(spec) -> PartitionSpec:
    dims = [DATA_AXIS if DATA_AXIS in (e if isinstance(e, tuple) else (e,)) else None for e in spec]
    return PartitionSpec(*dims) if any(dims) else PartitionSpec()


def weight_specs(state, splits):
    """The steps' in_specs of the weights: whole, but for what `data_splits` found split."""
    return whole(state) if splits is None else jax.tree.unflatten(*splits)

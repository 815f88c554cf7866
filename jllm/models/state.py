"""Per-request state on the model side: a step's metadata for a KV-cache group of
per-request state (`MambaSpec`, jllm/kv_cache_interface.py) and how a layer loads and stores
its rows' state.

Such a group is not attention: no backend sees it. Its pool keeps, per state array of the
spec, one [Lg, slots, *shape] array (a conv window, a recurrent state), and a request's block
list is its one slot. The runner (runner/flat_batch.py) describes the step per request row:
its slot, where its tokens sit in the flat batch and whether it starts fresh (nothing
computed before the step: a new request, or one preempted and recomputed); the layer reads
it through the step context (`StepContext.load_state` / `store_state`, models/context.py):

    states = ctx.load_state(kv_caches)  # each state array of the group, [R, *shape]
    ...  # run the step's tokens row by row (token_row), carrying the R states
    kv_caches = ctx.store_state(kv_caches, states)

A fresh row (and a padding row) loads zeros; padding rows store nothing.

Glossary: T tokens, R request rows.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["slots", "query_start", "query_lens", "fresh", "token_row"],
    meta_fields=[],
)
@dataclasses.dataclass
class StateMetadata:
    slots: jax.Array  # [R] each request row's state slot (its block table's entry 0); -1: padding
    query_start: jax.Array  # [R] the row's first token in the flat batch
    query_lens: jax.Array  # [R] its tokens this step (0: padding)
    fresh: jax.Array  # [R] bool: no tokens computed before this step, so its state starts at 0
    token_row: jax.Array  # [T] each token's request row; -1: padding

    @property
    def live(self) -> jax.Array:
        """[T] bool: the tokens that are not padding."""
        return self.token_row >= 0


def build_state_metadata(
    query_start: np.ndarray,
    query_lens: np.ndarray,
    table: np.ndarray,
    positions: np.ndarray,
    req_row: np.ndarray,
) -> StateMetadata:
    """A step's StateMetadata in numpy, from its request rows (`query_start`, `query_lens`
    [R], `req_row` [R]: each row's input-batch row, -1 for padding), the group's block tables
    `table` [rows, P] (entry 0: the slot) and the tokens' `positions` [T]."""
    has = (req_row >= 0) & (query_lens > 0)
    slots = np.where(has, table[np.where(has, req_row, 0), 0], -1).astype(np.int32)
    first = np.where(has, positions[np.where(has, query_start, 0)], 1)
    token_row = np.full(len(positions), -1, np.int32)
    for r in np.flatnonzero(has):
        token_row[query_start[r] : query_start[r] + query_lens[r]] = r
    return StateMetadata(
        slots=slots,
        query_start=np.asarray(query_start, np.int32),
        query_lens=np.where(has, query_lens, 0).astype(np.int32),
        fresh=has & (first == 0),
        token_row=token_row,
    )


def _arrays(pool) -> tuple:
    """A state pool's arrays as a tuple (a spec of one state array has a bare array)."""
    return pool if isinstance(pool, tuple) else (pool,)


def load_state(pool, layer, md: StateMetadata) -> tuple:
    """Each state array of `pool` at layer row `layer`, for the step's rows: [R, *shape],
    zeros for fresh and padding rows."""
    out = []
    for a in _arrays(pool):
        index = jnp.where(md.slots >= 0, md.slots, a.shape[1])  # padding: past the slots
        rows = a.at[layer, index].get(mode="fill", fill_value=0)  # [R, *shape]
        keep = ~md.fresh & (md.slots >= 0)
        out.append(jnp.where(keep.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, 0))
    return tuple(out)


def store_state(pool, layer, md: StateMetadata, states: tuple):
    """`pool` with the rows' `states` ([R, *shape] each) written at their slots of layer row
    `layer`; padding rows write nothing."""
    arrays = _arrays(pool)
    new = []
    for a, s in zip(arrays, states, strict=True):
        index = jnp.where(md.slots >= 0, md.slots, a.shape[1])
        new.append(a.at[layer, index].set(s.astype(a.dtype), mode="drop"))
    return tuple(new) if isinstance(pool, tuple) else new[0]

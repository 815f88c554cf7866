"""Routed experts on the runner's side (vLLM's `enable_return_routed_experts`: each token's
chosen experts per layer, so that an RL trainer can replay the routing).

The forward returns every layer's top-k expert ids for the step's tokens ([T, L, k], in the
narrowest unsigned type that holds an expert id: vLLM's uint8 up to 256 experts, else
uint16), which come back to the host with the step's result. Here they are cut per request:
each request's tokens of the step, by position, with the slot each token's KV went to in
the record's KV-cache group. The engine keeps them (engine/routed_experts.py): by request
for its output, and by slot, so that a later prefix-cache hit on those blocks gets their
routing without recomputing it.

Host-side numpy only.

Glossary: T tokens, L layers, k experts per token, n a request's tokens in the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutesSpec:
    """What the record holds: `num_layers` x `k` ids per token of `dtype`, and which
    KV-cache `group` (one of full attention: it keeps every block) gives the slots."""

    num_layers: int
    k: int
    dtype: str
    group: int
    block_size: int

    @classmethod
    def of(cls, num_layers: int, num_experts: int, k: int, group: int, block_size: int):
        dtype = "uint8" if num_experts <= 256 else "uint16"
        return cls(num_layers=num_layers, k=k, dtype=dtype, group=group, block_size=block_size)

    @property
    def shape(self) -> tuple[int, int]:
        """One token's record: [L, k]."""
        return (self.num_layers, self.k)


@dataclasses.dataclass(frozen=True)
class StepRoutes:
    """One request's routing in one step: its tokens' positions [n] (ascending), their KV
    slots [n] in the record's group, and their ids [n, L, k]."""

    positions: np.ndarray
    slots: np.ndarray
    ids: np.ndarray


def split_by_request(ids, tok_row, positions, slots, row_ids: dict[int, str]) -> dict:
    """The step's record [T, L, k] cut per request: {request id: StepRoutes}. `row_ids`:
    the input-batch rows of the step's requests when it was built."""
    live = np.flatnonzero(tok_row >= 0)
    order = live[np.lexsort((positions[live], tok_row[live]))]  # by row, then position
    rows, starts = np.unique(tok_row[order], return_index=True)
    out = {}
    bounds = np.append(starts, len(order))
    for i, row in enumerate(rows):
        rid = row_ids.get(int(row))
        if rid is None:
            continue
        take = order[bounds[i] : bounds[i + 1]]
        out[rid] = StepRoutes(positions[take], slots[take], ids[take])
    return out

"""Routed experts on the engine's side (vLLM's `enable_return_routed_experts`): for each
request, every layer's top-k experts at every position the model ran, from
`routed_experts_prompt_start` to the token before the last ([positions, L, k]: the last
token is sampled, never run), so that an RL trainer can replay the routing.

The runner hands each step's ids per request with their positions and KV slots
(runner/routed_experts.py). They are kept twice:
- by request, at their positions: recomputed positions (after preemption, or a rejected
  draft's) are overwritten; each output carries the rows that became final since the last
  (`take`), and the front end joins them at finish (vLLM's chunks);
- by KV slot of the record's group (one of full attention), so that a prefix-cache hit on
  blocks another request computed gets their routing with their KV. With the host KV tier
  the rows travel with the blocks (`copy`).

Order: a step's results are applied in the order the device ran its parts: the host tier's
copies (stores, then loads), then the forward's writes, then the new requests' hits, which
may be blocks the same step or the step before computed (a block is a hit as soon as it is
scheduled, engine/kv_cache_manager.py). Host-side numpy only.

Glossary: L layers, k experts per token, S block size.
"""

from __future__ import annotations

import numpy as np

from jllm.engine.request import Request
from jllm.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from jllm.runner.input_batch import token_slots
from jllm.runner.routed_experts import RoutesSpec


def routes_spec(cfg, specs, block_size: int, pipeline_parallel_size: int) -> RoutesSpec:
    """What `enable_return_routed_experts` records for model config `cfg` (its experts) with
    KV-cache groups `specs`; a model or layout it cannot serve is refused by name."""
    moe = getattr(cfg, "moe", None)
    if moe is None or not any(moe.sparse_layers):
        raise ValueError(
            "enable_return_routed_experts needs a mixture-of-experts model; this one has no "
            "routed experts."
        )
    if pipeline_parallel_size > 1:
        raise ValueError(
            "enable_return_routed_experts is not supported with pipeline_parallel_size > 1 "
            "by jllm yet."
        )
    full = (FullAttentionSpec, MLAAttentionSpec)
    group = next((g for g, spec in enumerate(specs) if isinstance(spec, full)), None)
    if group is None:  # a prefix hit's routing is read through a group that keeps every block
        raise ValueError(
            "enable_return_routed_experts needs a layer of full attention; this model has "
            f"{', '.join(spec.describe() for spec in specs)}."
        )
    k = moe.num_experts_per_tok
    return RoutesSpec.of(cfg.num_layers, moe.num_experts, k, group, block_size)


class _RequestRoutes:
    def __init__(self, shape: tuple[int, int], dtype, start: int) -> None:
        self.rows = np.zeros((64, *shape), dtype)
        self.sent = start  # positions before this are in an output already (or skipped)
        self.end = 0  # the positions the last step ran end here

    def write(self, positions: np.ndarray, ids: np.ndarray) -> None:
        need = int(positions[-1]) + 1
        if need > len(self.rows):
            grown = np.zeros((max(need, 2 * len(self.rows)), *self.rows.shape[1:]), self.rows.dtype)
            grown[: len(self.rows)] = self.rows
            self.rows = grown
        self.rows[positions] = ids


class RoutedExpertsRecord:
    def __init__(self, spec, num_blocks: int, host_blocks: int = 0, pool: int = 0) -> None:
        """`spec`: the runner's RoutesSpec (layers, k, dtype, group, block size);
        `num_blocks`: the record group's pool's size, `pool` its index; `host_blocks`: the
        host KV tier's."""
        self.spec, self.pool = spec, pool
        self.dtype = np.dtype(spec.dtype)
        S = spec.block_size
        self.by_slot = np.zeros((num_blocks * S, *spec.shape), self.dtype)
        self.host = np.zeros((host_blocks * S, *spec.shape), self.dtype) if host_blocks else None
        self.requests: dict[str, _RequestRoutes] = {}

    def _blocks(self, array, block: int):
        S = self.spec.block_size
        return array[block * S : (block + 1) * S]

    def copy(self, stores, loads) -> None:
        """The host tier's copies of one step: (pool, device block, host block) stores, then
        (pool, host block, device block) loads; those of the record group's pool."""
        for pool, device, host in stores:
            if pool == self.pool:
                self._blocks(self.host, host)[:] = self._blocks(self.by_slot, device)
        for pool, host, device in loads:
            if pool == self.pool:
                self._blocks(self.by_slot, device)[:] = self._blocks(self.host, host)

    def apply(self, sched_out, result, requests: dict[str, Request]) -> None:
        """One step's routing: its copies, the runner's rows (`result.routed_experts`) by
        slot and by request, then the prefix-cache hits of the requests it admitted."""
        self.copy(sched_out.kv_stores, sched_out.kv_loads)
        for rid, step in result.routed_experts.items():
            self.by_slot[step.slots] = step.ids
            req = requests.get(rid)
            if req is None or req.is_finished() or not len(step.positions):
                continue
            routes = self._of(req)
            routes.write(step.positions, step.ids)
            routes.end = int(step.positions[-1]) + 1
        S, g = self.spec.block_size, self.spec.group
        for new in sched_out.scheduled_new_reqs:
            req, hit = requests.get(new.req_id), new.num_computed_tokens
            if req is None or req.is_finished() or hit == 0:
                continue
            positions = np.arange(hit)
            table = np.asarray(new.block_ids[g][: -(-hit // S)], np.int64)[None]  # one row
            slots = token_slots(table, np.zeros(hit, np.int64), positions, S, -1)
            self._of(req).write(positions, self.by_slot[slots])

    def _of(self, req: Request) -> _RequestRoutes:
        routes = self.requests.get(req.request_id)
        if routes is None:
            start = min(req.sampling_params.routed_experts_prompt_start, req.num_prompt_tokens)
            routes = self.requests[req.request_id] = _RequestRoutes(
                self.spec.shape, self.dtype, start
            )
        return routes

    def take(self, req: Request) -> np.ndarray | None:
        """The rows of `req` that became final since its last output ([n, L, k]: the
        positions the model ran, up to the token before its last), or None; a finished
        request's record is forgotten."""
        routes = self.requests.get(req.request_id)
        if req.is_finished():
            self.requests.pop(req.request_id, None)
        if routes is None:
            return None
        end = min(routes.end, req.num_tokens - 1)
        if end <= routes.sent:
            return None
        rows = routes.rows[routes.sent : end].copy()
        routes.sent = end
        return rows

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

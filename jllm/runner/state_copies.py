"""Copies of per-request state slots before a step's forward: the prefix cache's snapshots
of linear-attention state (engine/single_type_manager.py: StateManager). A step's copies
(`SchedulerOutput.state_copies`, (KV-cache group, source slot, destination slot) in order)
first snapshot the live slots of the requests whose last step ended at a snapshot boundary,
then start the requests that hit a snapshot from it.

One executable per state pool and bucket of copies (1, 2, 4, ... up to twice `max_num_seqs`,
compiled at start-up) copies every layer's row of every state array of the pool, from the
source slots into the destination slots, gathering before it scatters. Copies that read a
slot an earlier copy of the step writes go in a later call (in order), so each reads what
the copies before it wrote.

Glossary: Lg the group's layers, n copies.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from jllm.distributed.codec import MalformedMessage, expect_ints, expect_list
from jllm.runner.buckets import pow2_buckets
from jllm.runner.manager import RunnerManager


@partial(jax.jit, donate_argnames=("pool",))
def copy_slots(pool: tuple, src, dst) -> tuple:
    """Each array [Lg, slots, ...] of `pool` with slots `dst` [n] set to slots `src` [n] (a
    destination past the slots, padding, writes nothing)."""
    return tuple(a.at[:, dst].set(a[:, src], mode="drop") for a in pool)


def rounds(copies: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`copies` in order, cut where a copy reads a slot an earlier one in the cut writes."""
    out, written = [[]], set()
    for src, dst in copies:
        if src in written:
            out.append([])
            written = set()
        out[-1].append((src, dst))
        written.add(dst)
    return [r for r in out if r]


class StateCopies(RunnerManager):
    name = "state_copies"

    def __init__(self, pool_of: dict[int, int], max_copies: int, replicated) -> None:
        """`pool_of`: each per-request state group's pool, its index in the runner's caches."""
        self.pool_of = dict(pool_of)
        self.buckets = pow2_buckets(max(1, max_copies))
        self.replicated = replicated

    def _executable(self, table, pool: tuple, n: int):
        def lower():
            ids = jax.ShapeDtypeStruct((n,), np.int32, sharding=self.replicated)
            return copy_slots.lower(pool, ids, ids)

        shapes = tuple((a.shape, str(a.dtype)) for a in pool)
        return table.get("state copies", (shapes, n), lower)

    def compile_all(self, runner) -> None:
        for p in sorted(set(self.pool_of.values())):
            for n in self.buckets:
                self._executable(runner.table, runner.kv_cache[p], n)

    def apply(self, runner, writes) -> None:
        if not writes:
            return
        caches = list(runner.kv_cache)
        for g in dict.fromkeys(g for g, _, _ in writes):
            p = self.pool_of[g]
            pairs = [(src, dst) for group, src, dst in writes if group == g]
            for part in rounds(pairs):
                caches[p] = self._copy(runner.table, caches[p], part)
        runner.kv_cache = tuple(caches)

    def _copy(self, table, pool: tuple, pairs) -> tuple:
        largest = self.buckets[-1]
        slots = pool[0].shape[1]
        put = partial(jax.device_put, device=self.replicated)
        for lo in range(0, len(pairs), largest):
            part = pairs[lo : lo + largest]
            n = next(b for b in self.buckets if b >= len(part))
            src, dst = np.zeros(n, np.int32), np.full(n, slots, np.int32)
            src[: len(part)], dst[: len(part)] = zip(*part, strict=True)
            pool = self._executable(table, pool, n)(pool, put(src), put(dst))
        return pool

    def encode(self, writes) -> list:
        return [[int(g), int(s), int(d)] for g, s, d in writes]

    def decode(self, wire):
        copies = [tuple(expect_ints(c, "a state copy", 3)) for c in expect_list(wire, "copies")]
        if any(g not in self.pool_of for g, _, _ in copies):
            raise MalformedMessage("step message: a state copy names no state group")
        return copies

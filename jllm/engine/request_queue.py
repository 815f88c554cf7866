"""The scheduler's waiting queue, under vLLM's two policies.

- "fcfs": arrival order; a preempted request goes back to the front.
- "priority": lower `priority` first, then earlier arrival (then request id), as vLLM's
  `PriorityRequestQueue`; a preempted request goes back to its place in that order.

Host-side only.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from jllm.config import SCHEDULING_POLICIES
from jllm.engine.request import Request


def priority_key(req: Request) -> tuple:
    return (req.priority, req.arrival_time, req.request_id)


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __contains__(self, req: Request) -> bool:
        return req in self._q

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


class PriorityQueue(FCFSQueue):
    """Kept sorted by `priority_key` (insertion by bisection: the queue is read in order
    every step, and a sorted list makes that a plain iteration)."""

    def __init__(self) -> None:
        self._q: list[Request] = []  # type: ignore[assignment]

    def add(self, req: Request) -> None:
        bisect.insort(self._q, req, key=priority_key)

    prepend = add

    def pop(self) -> Request:
        return self._q.pop(0)


def create_request_queue(policy: str) -> FCFSQueue:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, not {policy!r}.")
    return PriorityQueue() if policy == "priority" else FCFSQueue()

"""Where adapters live on the host and which device slot each running request reads.

`LoraCache` (the engine's, host memory): adapters loaded from their PEFT folders by
`lora_int_id`, least recently used first out past `max_cpu_loras`. A request holds its
adapter object, so eviction never takes one from a request that uses it. The server reads it
from its processor pool's threads (requests' preparation, runtime loads): a lock guards the
table, and an adapter is read from disk outside it, once, while the requests for it wait
and the others go on.

`LoraSlots` (the scheduler's): `max_loras` device slots. A running request pins its
adapter's slot; a waiting request whose adapter has no slot takes a free one (the least
recently used of those no running request pins), or waits while requests behind it that fit
go first, so a step never holds more than `max_loras` adapters and a request waits only
until a running one finishes or is preempted (no deadlock: slots are pinned only by running
requests). The runner writes an adapter into its slot when the slot's content changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

from jllm.lora.peft import LoraAdapter, LoraTarget, load_peft_adapter
from jllm.lora.request import LoRARequest


class LoraCache:
    def __init__(
        self,
        targets: dict[str, LoraTarget],
        num_layers: int,
        max_rank: int,
        capacity: int,
        rows=None,
    ):
        self.targets, self.num_layers, self.rows = targets, num_layers, rows
        self.max_rank, self.capacity = max_rank, capacity
        self._adapters: OrderedDict[int, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        # Loads under way: (id, name, path) -> the future of the adapter.
        self._loading: dict[tuple, Future] = {}

    def get(self, request: LoRARequest) -> LoraAdapter:
        """The adapter of `request`, loaded (and checked) on first use; ValueError if its
        folder is missing, malformed or made for another model."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, not {type(request).__name__}.")
        key = (request.lora_int_id, request.lora_name, request.lora_path)
        with self._lock:
            adapter = self._adapters.get(request.lora_int_id)
            if adapter is not None and (adapter.name, adapter.path) == key[1:]:
                self._adapters.move_to_end(request.lora_int_id)
                return adapter
            # Absent, or the id now names another adapter: read it (once for all askers).
            loading = self._loading.get(key)
            mine = loading is None
            if mine:
                loading = self._loading[key] = Future()
        if not mine:
            return loading.result()
        try:
            adapter = load_peft_adapter(
                request.lora_name,
                request.lora_int_id,
                request.lora_path,
                self.targets,
                self.num_layers,
                self.max_rank,
                self.rows,
            )
        except BaseException as e:
            with self._lock:
                del self._loading[key]
            loading.set_exception(e)
            raise
        adapter.request = request
        with self._lock:
            del self._loading[key]
            self._adapters[request.lora_int_id] = adapter
            self._adapters.move_to_end(request.lora_int_id)
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        loading.set_result(adapter)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._adapters.pop(lora_int_id, None) is not None

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters


class LoraSlots:
    def __init__(self, max_loras: int):
        self.owner: list[bytes | None] = [None] * max_loras  # the adapter digest per slot
        self.pins = [0] * max_loras
        self._used = list(range(max_loras))  # least recently pinned first

    def acquire(self, adapter: LoraAdapter) -> int:
        """A slot for `adapter` (1-based, as the tokens carry it), pinned; 0 if none is free."""
        digest = adapter.digest
        if digest in self.owner:
            s = self.owner.index(digest)
        else:
            free = [s for s in self._used if self.pins[s] == 0]
            if not free:
                return 0
            s = free[0]
            self.owner[s] = digest
        self.pins[s] += 1
        self._used.remove(s)
        self._used.append(s)
        return s + 1

    def available(self, adapter: LoraAdapter) -> bool:
        """Whether `acquire` would give `adapter` a slot."""
        return adapter.digest in self.owner or 0 in self.pins

    def release(self, slot: int) -> None:
        if slot:
            self.pins[slot - 1] -= 1
            assert self.pins[slot - 1] >= 0

    def in_use(self) -> int:
        return sum(p > 0 for p in self.pins)

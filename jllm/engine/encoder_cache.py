"""Which image embeddings the device holds (vLLM's encoder cache): a fixed number of slots,
each holding one image's `tokens_per_image` embeddings, keyed by the image's content hash.

The scheduler asks for the images a step's tokens touch (`acquire`): a cached image is used
as it is, a new one gets a free slot (or the least recently used image no request holds)
and is listed for the encoder to run before the step. A request holds its images until its
computed tokens pass them (`release_passed`), or it finishes or is preempted
(`release_all`); an image no request holds stays cached, so the same image in a later
prompt is not encoded again. Host-side only: no JAX import.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[bytes, int] = {}  # image hash -> its slot
        self.holders: dict[bytes, set[str]] = {}  # image hash -> requests holding it
        self.idle: OrderedDict[bytes, None] = OrderedDict()  # held by none, oldest first
        self.free = list(range(num_slots - 1, -1, -1))
        self.held: dict[str, set[bytes]] = {}  # request -> the images it holds

    def can_take(self, hashes: set[bytes]) -> bool:
        """Whether the images `hashes` can all be held at once (the idle ones among them
        are not evicted for the others)."""
        new = sum(h not in self.slot_of for h in hashes)
        reused = sum(h in self.idle for h in hashes)
        return new <= len(self.free) + len(self.idle) - reused

    def acquire(self, req_id: str, h: bytes) -> tuple[int, bool]:
        """Hold image `h` for request `req_id`: (its slot, whether it must be encoded now).
        Check `can_take` first, and acquire the step's cached images before its new ones."""
        new = h not in self.slot_of
        if new:
            if self.free:
                slot = self.free.pop()
            else:
                old, _ = self.idle.popitem(last=False)
                slot = self.slot_of.pop(old)
                self.holders.pop(old, None)
            self.slot_of[h] = slot
        self.idle.pop(h, None)
        self.holders.setdefault(h, set()).add(req_id)
        self.held.setdefault(req_id, set()).add(h)
        return self.slot_of[h], new

    def release(self, req_id: str, h: bytes) -> None:
        holders = self.holders.get(h)
        if holders is None or req_id not in holders:
            return
        holders.discard(req_id)
        self.held[req_id].discard(h)
        if not holders:
            del self.holders[h]
            self.idle[h] = None

    def release_passed(self, req_id: str, items, computed: int) -> None:
        """Release the images of `req_id` whose tokens all lie before `computed`."""
        for item in items:
            if item.end <= computed:
                self.release(req_id, item.hash)

    def release_all(self, req_id: str) -> None:
        for h in list(self.held.get(req_id, ())):
            self.release(req_id, h)
        self.held.pop(req_id, None)

    def drop_idle(self) -> None:
        """Forget every image no request holds (new weights: their embeddings are stale)."""
        for h in self.idle:
            self.free.append(self.slot_of.pop(h))
        self.idle.clear()

    @property
    def usage(self) -> float:
        return 1.0 - (len(self.free) + len(self.idle)) / max(1, self.num_slots)

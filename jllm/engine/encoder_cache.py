"""Which image embeddings the device holds (vLLM's encoder cache): a fixed number of pages of
`page_tokens` embeddings each, an image holding as many as its tokens need (one, for the
families whose images are all `tokens_per_image` tokens, which size the page), keyed by the
image's content hash.

The scheduler asks for the images a step's tokens touch (`acquire`): a cached image is used
as it is, a new one gets free pages (evicting the least recently used images no request holds)
and is listed for the encoder to run before the step. A request holds its images until its
computed tokens pass them (`release_passed`), or it finishes or is preempted
(`release_all`); an image no request holds stays cached, so the same image in a later
prompt is not encoded again. Host-side only: no JAX import.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    def __init__(self, num_pages: int, page_tokens: int) -> None:
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.slot_of: dict[bytes, tuple[int, ...]] = {}  # image hash -> its pages
        self.holders: dict[bytes, set[str]] = {}  # image hash -> requests holding it
        self.idle: OrderedDict[bytes, None] = OrderedDict()  # held by none, oldest first
        self.free = list(range(num_pages - 1, -1, -1))
        self.held: dict[str, set[bytes]] = {}  # request -> the images it holds

    def pages(self, length: int) -> int:
        """Pages an image of `length` tokens takes."""
        return -(-length // self.page_tokens)

    def can_take(self, images: dict[bytes, int]) -> bool:
        """Whether the images `images` ({hash: token count}) can all be held at once (the
        idle ones among them are not evicted for the others)."""
        new = sum(self.pages(n) for h, n in images.items() if h not in self.slot_of)
        idle = sum(len(self.slot_of[h]) for h in self.idle if h not in images)
        return new <= len(self.free) + idle

    def acquire(self, req_id: str, h: bytes, length: int) -> tuple[tuple[int, ...], bool]:
        """Hold image `h` of `length` tokens for request `req_id`: (its pages, whether it
        must be encoded now). Check `can_take` first, and acquire the step's cached images
        before its new ones."""
        new = h not in self.slot_of
        if new:
            need = self.pages(length)
            while len(self.free) < need:
                old, _ = self.idle.popitem(last=False)
                self.free.extend(reversed(self.slot_of.pop(old)))
                self.holders.pop(old, None)
            self.slot_of[h] = tuple(self.free.pop() for _ in range(need))
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
        """Forget every image no request holds."""
        for h in self.idle:
            self.free.extend(self.slot_of.pop(h))
        self.idle.clear()

    def new_weights(self) -> None:
        """The encoder's weights changed: every embedding is stale, held ones too. All are
        forgotten: a request admitted now, or a holder's next chunk, encodes its image
        anew. A page given back here is written by a later step's encoder only, which
        runs after any step in flight that still reads it."""
        self.drop_idle()
        for pages in self.slot_of.values():
            self.free.extend(pages)
        self.slot_of.clear()
        self.holders.clear()
        self.held.clear()

    @property
    def usage(self) -> float:
        idle = sum(len(self.slot_of[h]) for h in self.idle)
        return 1.0 - (len(self.free) + idle) / max(1, self.num_pages)

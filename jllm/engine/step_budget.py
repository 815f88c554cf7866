"""What one step has room for while the scheduler fills it (`engine/scheduler.py`).

A step is bounded four ways: its tokens (`max_num_batched_tokens`, where a row of several
tokens costs whole tiles of the device batch when the attention backend lays them out in
tiles), the prompt tokens whose prompt logprobs it computes (the runner's fixed
`PROMPT_LOGPROB_ROWS`), the images its tokens touch (they must all be held in the encoder
cache at once) and the LoRA adapters of its requests (the device's slots). The scheduler asks
the budget how much of a row fits, takes what it schedules, and gives back the row of a
request it preempts after scheduling it earlier in the same step.

LoRA slots differ from the rest: a request pins its adapter's slot from admission until it
finishes or is preempted (the scheduler releases it then), so the budget only answers
whether an adapter can get a slot and takes one on admission.
Host-side only: no JAX import.
"""

from __future__ import annotations

from jllm.engine.encoder_cache import EncoderCache
from jllm.engine.request import Request
from jllm.lora.manager import LoraSlots
from jllm.scheduler_output import PROMPT_LOGPROB_ROWS
from jllm.utils import cdiv


def prompt_logprob_rows(req: Request, start: int, num_new: int) -> int:
    """Prompt tokens among positions start .. start + num_new - 1 whose prompt logprobs a
    step computes (every prompt token but the last, when the request asks)."""
    if req.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_new, req.num_prompt_tokens - 1) - start)


class StepBudget:
    def __init__(
        self,
        tokens: int,
        tile_size: int,
        encoder_cache: EncoderCache | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.tokens = tokens
        self.tile_size = tile_size
        self.logprob_rows = PROMPT_LOGPROB_ROWS
        self.images: dict[bytes, int] = {}  # the images this step's rows touch: their tokens
        self.encoder_cache = encoder_cache
        self.lora_slots = lora_slots

    def cost(self, n: int) -> int:
        """Budget a row of n tokens takes: n, or with tiles (`tile_size` > 1) several tokens
        (a prefill chunk or a verification row) occupy whole tiles of the device batch."""
        return n if n == 1 else cdiv(n, self.tile_size) * self.tile_size

    def fit(self, remaining: int) -> int:
        """How many of `remaining` tokens fit in what is left of the step (0 if none)."""
        if self.cost(remaining) <= self.tokens:
            return remaining
        tile = self.tile_size
        n = self.tokens // tile * tile
        return n if n > 1 else min(1, self.tokens)

    def fit_prompt_logprobs(self, req: Request, start: int, num_new: int) -> int:
        """`num_new` cut so that its prompt-logprob tokens fit the step's rows left; 0 when
        none fit."""
        room = self.logprob_rows
        if prompt_logprob_rows(req, start, num_new) <= room:
            return num_new
        return self.fit(room) if room > 0 else 0

    def fit_images(self, req: Request, start: int, end: int) -> int:
        """How many tokens of positions start .. end - 1 fit with the images they touch
        beside the step's others in the encoder cache: the row is cut before the first image
        that does not fit (0 when nothing does)."""
        while True:
            if end <= start:
                return 0
            touched = [it for it in req.mm_items if it.overlaps(start, end)]
            if self.encoder_cache.can_take(self.images | {it.hash: it.length for it in touched}):
                return end - start
            end = max(it.offset for it in touched)

    def adapter_fits(self, req: Request) -> bool:
        """Whether `req`'s adapter, if any, can get a device slot."""
        return req.lora is None or self.lora_slots.available(req.lora)

    def take_adapter(self, req: Request) -> int:
        """Pin a slot for `req`'s adapter (its 1-based slot; 0 without an adapter). Check
        `adapter_fits` first."""
        return 0 if req.lora is None else self.lora_slots.acquire(req.lora)

    def take(self, req: Request, start: int, num_new: int) -> None:
        """Schedule `num_new` tokens of `req` from position `start` (fitted above)."""
        self.tokens -= self.cost(num_new)
        self.logprob_rows -= prompt_logprob_rows(req, start, num_new)
        if self.encoder_cache is not None:
            touched = [it for it in req.mm_items if it.overlaps(start, start + num_new)]
            self.images |= {it.hash: it.length for it in touched}

    def give_back(self, req: Request, start: int, num_new: int) -> None:
        """Undo `take` for a row taken back out of the step (its request is preempted). Its
        images stay counted: another row may touch the same image, and the encoder cache
        releases the victim's images anyway, so keeping them only errs on the safe side."""
        self.tokens += self.cost(num_new)
        self.logprob_rows += prompt_logprob_rows(req, start, num_new)

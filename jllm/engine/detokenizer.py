"""Incremental detokenization and stop-string matching for one sequence.

Decoding the whole output every step is quadratic; instead each step decodes a short window
(`prefix_offset`..end) and emits only the text past what the window already produced, holding
back text that ends in an incomplete UTF-8 character. Host-side only: no JAX import.
"""

from __future__ import annotations

# Prompt tokens kept as left context, so that e.g. a leading space decodes as it would
# in the middle of the text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int) -> str | None:
        """Add one token; return the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        return self._check_stop(start) if self.stop else None

    def visible_text(self, finished: bool) -> str:
        """The text a stream may show now. Until the sequence ends, the last
        `len(longest stop) - 1` characters are held back (as vLLM does), since they may be the
        start of a stop string that must not appear in the output."""
        if finished or self.include_stop or self._max_stop_len <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - self._max_stop_len + 1)]

    def _check_stop(self, search_from: int) -> str | None:
        for stop in self.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(stop) if self.include_stop else idx]
                return stop
        return None

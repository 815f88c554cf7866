"""Incremental detokenization and stop-string matching for one sequence.

Decoding the whole output every step is quadratic. With a fast tokenizer each token goes
through the `tokenizers` library's `DecodeStream` (one decode step in Rust, primed with the
last prompt tokens), as vLLM's fast detokenizer does. Otherwise (a slow tokenizer, or one
that cleans up tokenization spaces, which the stream does not) each step decodes a short
window (`prefix_offset`..end) twice and emits only the text past what the window already
produced, holding back text that ends in an incomplete UTF-8 character. A slow tokenizer's
window is decoded by vLLM's rule for slow tokenizers, which is where
`spaces_between_special_tokens` applies (vLLM's fast path ignores it, and so does jllm's).

Stop strings: after each piece of text, the stop string that completes earliest in it ends
the sequence, ties going to the request's order (vLLM's rule). Only one that ends in the new
piece can be new, so the scan looks up the stop strings by their last character at each new
character: its cost follows the text, not the length of the stop list.
Host-side only: no JAX import.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as left context, so that e.g. a leading space decodes as it would
# in the middle of the text.
_CONTEXT_TOKENS = 5


def fast_backend(tokenizer) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` a transformers tokenizer decodes with, when a stream over it
    decodes exactly as `tokenizer.decode` does."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return None
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params, stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        # A slow tokenizer decodes by vLLM's rule for them (`_decode`), which is where
        # `spaces_between_special_tokens` applies; fast ones ignore it, as in vLLM.
        self._added = None
        if not getattr(tokenizer, "is_fast", True):
            self._added = set(tokenizer.get_added_vocab())
            self._special = set(tokenizer.all_special_tokens)
            self._num_ids = len(tokenizer)
        self._backend = fast_backend(tokenizer) if stream else None
        if self._backend is not None:
            self._stream = DecodeStream(
                ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]),
                skip_special_tokens=self.skip_special_tokens,
            )
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # vLLM's rule: stop strings count only in text that tokens past the first
        # `min_tokens` produced (a stop string may begin before them and end in it).
        self.min_tokens = params.min_tokens
        self._num_tokens = 0
        # Last character -> (position in the list, stop string), in the list's order.
        self._by_last: dict[str, list[tuple[int, str]]] = {}
        for i, stop in enumerate(self.stop):
            self._by_last.setdefault(stop[-1], []).append((i, stop))

    def _decode(self, ids: list[int]) -> str:
        if self._added is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # vLLM's rule for slow tokenizers: the text between added tokens is decoded in runs,
        # the added tokens are kept as they are (special ones dropped when skipped), and the
        # pieces are joined by a space when `spaces_between_special_tokens`.
        # An id past the tokenizer's vocabulary (a model's is often padded past it) decodes
        # to nothing, as in vLLM: a slow tokenizer's own conversion raises on it or gives None.
        tok = self.tokenizer
        pieces, run = [], []
        for token in tok.convert_ids_to_tokens([i for i in ids if 0 <= i < self._num_ids]):
            if not token or (self.skip_special_tokens and token in self._special):
                continue
            if token in self._added:
                if run:
                    pieces.append(tok.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(tok.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(pieces)

    def update(self, token_id: int) -> str | None:
        """Add one token; return the stop string it completed, if any."""
        self._num_tokens += 1
        if self._backend is not None:
            delta = self._stream.step(self._backend, token_id)
            if not delta:
                return None
            return self._append(delta)
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._append(full[len(prefix) :])

    def _append(self, delta: str) -> str | None:
        new_from = len(self.text)
        self.text += delta
        if not self.stop or (self.min_tokens and self._num_tokens <= self.min_tokens):
            return None
        return self._check_stop(new_from)

    def visible_len(self, finished: bool) -> int:
        """How much of the text a stream may show now. Until the sequence ends, the last
        `len(longest stop) - 1` characters are held back (as vLLM does), since they may be the
        start of a stop string that must not appear in the output."""
        if finished or self.include_stop or self._max_stop_len <= 1:
            return len(self.text)
        return max(0, len(self.text) - self._max_stop_len + 1)

    def _check_stop(self, new_from: int) -> str | None:
        """The stop string that completes earliest at or past `new_from` (ties: the first in
        the list's order), as vLLM's `check_stop_strings` picks it, so several characters
        at once (a token of several, speculative tokens) end where one at a time would.
        One that completed before `new_from` either ended the sequence already or completed
        while min_tokens held the check off, and does not count. The text is cut at it."""
        text = self.text
        for end in range(new_from, len(text)):
            for _, stop in self._by_last.get(text[end], ()):  # in the list's order
                begin = end - len(stop) + 1
                if begin >= 0 and text.startswith(stop, begin):
                    self.text = text[: end + 1 if self.include_stop else begin]
                    return stop
        return None

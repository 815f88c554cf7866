"""Structured outputs after the reasoning (vLLM's behaviour with `--reasoning-parser`): a
reasoning model thinks freely and its grammar applies from the token after the reasoning's
end tag (`</think>`; Qwen3's `<tool_call>`, which ends it implicitly, is the grammar's first
token). vLLM's `structured_outputs_config.enable_in_reasoning` applies it from the start.

`ReasoningGate` wraps a sequence's matcher behind the same interface (accept, fill,
rollback, is_terminated): while the reasoning lasts every token is allowed and none reaches
the matcher; rollback (rejected drafts) can undo the end tag itself.
"""

from __future__ import annotations

import numpy as np

_THINK, _END, _GRAMMAR = 0, 1, 2  # what each accepted token was


class ReasoningGate:
    def __init__(self, matcher, end_ids: frozenset, implicit_end_ids: frozenset, ended: bool):
        self._m = matcher
        self._end_ids, self._implicit = end_ids, implicit_end_ids
        self.ended = ended
        self._log: list[int] = []

    def accept(self, token: int) -> bool:
        if not self.ended:
            if token in self._end_ids:
                self.ended = True
                self._log.append(_END)
                return True
            if token not in self._implicit:
                self._log.append(_THINK)
                return True
            self.ended = True  # an implicit end is the grammar's first token
            if not self._m.accept(token):
                self.ended = False
                return False
            self._log.append(_END | _GRAMMAR)
            return True
        if not self._m.accept(token):
            return False
        self._log.append(_GRAMMAR)
        return True

    def fill(self, bitmask: np.ndarray, index: int) -> None:
        if self.ended:
            self._m.fill(bitmask, index)
        else:
            bitmask[index] = -1  # anything may follow while thinking

    def rollback(self, n: int) -> None:
        if not n:
            return
        undone = self._log[-n:]
        del self._log[-n:]
        self._m.rollback(sum(1 for kind in undone if kind & _GRAMMAR))
        if any(kind & _END for kind in undone):
            self.ended = False

    def is_terminated(self) -> bool:
        return self.ended and self._m.is_terminated()

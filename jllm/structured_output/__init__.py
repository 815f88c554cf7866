"""Structured outputs (vLLM's `structured_outputs` / guided decoding), host side.

`StructuredOutputManager` is the engine's part: it picks a request's grammar backend
(`backends.py`), validates its constraint for the front end, compiles grammars on a worker
thread with a cache (a request waits for its grammar outside the scheduler, so nothing else
waits for it), gives each sequence its own matcher, and fills the bitmask rows of the
sequences that sample in a step: one row per sample row, so a verification row's drafts
each get the mask of the state after the drafts before them. The runner applies the rows
on the device inside the sampler (`runner/sampler.py`). Host-side only: no JAX.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jllm.config.structured_outputs import StructuredOutputsConfig  # noqa: F401 (re-exported)
from jllm.reasoning import make_reasoning_parser
from jllm.sampling_params import StructuredOutputsParams
from jllm.structured_output.backends import (
    BACKEND_CLASSES,
    PACKAGES,
    bitmask_width,
    installed,
)
from jllm.structured_output.reasoning import ReasoningGate

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse, by constraint.
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_ids,
        config: StructuredOutputsConfig,
    ) -> None:
        self.config = config
        self.width = bitmask_width(vocab_size)
        self._args = (tokenizer, vocab_size, set(stop_ids))
        self._backends: dict[str, object] = {}
        self._lock = threading.Lock()  # the front end's thread and the engine's
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jllm-grammar")
        # The reasoning parser's tags gate each grammar (none: it applies from the start).
        self.reasoner = None
        if config.reasoning_parser and not config.enable_in_reasoning:
            self.reasoner = make_reasoning_parser(config.reasoning_parser, tokenizer)

    def _backend(self, name: str):
        backend = self._backends.get(name)
        if backend is not None:
            return backend
        if not installed(name):
            package = PACKAGES[name]
            raise ValueError(
                f"The {name!r} structured outputs backend needs the {package!r} "
                f"package: pip install {package}"
            )
        # Built outside the lock (reading the vocabulary takes about a second), so the
        # engine thread never waits for the front end's first use of a backend.
        backend = BACKEND_CLASSES[name](*self._args)
        with self._lock:
            return self._backends.setdefault(name, backend)

    def _with_engine_options(self, p: StructuredOutputsParams) -> StructuredOutputsParams:
        c = self.config
        return dataclasses.replace(
            p,
            disable_fallback=p.disable_fallback or c.disable_fallback,
            disable_any_whitespace=p.disable_any_whitespace or c.disable_any_whitespace,
            disable_additional_properties=(
                p.disable_additional_properties or c.disable_additional_properties
            ),
        )

    def validate(self, p: StructuredOutputsParams) -> StructuredOutputsParams:
        """The constraint with the engine's options and the backend it goes to (its
        `_backend`); raises ValueError naming the problem."""
        p = self._with_engine_options(p)
        p._backend = self._choose(p)
        return p

    def _choose(self, p: StructuredOutputsParams) -> str:
        name = self.config.backend
        if name != "auto":
            self._backend(name).validate(p)
            return name
        if not installed("xgrammar"):
            self._backend("guidance").validate(p)
            return "guidance"
        try:
            self._backend("xgrammar").validate(p)
            return "xgrammar"
        except ValueError as first:
            if p.disable_fallback or not installed("guidance"):
                raise
            try:
                self._backend("guidance").validate(p)
            except ValueError:
                raise first from None
            return "guidance"

    def resolve(self, params) -> None:
        """Validate a request's constraint once (the front end does it, so a bad one is a 400
        before anything is queued): `params.structured_outputs` gets the engine's options
        and its backend."""
        if params.structured_outputs._backend is None:
            params.structured_outputs = self.validate(params.structured_outputs)

    def compile(self, p: StructuredOutputsParams) -> Future:
        """The compiled grammar, on the worker thread (cached by constraint)."""
        backend = p._backend
        key = (backend, p.kind, str(p.spec), p.disable_any_whitespace)
        key += (p.disable_additional_properties, p.whitespace_pattern)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._backends_compile, backend, p)
            self._cache[key] = future
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def _backends_compile(self, backend: str, p: StructuredOutputsParams):
        return self._backend(backend).compile(p)

    def matcher(self, p: StructuredOutputsParams, compiled, prompt_token_ids=()):
        """A sequence's matcher; behind a reasoning gate when the engine has a reasoning
        parser (it opens at once if the prompt has already ended the reasoning)."""
        matcher = self._backend(p._backend).matcher(compiled)
        if self.reasoner is None or not any(self.reasoner.gate_ids()):
            return matcher
        ended = self.reasoner.ended_in(prompt_token_ids)
        return ReasoningGate(matcher, *self.reasoner.gate_ids(), ended)

    def valid_drafts(self, matcher, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts, up to its end (vLLM trims a
        grammar request's drafts so; a refused draft could never be emitted). The matcher is
        left as it was."""
        if matcher.is_terminated():
            return []
        accepted = 0
        for token in drafts:
            if not matcher.accept(token):
                break
            accepted += 1
            if matcher.is_terminated():
                break
        matcher.rollback(accepted)
        return drafts[:accepted]

    def bitmask(self, matcher, drafts: list[int]) -> np.ndarray:
        """[1 + len(drafts), W] int32: the mask now, then after each draft the grammar
        accepts (rows after a draft it refuses stay all-ones: they are never emitted, since
        that draft's row cannot sample it). The matcher is left as it was."""
        rows = np.full((1 + len(drafts), self.width), -1, np.int32)
        if matcher.is_terminated():
            return rows
        matcher.fill(rows, 0)
        accepted = 0
        for j, token in enumerate(drafts):
            if not matcher.accept(token):
                break
            accepted += 1
            if matcher.is_terminated():
                break
            matcher.fill(rows, j + 1)
        matcher.rollback(accepted)
        return rows

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""The batch-invariant mode (vLLM's `VLLM_BATCH_INVARIANT=1`; jllm's engine argument
`batch_invariant` sets it too): a request's tokens and logprobs are the same bits whatever
runs beside it, so that an RL trainer's recomputation matches the rollout's logprobs.

The ops that change with it read `enabled()` when they are traced (the LM head's product
routine, the attention kernel's decode rows, RMSNorm's sum; docs/sampling.md says what the
mode changes and where it holds). An engine's jitted steps take the mode as a static argument
and trace under `scope(mode)`, so two engines in one process each compile their own; outside
a scope it is the process's setting: `VLLM_BATCH_INVARIANT`, read once at import.
"""

from __future__ import annotations

import contextlib
import inspect
import os

_enabled = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() not in ("", "0", "false")


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def scope(on: bool):
    """The mode is `on` while a step is traced inside this block."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    try:
        yield
    finally:
        _enabled = before


def keyed(fn):
    """`fn` with a keyword-only `invariant` (default False) under whose mode it runs: made a
    static argument of the function's `jax.jit`, it keys the trace, and the ops read it
    while tracing. The signature is fn's plus that keyword, so that argument names
    (static, donated) resolve as before."""

    def run(*args, invariant=False, **kwargs):
        with scope(invariant):
            return fn(*args, **kwargs)

    signature = inspect.signature(fn)
    extra = inspect.Parameter("invariant", inspect.Parameter.KEYWORD_ONLY, default=False)
    run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), extra])
    run.__name__, run.__qualname__, run.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    run.__module__ = fn.__module__
    return run

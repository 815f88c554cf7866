"""Count JAX traces and compiles, to prove that none happens after warm-up.

The runner already refuses to compile a bucket once `compile_guard` is set; this watches JAX
itself (every jaxpr trace and backend compile anywhere in the process), so a stray jitted
helper in the hot path shows up too.
"""

from __future__ import annotations

import contextlib

import jax


class CompileAfterWarmupError(RuntimeError):
    """A step, encoder or copy needed an executable that was not compiled at start-up."""


_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_counters: list[list[str]] = []


def _listener(event: str, duration: float, **kwargs) -> None:
    if event in _EVENTS:
        for c in _counters:
            c.append(event)


jax.monitoring.register_event_duration_secs_listener(_listener)


@contextlib.contextmanager
def count_compiles():
    """`with count_compiles() as events:` collects the trace/compile events inside."""
    events: list[str] = []
    _counters.append(events)
    try:
        yield events
    finally:
        _counters.remove(events)

"""Keeping freed memory in the process's heap on the CPU backend (glibc's malloc, Linux).

XLA allocates a CPU executable's temporary buffers afresh on every run (a decode step of
SmolLM2 at 64 rows: one of 63 MB), above glibc's largest mmap threshold (32 MB): glibc maps
new pages for it, or a new heap for the thread that asks, and returns them when the step
frees it, so every step faulted on every page it touched: 6,600 page faults and 13-19 ms of
kernel time a step on a 2-core Zen 5, for a 51 ms step. With one malloc arena (from import:
a thread takes its arena at its first allocation, and XLA's threads start later) and, once the
model's weights are loaded, no mmap for large blocks and the heap's top trimmed only past
`KEEP` bytes, a step takes 1 fault and 2 ms of kernel time, 43-44 ms in all
(docs/performance.md). `JLLM_CPU_KEEP_HEAP=0` leaves glibc's defaults alone.

Host-side, no JAX: `jllm/__init__.py` calls `one_arena` before anything starts a thread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform

logger = logging.getLogger("jllm")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Free memory glibc keeps at the top of its heap instead of returning it to the system.
KEEP = 1 << 30
# JAX's accelerator plugins: with one installed the engine may not run on the CPU, and the
# import leaves the arenas alone.
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")


def _libc():
    """glibc's handle where this process runs on it and the setting allows, else None."""
    if os.environ.get("JLLM_CPU_KEEP_HEAP", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _cpu_only() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    for name in _ACCELERATOR_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return False
        except (ImportError, ValueError):
            continue
    return True


def one_arena() -> bool:
    """One malloc arena for every thread, where JAX can only run on the CPU here. Returns
    whether it was set."""
    libc = _libc()
    return bool(libc and _cpu_only() and libc.mallopt(_M_ARENA_MAX, 1) == 1)


def keep(backend: str) -> bool:
    """On the CPU backend: large blocks from the heap (no mmap), and its top trimmed only past
    KEEP. Called once the model's weights are loaded, so that what loading freed was returned
    as before. Returns whether it was set."""
    libc = _libc() if backend == "cpu" else None
    if not libc:
        return False
    if libc.mallopt(_M_MMAP_MAX, 0) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, KEEP) != 1:
        return False
    logger.info(
        "CPU: freed memory stays in the process's heap (up to %d MiB free at its top; "
        "JLLM_CPU_KEEP_HEAP=0 keeps glibc's defaults)",
        KEEP >> 20,
    )
    return True

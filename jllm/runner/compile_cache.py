"""XLA's persistent compilation cache, on by default like vLLM's compile cache.

Every bucket is compiled at start-up; with the cache, a restart with the same model and
settings loads the executables from disk instead of compiling them again. The directory is
`~/.cache/jllm/xla` (under XDG_CACHE_HOME when set), unless the user set one
(JAX_COMPILATION_CACHE_DIR or jax.config), which wins: TPU users keep it on a persistent
disk. Either way every executable is written, however fast it compiled: JAX's defaults only
keep those that took a second or more, and most buckets of a small model compile faster, so a
warm restart compiled them again. A threshold the user set (JAX's environment variable, or
`jax.config.update` to other than JAX's default) is left alone.
"""

from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger(__name__)

# JAX's settings that decide which executables the cache keeps: (JAX's default, jllm's, which
# keeps every one).
_KEEP_ALL = {
    "jax_persistent_cache_min_compile_time_secs": (1.0, 0.0),
    "jax_persistent_cache_min_entry_size_bytes": (0, 0),
}


# Executables compiled and loaded from the cache in this process (JAX's monitoring events).
CACHE_EVENTS = {"/jax/compilation_cache/cache_misses": 0, "/jax/compilation_cache/cache_hits": 0}


def _count(event: str, **kwargs) -> None:
    if event in CACHE_EVENTS:
        CACHE_EVENTS[event] += 1


jax.monitoring.register_event_listener(_count)


def cache_counts() -> tuple[int, int]:
    """(executables compiled, executables loaded from the cache) so far in this process."""
    return (
        CACHE_EVENTS["/jax/compilation_cache/cache_misses"],
        CACHE_EVENTS["/jax/compilation_cache/cache_hits"],
    )


def enable_compilation_cache() -> str | None:
    """Turn the cache on; returns its directory (logged), or None when it cannot be made."""
    path = jax.config.jax_compilation_cache_dir
    if not path:
        root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
        path = os.path.join(root, "jllm", "xla")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            logger.warning("No XLA compilation cache (%s): every start compiles.", e)
            return None
        jax.config.update("jax_compilation_cache_dir", path)
    for name, (default, value) in _KEEP_ALL.items():
        if name.upper() not in os.environ and getattr(jax.config, name) == default:
            jax.config.update(name, value)
    logger.info("XLA compilation cache: %s (JAX_COMPILATION_CACHE_DIR sets another).", path)
    return path

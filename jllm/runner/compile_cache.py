"""XLA's persistent compilation cache, on by default like vLLM's compile cache.

Every bucket is compiled at start-up; with the cache, a restart with the same model and
settings loads the executables from disk instead of compiling them again. A cache directory
set by the user (JAX_COMPILATION_CACHE_DIR or jax.config) wins.
"""

from __future__ import annotations

import os

import jax


def enable_compilation_cache() -> str | None:
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    path = os.path.join(root, "jllm", "xla")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path

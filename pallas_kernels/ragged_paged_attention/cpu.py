"""The CPU flavour of the kit: ragged paged attention as a C++ XLA FFI custom call.

Pallas has no CPU backend (only interpret mode), and XLA's own CPU attention spends most of
its time gathering pages and transposing them for small batched matmuls. This kernel
(``cpu_kernel.cc``) reads each request's pages in place and keeps the online softmax in
float32 registers. It is built once per machine with GCC (``$CXX``, default ``g++``;
``-O3 -march=native``; the source uses GCC's vector extension) against the FFI headers that
ship with jaxlib, and the shared library is kept under ``~/.cache/jllm/kernels``
(``$XDG_CACHE_HOME`` respected).

It takes the whole stacked cache ``[L, B, S, 2K, H]`` and a layer index rather than one
layer's slice, so that a model's scan over layers never copies a layer out of the cache.
Same arguments and results as ``ragged_paged_attention_reference`` otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .cache import is_fp8_cache
from .validation import as_stacked, validate_inputs, validate_options

logger = logging.getLogger(__name__)

TARGET = "jllm_ragged_paged_attention_cpu"
SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernel.cc")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# -fassociative-math (and the two flags it needs) lets the compiler vectorize the float
# reductions; no -ffast-math, whose finite-math assumption would break the -inf masking.
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)


class CpuKernelUnavailable(RuntimeError):
    """The kernel could not be built here (no C++ compiler, or it failed)."""


# Headers the kernels share (cpu_pool.h, cpu_fp8.h, cpu_silu.h): on the include path, and
# part of the cache key.
INCLUDE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADERS = tuple(os.path.join(INCLUDE, h) for h in ("cpu_pool.h", "cpu_fp8.h", "cpu_silu.h"))


def _cpu_fingerprint() -> str:
    # -march=native makes the library specific to this CPU's instruction set.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> set[str]:
    """The x86 feature flags of this CPU as /proc/cpuinfo names them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _library_path(compiler: str, source_path: str, stem: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    sources = []
    for path in (source_path, *HEADERS):
        with open(path) as f:
            sources.append(f.read())
    key = hashlib.sha256()
    for part in (
        *sources,
        " ".join(FLAGS),
        version,
        jax.__version__,
        importlib.metadata.version("jaxlib"),  # the FFI headers come from jaxlib
        jax.ffi.include_dir(),
        platform.machine(),
        _cpu_fingerprint(),
    ):
        key.update(part.encode())
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(root, "jllm", "kernels", f"{stem}_{key.hexdigest()[:16]}.so")


def _build(compiler: str, path: str, source: str, what: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Build to a temporary name and rename: processes starting together (one per host or
    # device) may all build, and none may load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), "-I", INCLUDE, source, "-o", tmp]
    logger.info("Building the %s: %s", what, " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CpuKernelUnavailable(
                f"building {source} failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}"
            )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(source: str, stem: str, what: str) -> ctypes.CDLL:
    """Builds a C++ FFI source once per machine (GCC flags `FLAGS`, jaxlib's FFI headers)
    into the kernel cache and loads it. Raises CpuKernelUnavailable when there is no C++
    compiler (`$CXX`, default g++) or the build fails."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise CpuKernelUnavailable(
            f"no C++ compiler {compiler!r} on PATH (set CXX, or install g++)"
        )
    try:
        path = _library_path(compiler, source, stem)
        if not os.path.exists(path):
            _build(compiler, path, source, what)
        return ctypes.cdll.LoadLibrary(path)
    except (OSError, subprocess.CalledProcessError) as e:  # unwritable cache, noexec
        raise CpuKernelUnavailable(f"cannot build or load the {what}: {e}") from e


class FfiKernel:
    """A C++ FFI source built once per machine (`build_library`) and registered once per
    process under `target`; a failed build is not retried in this process.

    warn: log the reason at the first failure (for a caller that falls back silently)."""

    def __init__(self, source: str, stem: str, what: str, symbol: str, target: str, warn=False):
        self.source, self.stem, self.what = source, stem, what
        self.symbol, self.target, self.warn = symbol, target, warn
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}  # "target" once registered, or "failure"

    def load(self) -> str:
        """Builds and registers the kernel; returns its FFI target name. Raises
        CpuKernelUnavailable when there is no C++ compiler or the build fails."""
        with self._lock:
            if "target" in self._state:
                return self._state["target"]
            if "failure" in self._state:
                raise self._state["failure"]
            try:
                library = build_library(self.source, self.stem, self.what)
            except CpuKernelUnavailable as e:
                self._state["failure"] = e
                if self.warn:
                    logger.warning("The %s is unavailable: %s", self.what, e)
                raise
            capsule = jax.ffi.pycapsule(getattr(library, self.symbol))
            jax.ffi.register_ffi_target(self.target, capsule, platform="cpu")
            self._state["target"] = self.target
            return self.target


ATTENTION = FfiKernel(
    SOURCE, "ragged_paged_attention", "CPU attention kernel", "JllmRaggedPagedAttention", TARGET
)


def load_cpu_kernel() -> str:
    """Builds (once per machine) and registers the kernel; returns the FFI target name.

    Raises CpuKernelUnavailable when there is no C++ compiler or the build fails.
    """
    return ATTENTION.load()


def _checked_args(
    q, kv_cache, layer, kv_lens, block_tables, query_start, query_lens, num_seqs, fp8_dtype
):
    """Validates the arguments and returns them as the FFI call takes them: the stacked cache
    and the layer and num_seqs as int32 [1]."""
    kv_cache, layer, layer_view = as_stacked(kv_cache, layer)
    validate_inputs(
        q, layer_view, kv_lens, block_tables, query_start, query_lens, num_seqs, fp8_dtype
    )
    fp8 = is_fp8_cache(kv_cache.dtype, fp8_dtype)
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES or not (fp8 or q.dtype == kv_cache.dtype):
        raise ValueError(
            f"the CPU kernel takes float32 or bfloat16 q and a kv_cache of q's dtype or a "
            f"float8 one, got q {q.dtype} and kv_cache {kv_cache.dtype}"
        )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(1)
    return q, kv_cache, layer, kv_lens, block_tables, query_start, query_lens, num_seqs


def _scale(q, sm_scale) -> np.float32:
    validate_options(sm_scale, None, None)
    return np.float32(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)


# The float8 format of a uint8 cache, as the kernel's `fp8` attribute (0: not float8 bytes).
FP8_FORMATS = {jnp.dtype(jnp.float8_e4m3fn): 1, jnp.dtype(jnp.float8_e5m2): 2}


def _call(*args, sm_scale, fp8_dtype=None):
    """The FFI call on checked arguments (q first)."""
    q = args[0]
    fp8 = np.int64(0 if fp8_dtype is None else FP8_FORMATS[jnp.dtype(fp8_dtype)])
    return jax.ffi.ffi_call(load_cpu_kernel(), jax.ShapeDtypeStruct(q.shape, q.dtype))(
        *args, sm_scale=sm_scale, fp8=fp8
    )


def ragged_paged_attention_cpu(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start: jax.Array,
    query_lens: jax.Array,
    num_seqs,
    *,
    layer=None,
    sm_scale: float | None = None,
    fp8_dtype=None,
) -> jax.Array:
    """Ragged paged attention on the CPU; the reference's arguments and result.

    kv_cache is one layer [B, S, 2K, H], or the stacked cache [L, B, S, 2K, H] with `layer`
    (an int or an int32 scalar array, traced or not) picking the layer to read; of q's
    dtype, or float8 (an array of that dtype, or uint8 bytes with `fp8_dtype`).
    """
    args = _checked_args(
        q, kv_cache, layer, kv_lens, block_tables, query_start, query_lens, num_seqs, fp8_dtype
    )
    return _call(*args, sm_scale=_scale(q, sm_scale), fp8_dtype=fp8_dtype)


def ragged_paged_attention_cpu_sharded(
    mesh,
    axis: str,
    q,
    kv_cache,
    layer,
    kv_lens,
    block_tables,
    query_start,
    query_lens,
    num_seqs,
    *,
    sm_scale: float | None = None,
    fp8_dtype=None,
):
    """The CPU kernel with heads split over `mesh` axis `axis` (as in sharded.py): each device
    runs it on its own query heads and kv heads; kv_cache is the stacked cache."""
    args = _checked_args(
        q, kv_cache, layer, kv_lens, block_tables, query_start, query_lens, num_seqs, fp8_dtype
    )
    heads = P(None, axis, None)
    replicated = (P(),) * 6
    return jax.shard_map(
        functools.partial(_call, sm_scale=_scale(q, sm_scale), fp8_dtype=fp8_dtype),
        mesh=mesh,
        in_specs=(heads, P(None, None, None, axis, None), *replicated),
        out_specs=heads,
        check_vma=False,
    )(*args)

"""Build, cache and FFI registration for the C++ CPU kernels.

Every C++ kernel (the attention kit's `ragged_paged_attention/cpu_kernel.cc`, and this
folder's layer products: `f32_matmul.cc`, `bf16_matmul.cc`, `quantized_matmul.cc`) is built
once per machine with GCC (`$CXX`, default `g++`; `-O3 -march=native`; the sources use GCC's
vector extension) against the FFI headers that ship with jaxlib, with this folder on the
include path for the headers they share (`cpu_pool.h`, `cpu_fp8.h`, `cpu_silu.h`). The
shared library is kept under `~/.cache/jllm/kernels` (`$XDG_CACHE_HOME` respected), keyed by
the source, the headers, the flags, the compiler, jax and jaxlib, and this CPU's flags. An
`FfiKernel` registers one symbol of a library once per process as an XLA FFI target.

Host-side machinery only: which kernel a model uses is decided by the callers.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

logger = logging.getLogger(__name__)

# This folder: the shared headers and the layer-product kernels.
INCLUDE = os.path.dirname(os.path.abspath(__file__))
HEADERS = tuple(
    os.path.join(INCLUDE, h) for h in ("cpu_pool.h", "cpu_fp8.h", "cpu_silu.h", "cpu_bf16.h")
)
# Every FfiKernel made in this process, for the checks that the package ships their sources.
KERNELS: list[FfiKernel] = []

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


# For kernels whose sums must run in the order their source writes them (the layer products:
# the batch-invariant mode needs a row's result not to depend on how many rows share the
# call): no reassociation, and no multiply-add fused where the source does not say so (GCC's
# default contraction would fuse some in one instantiation and not in another).
EXACT_ORDER = ("-fno-associative-math", "-ffp-contract=off")


class CpuKernelUnavailable(RuntimeError):
    """The kernel could not be built here (no C++ compiler, or it failed)."""


def tracing_for_cpu() -> bool:
    """Whether the computation being traced will run on the CPU, so that a CPU kernel may be
    called in it: JAX's default backend is the CPU, and the abstract mesh, where it names a
    device (as a lowering for TPU or CUDA from a CPU host does), names a CPU."""
    if jax.default_backend() != "cpu":
        return False
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device is None or device.platform == "cpu"


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


def _library_path(compiler: str, source_path: str, stem: str, flags=FLAGS) -> str:
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
        " ".join(flags),
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


def _build(compiler: str, path: str, source: str, what: str, flags=FLAGS) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Build to a temporary name and rename: processes starting together (one per host or
    # device) may all build, and none may load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [compiler, *flags, "-I", jax.ffi.include_dir(), "-I", INCLUDE, source, "-o", tmp]
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


def build_library(source: str, stem: str, what: str, extra_flags=()) -> ctypes.CDLL:
    """Builds a C++ FFI source once per machine (GCC flags `FLAGS`, then `extra_flags`;
    jaxlib's FFI headers) into the kernel cache and loads it. Raises CpuKernelUnavailable
    when there is no C++ compiler (`$CXX`, default g++) or the build fails."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise CpuKernelUnavailable(
            f"no C++ compiler {compiler!r} on PATH (set CXX, or install g++)"
        )
    try:
        flags = (*FLAGS, *extra_flags)
        path = _library_path(compiler, source, stem, flags)
        if not os.path.exists(path):
            _build(compiler, path, source, what, flags)
        return ctypes.cdll.LoadLibrary(path)
    except (OSError, subprocess.CalledProcessError) as e:  # unwritable cache, noexec
        raise CpuKernelUnavailable(f"cannot build or load the {what}: {e}") from e


class FfiKernel:
    """A C++ FFI source built once per machine (`build_library`) and registered once per
    process under `target`; a failed build is not retried in this process.

    warn: log the reason at the first failure (for a caller that falls back silently).
    extra_flags: GCC flags after `FLAGS` (`EXACT_ORDER` for the layer products)."""

    def __init__(
        self,
        source: str,
        stem: str,
        what: str,
        symbol: str,
        target: str,
        warn=False,
        extra_flags=(),
    ):
        self.source, self.stem, self.what = source, stem, what
        self.extra_flags = tuple(extra_flags)
        self.symbol, self.target, self.warn = symbol, target, warn
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}  # "target" once registered, or "failure"
        KERNELS.append(self)

    def load(self) -> str:
        """Builds and registers the kernel; returns its FFI target name. Raises
        CpuKernelUnavailable when there is no C++ compiler or the build fails."""
        with self._lock:
            if "target" in self._state:
                return self._state["target"]
            if "failure" in self._state:
                raise self._state["failure"]
            try:
                library = build_library(self.source, self.stem, self.what, self.extra_flags)
            except CpuKernelUnavailable as e:
                self._state["failure"] = e
                if self.warn:
                    logger.warning("The %s is unavailable: %s", self.what, e)
                raise
            capsule = jax.ffi.pycapsule(getattr(library, self.symbol))
            jax.ffi.register_ffi_target(self.target, capsule, platform="cpu")
            self._state["target"] = self.target
            return self.target

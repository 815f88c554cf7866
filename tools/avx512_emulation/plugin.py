"""pytest plugin: run the C++ kernels' AVX-512 builds on a CPU without AVX-512.

    python -m pytest -p tools.avx512_emulation.plugin tests/pallas_kernels ...

(`make test-avx512-emulated` runs the kernel tests so.) Every kernel is then built as for a
CPU with AVX-512 and AVX512-BF16 (a Zen 4): the `__AVX512*__` macros set, so the AVX-512
branches compile, with SIMDe's portable code standing in for the intrinsics (this folder's
immintrin.h), and the CPU's flags read as that CPU's, so the engine picks the kernels it would
pick there. It checks what the kernels compute, not their speed: an emulated build runs
several times slower.

`JLLM_EMULATED_CPU=amx` makes that CPU a Xeon with AMX instead (Sapphire Rapids: the same
flags and AMX-TILE, AMX-BF16): the bf16 kernel's tile paths build too, the tiles from
immintrin.h's portable stand-ins, so they run (slowly) on any CPU.

Needs SIMDe's headers: Debian's and Ubuntu's `libsimde-dev`, or a checkout of
github.com/simd-everywhere/simde named by `SIMDE_INCLUDE` (the folder that holds `simde/`).
"""

import os
import pathlib

import pytest

import pallas_kernels.cpu.build as cpu

HERE = pathlib.Path(__file__).resolve().parent
# Those of /proc/cpuinfo's flags on the 2-core Zen 4 (where the AVX-512 kernels were written)
# that jllm reads.
ZEN4_FLAGS = {
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
}
# What a Xeon with AMX adds to them.
AMX_FLAGS = {"amx_tile", "amx_bf16"}
AMX_MACROS = ("__AMX_TILE__", "__AMX_BF16__")
MACROS = (
    "__AVX512F__",
    "__AVX512DQ__",
    "__AVX512CD__",
    "__AVX512BW__",
    "__AVX512VL__",
    "__AVX512BF16__",
)


def _simde_include() -> list[str]:
    where = os.environ.get("SIMDE_INCLUDE")
    if where:
        if not os.path.exists(os.path.join(where, "simde", "x86", "avx512.h")):
            raise pytest.UsageError(f"SIMDE_INCLUDE={where} holds no simde/x86/avx512.h")
        return ["-I", where]
    if not os.path.exists("/usr/include/simde/x86/avx512.h"):
        raise pytest.UsageError(
            "the AVX-512 emulation needs SIMDe's headers: apt-get install libsimde-dev, or "
            "SIMDE_INCLUDE=<a checkout of github.com/simd-everywhere/simde>"
        )
    return []


def _emulated_cpu() -> str:
    cpu_kind = os.environ.get("JLLM_EMULATED_CPU", "zen4")
    if cpu_kind not in ("zen4", "amx"):
        raise pytest.UsageError(f"JLLM_EMULATED_CPU={cpu_kind}: zen4 (the default) or amx")
    return cpu_kind


def _emulate() -> None:
    # -march=x86-64-v3 (AVX2, FMA, F16C): the kernels' GCC-vector code compiles to AVX2;
    # every intrinsic, AVX2 ones included, comes from SIMDe. No -fassociative-math: SIMDe's
    # stand-ins are plain float arithmetic, which it lets GCC reorder differently where each
    # is inlined, when the real instructions are each one operation; the batch-invariance
    # tests then see rows differ in the last bit with the tile they fall in.
    flags = [f for f in cpu.FLAGS if f not in ("-march=native", "-fassociative-math")]
    amx = _emulated_cpu() == "amx"
    macros = MACROS + (AMX_MACROS if amx else ())
    flags += ["-march=x86-64-v3", *(f"-D{m}" for m in macros)]
    flags += ["-DJLLM_AVX512_EMULATION", "-Wno-psabi", "-I", str(HERE), *_simde_include()]
    cpu.FLAGS = tuple(flags)  # part of the kernel cache's key: native builds stay apart
    native = cpu.cpu_flags
    emulated = ZEN4_FLAGS | (AMX_FLAGS if amx else set())
    cpu.cpu_flags = lambda: native() | emulated
    build = cpu.build_library

    def build_library(source, stem, what, extra_flags=()):
        # A build without AVX-512 or the tiles (-mno-avx512f, -mno-amx-tile) loses their
        # macros, as GCC's own would.
        if "-mno-avx512f" in extra_flags:
            extra_flags = (*extra_flags, *(f"-U{m}" for m in MACROS + AMX_MACROS))
        elif "-mno-amx-tile" in extra_flags:
            extra_flags = (*extra_flags, *(f"-U{m}" for m in AMX_MACROS))
        return build(source, stem, what, extra_flags)

    cpu.build_library = build_library


# At import, before a test module or conftest imports cpu_flags by name.
_emulate()


def pytest_sessionstart(session):
    # Every kernel built here first: a build that failed would otherwise send the engine's
    # tests to XLA's ops (the fallback without a kernel), and they would pass on those.
    from jllm.models import bf16_matmul, f32_matmul, layer_ops
    from jllm.quantization import cpu_kernel
    from pallas_kernels.ragged_paged_attention.cpu import ATTENTION

    kernels = (ATTENTION, f32_matmul.KERNEL, bf16_matmul.KERNEL, layer_ops.NORM, cpu_kernel.KERNEL)
    for kernel in kernels:
        try:
            cpu.build_library(kernel.source, kernel.stem, kernel.what, kernel.extra_flags)
        except cpu.CpuKernelUnavailable as e:
            pytest.exit(f"the emulated build failed: {e}", returncode=1)


def pytest_report_header(config):
    if _emulated_cpu() == "amx":
        return "AVX-512 and AMX emulation: kernels built for a Xeon with AMX, intrinsics portable"
    return "AVX-512 emulation: kernels built for a Zen 4 (AVX512-BF16), intrinsics from SIMDe"

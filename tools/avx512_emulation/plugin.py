"""pytest plugin: run the C++ kernels' AVX-512 builds on a CPU without AVX-512.

    python -m pytest -p tools.avx512_emulation.plugin tests/pallas_kernels ...

(`make test-avx512-emulated` runs the kernel tests so.) Every kernel is then built as for a
CPU with AVX-512 and AVX512-BF16 (a Zen 4): the `__AVX512*__` macros set, so the AVX-512
branches compile, with SIMDe's portable code standing in for the intrinsics (this folder's
immintrin.h), and the CPU's flags read as that CPU's, so the engine picks the kernels it would
pick there. It checks what the kernels compute, not their speed: an emulated build runs
several times slower.

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


def _emulate() -> None:
    # -march=x86-64-v3 (AVX2, FMA, F16C): the kernels' GCC-vector code compiles to AVX2;
    # every intrinsic, AVX2 ones included, comes from SIMDe. No -fassociative-math: SIMDe's
    # stand-ins are plain float arithmetic, which it lets GCC reorder differently where each
    # is inlined, when the real instructions are each one operation; the batch-invariance
    # tests then see rows differ in the last bit with the tile they fall in.
    flags = [f for f in cpu.FLAGS if f not in ("-march=native", "-fassociative-math")]
    flags += ["-march=x86-64-v3", *(f"-D{m}" for m in MACROS)]
    flags += ["-DJLLM_AVX512_EMULATION", "-Wno-psabi", "-I", str(HERE), *_simde_include()]
    cpu.FLAGS = tuple(flags)  # part of the kernel cache's key: native builds stay apart
    native = cpu.cpu_flags
    cpu.cpu_flags = lambda: native() | ZEN4_FLAGS


# At import, before a test module or conftest imports cpu_flags by name.
_emulate()


def pytest_sessionstart(session):
    # Every kernel built here first: a build that failed would otherwise send the engine's
    # tests to XLA's ops (the fallback without a kernel), and they would pass on those.
    from jllm.models import bf16_matmul, f32_matmul
    from jllm.quantization import cpu_kernel
    from pallas_kernels.ragged_paged_attention.cpu import ATTENTION

    for kernel in (ATTENTION, f32_matmul.KERNEL, bf16_matmul.KERNEL, cpu_kernel.KERNEL):
        try:
            cpu.build_library(kernel.source, kernel.stem, kernel.what)
        except cpu.CpuKernelUnavailable as e:
            pytest.exit(f"the emulated build failed: {e}", returncode=1)


def pytest_report_header(config):
    return "AVX-512 emulation: kernels built for a Zen 4 (AVX512-BF16), intrinsics from SIMDe"

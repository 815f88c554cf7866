"""jllm/cpu_heap.py: on the CPU backend under glibc, a large block freed and taken again
comes back from the heap, already mapped, instead of as fresh pages that fault when touched
(XLA's per-step temporaries, docs/cpu.md#memory)."""

import os
import platform
import subprocess
import sys

import pytest

from jllm import cpu_heap

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Touches a freed 64 MB block's pages again and prints the minor faults that took: with the
# heap kept, none; with glibc's defaults (above its mmap threshold) one per page.
_PROBE = """
import ctypes, resource, sys
from jllm import cpu_heap
print(cpu_heap.keep(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)
ctypes.memset(block, 2, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
libc.free(block)
"""


def _probe(backend: str, **env) -> tuple[bool, int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, backend],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    applied, faults = done.stdout.split()
    return applied == "True", int(faults)


@glibc
def test_cpu_backend_keeps_freed_blocks_mapped():
    applied, faults = _probe("cpu")
    assert applied
    assert faults < 100  # 16,384 pages were touched


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@glibc
def test_opt_out_and_other_backends_keep_glibcs_defaults():
    applied, faults = _probe("cpu", JLLM_CPU_KEEP_HEAP="0")
    assert not applied
    if not _huge_pages_always():  # with them, a fresh 64 MB map faults once per 2 MB
        assert faults > 10_000  # each page faulted again
    applied, _ = _probe("gpu")
    assert not applied


def test_accelerator_plugins_leave_the_arenas_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setattr(cpu_heap.importlib.util, "find_spec", lambda name: object())
    assert not cpu_heap._cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cpu_heap._cpu_only()

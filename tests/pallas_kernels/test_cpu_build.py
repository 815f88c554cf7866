"""The CPU kernels' package ships what their build reads: a wheel built from the repository
holds every C++ source an `FfiKernel` of the code loads, and every header those sources and
the build's include list name. (An editable install reads the repository, so only a wheel
shows a source that package data forgets.)"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import jllm.models.bf16_matmul  # noqa: F401  (each module makes its FfiKernels)
import jllm.models.f32_matmul  # noqa: F401
import jllm.quantization.cpu_kernel  # noqa: F401
import pallas_kernels.ragged_paged_attention.cpu  # noqa: F401
from pallas_kernels.cpu.build import HEADERS, INCLUDE, KERNELS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def needed_files() -> set[str]:
    """Repository-relative paths of every source the kernels build from, with the headers
    they include from this repository."""
    paths = {pathlib.Path(k.source).resolve() for k in KERNELS} | {
        pathlib.Path(h).resolve() for h in HEADERS
    }
    for source in list(paths):
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M):
            for folder in (source.parent, pathlib.Path(INCLUDE)):
                if (folder / name).exists():
                    paths.add((folder / name).resolve())
    return {str(p.relative_to(ROOT)) for p in paths}


def test_kernels_known():
    sources = {pathlib.Path(k.source).name for k in KERNELS}
    assert {"cpu_kernel.cc", "f32_matmul.cc", "bf16_matmul.cc", "quantized_matmul.cc"} <= sources


def test_wheel_ships_every_kernel_source(tmp_path):
    # Built from a copy of what a clean checkout holds, so no build/ folder left by an
    # earlier build can supply a file that the package data misses.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("jllm", "pallas_kernels", "sharding"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("jllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(needed_files() - names)
    assert not missing, f"the wheel lacks {missing}"

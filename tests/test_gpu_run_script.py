"""`benchmarks/gpu/run.sh --dry-run`: the GPU run's script end to end on this machine with a
tiny config (jllm and the transformers peer, every workload, the table), so the script a GPU
session runs is known to work before one comes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_script_dry_run(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("| workload |") :]
    for name in ("sharegpt", "random", "single", "ttft"):
        assert f"| {name} |" in table
    results = json.loads((tmp_path / "results.json").read_text())
    for name, r in results["results"].items():
        assert r["jllm"]["tokens"] == r["hf"]["tokens"] > 0, name
    assert results["results"]["single"]["jllm"]["decode_tok_s"] > 0
    assert (tmp_path / "bench.log").exists() and (tmp_path / "devices.log").exists()

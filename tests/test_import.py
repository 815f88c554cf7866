"""Importing jllm without PyTorch stays quiet: transformers' "PyTorch was not found" notice
is for its model classes, which jllm never uses."""

from __future__ import annotations

import subprocess
import sys

HIDE_TORCH = """
import importlib.util
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name == "torch" else find(name, *a, **k)
import jllm
import transformers
from jllm.model_loader import resolve_model
assert not transformers.utils.is_torch_available()
"""


def test_no_pytorch_notice_without_torch():
    done = subprocess.run(
        [sys.executable, "-c", HIDE_TORCH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr + done.stdout
    # The notice is what transformers prints without jllm's setting.
    bare = HIDE_TORCH.replace("import jllm\n", "").replace(
        "from jllm.model_loader import resolve_model\n", ""
    )
    done = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, timeout=120)
    assert "PyTorch was not found" in done.stderr + done.stdout


ALLOCATOR = """
import os, sys
import jllm
from jllm.runner.kv_cache import allocator_fraction
share = os.environ.get("XLA_CLIENT_MEM_FRACTION")
print(share, allocator_fraction("gpu"), allocator_fraction("tpu"))
"""


def test_jax_gpu_allocator_share_is_raised_unless_the_user_chose():
    """vLLM's gpu_memory_utilization is a share of the whole device: importing jllm lets
    JAX's GPU allocator take 0.95 of it (JAX's default is 0.75), unless any allocator
    variable is set, and the KV sizing reads the share in effect."""
    import os

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("XLA_CLIENT_", "XLA_PYTHON_CLIENT_"))
    }

    def run(**extra):
        done = subprocess.run(
            [sys.executable, "-c", ALLOCATOR],
            capture_output=True,
            text=True,
            timeout=120,
            env=env | extra,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert run() == ["0.95", "0.95", "1.0"]
    assert run(XLA_PYTHON_CLIENT_MEM_FRACTION="0.5") == ["None", "0.5", "1.0"]
    assert run(XLA_PYTHON_CLIENT_PREALLOCATE="false") == ["None", "0.75", "1.0"]
